"""`quantkit convert`: stream a checkpoint shard by shard into a compressed-tensors checkpoint.

Pipeline (one way): open + validate the source -> plan every shard (recipe matched to tensors, output
shapes fixed, group sizes checked: nothing is written before the whole plan is valid) -> for each source
shard, read its tensors lazily, quantize routed experts in batches, stream the output shard to a
temporary file and rename it -> write the index, config.json, copied files, and the manifest last.

Each source shard maps to its own output shard(s), so shards are independent units of work: they can
run in parallel (`workers`), resume after a crash (a journal records each finished shard), and the
output is byte-identical whatever the order they finish in.

Memory: one work batch (at most `batch_bytes` of source weights, all experts of a layer that fit) plus
the pages of the source shard being read; never the model.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import __version__
from .errors import GroupSizeError, NonFiniteWeight, OutputExists, QuantkitError, ResumeMismatch
from .io.checkpoint import INDEX_NAME, Checkpoint, Shard
from .io.safetensors import SafetensorsFile, TensorInfo
from .io.writer import ShardWriter, copy_file_atomic, sha256_file, write_json_atomic
from .quant.int4 import pack_int4, rtn
from .recipe import Recipe, Scheme, WeightGroup, load_recipe

MANIFEST_NAME = "quantkit_manifest.json"
JOURNAL_DIR = ".quantkit-journal"
DEFAULT_BATCH_BYTES = 256 << 20
DEFAULT_MAX_SHARD_BYTES = 5 << 30
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Fused on-disk experts (transformers 5 layout): experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


# ---- plan ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SourceRef:
    """Where a 2-D weight comes from: a whole tensor, or rows r0:r1 of expert e of a fused 3-D tensor."""

    tensor: str
    expert: int | None = None
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class QuantItem:
    module: str  # output module name, e.g. model.layers.3.mlp.experts.7.down_proj
    source: SourceRef
    shape: tuple[int, int]  # [out, in]


@dataclass(frozen=True)
class Unit:
    """One step of work: copy a tensor, or quantize a batch of same-shape weights with one scheme."""

    kind: str  # "copy" | "quant"
    tensor: str | None = None  # copy: source tensor name
    items: tuple[QuantItem, ...] = ()
    group: WeightGroup | None = None
    scheme: Scheme | None = None
    src_dtype: torch.dtype | None = None

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.src_dtype if self.src_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def quant_outputs(module: str, shape: tuple[int, int], scheme: Scheme, scale_dtype: torch.dtype):
    """(name, dtype, shape) of the tensors that replace `module.weight` (compressed-tensors pack-quantized)."""
    n, k = shape
    groups = 1 if scheme.strategy == "channel" else k // scheme.group_size
    out = [(f"{module}.weight_packed", torch.int32, (n, (k + 7) // 8)),
           (f"{module}.weight_scale", scale_dtype, (n, groups)),
           (f"{module}.weight_shape", torch.int64, (2,))]
    if not scheme.symmetric:
        out.append((f"{module}.weight_zero_point", torch.int32, ((n + 7) // 8, groups)))
    return out


def unit_outputs(u: Unit, info: Callable[[str], TensorInfo]):
    if u.kind == "copy":
        i = info(u.tensor)
        return [(u.tensor, i.dtype, i.shape)]
    return [spec for it in u.items for spec in quant_outputs(it.module, it.shape, u.scheme, u.scale_dtype)]


def _spec_bytes(specs) -> int:
    from .io.writer import ELEMENT_SIZE

    total = 0
    for _, dtype, shape in specs:
        n = ELEMENT_SIZE[dtype]
        for d in shape:
            n *= d
        total += n
    return total


@dataclass(frozen=True)
class ShardPlan:
    """A source shard and the output shard(s) it becomes: one, or several parts when its output would
    exceed the shard size limit."""

    source: str  # source shard file name
    parts: tuple[tuple[str, tuple[Unit, ...]], ...]  # (output file name, units written to it)

    @property
    def units(self) -> tuple[Unit, ...]:
        return tuple(u for _, us in self.parts for u in us)


def split_parts(output: str, units: list[Unit], info: Callable[[str], TensorInfo], max_bytes: int):
    parts: list[list[Unit]] = [[]]
    size = 0
    for u in units:
        b = _spec_bytes(unit_outputs(u, info))
        if parts[-1] and size + b > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append(u)
        size += b
    if len(parts) == 1:
        return ((output, tuple(parts[0])),)
    stem = output.removesuffix(".safetensors")
    return tuple((f"{stem}-part{i + 1:03d}of{len(parts):03d}.safetensors", tuple(p)) for i, p in enumerate(parts))


def _split_fused(name: str, info: TensorInfo, hidden: int | None):
    """Per-expert (module, SourceRef, shape) for a fused 3-D expert tensor, or None if not fused."""
    m = _FUSED.match(name)
    if not m or len(info.shape) != 3:
        return None
    e_count, a, b = info.shape
    prefix, kind = m["prefix"], m["kind"]
    in_dim_is_hidden = b == hidden if kind == "gate_up_proj" else a == hidden  # H is in for gate_up, out for down
    if hidden is not None and not in_dim_is_hidden:
        raise QuantkitError(
            f"fused expert tensor {name} {list(info.shape)} is not in the [experts, out, in] layout",
            hint="only the transformers layout gate_up_proj [E, 2*I, H] / down_proj [E, H, I] is supported")
    out = []
    for e in range(e_count):
        if kind == "gate_up_proj":
            half = a // 2
            out.append((f"{prefix}.{e}.gate_proj", SourceRef(name, e, (0, half)), (half, b)))
            out.append((f"{prefix}.{e}.up_proj", SourceRef(name, e, (half, a)), (half, b)))
        else:
            out.append((f"{prefix}.{e}.down_proj", SourceRef(name, e, (0, a)), (a, b)))
    return out


def plan_shard(shard: Shard, output: str, recipe: Recipe, hidden: int | None,
               batch_bytes: int = DEFAULT_BATCH_BYTES, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> ShardPlan:
    """Match every tensor of `shard` against `recipe`. Raises GroupSizeError before any work."""
    units: list[Unit] = []
    batches: dict[tuple, list[QuantItem]] = {}
    batch_meta: dict[tuple, tuple] = {}
    order: list[tuple] = []  # unit order: copies and batches by first appearance

    def add_quant(module, ref, shape, dtype, layer_key):
        g = recipe.match(module)
        if g is None:
            return False
        if g.scheme.type != "int":
            raise QuantkitError(f"{module}: FP8 output schemes are not supported by this version",
                                hint="use an INT4 scheme for this group, or leave these modules unquantized")
        try:
            scheme = g.scheme.for_in_features(shape[1])
        except GroupSizeError as e:
            raise GroupSizeError(f"{module}: {e.message}") from None
        key = (layer_key, g.name, scheme, shape, dtype)
        if key not in batches:
            batches[key] = []
            batch_meta[key] = (g, scheme, dtype)
            order.append(("quant", key))
        batches[key].append(QuantItem(module, ref, shape))
        return True

    for name in sorted(shard.tensors):
        info = shard.tensors[name]
        fused = _split_fused(name, info, hidden) if info.dtype in FLOAT_DTYPES else None
        if fused is not None:
            matched = [add_quant(mod, ref, shape, info.dtype, (name, ref.rows is not None and ref.rows[0] > 0))
                       for mod, ref, shape in fused]
            if any(matched) and not all(matched):
                raise QuantkitError(f"{name}: the recipe quantizes only some of the experts it holds",
                                    hint="target all experts of a fused tensor, or none")
            if any(matched):
                continue
        elif name.endswith(".weight") and len(info.shape) == 2 and info.dtype in FLOAT_DTYPES:
            module = name[: -len(".weight")]
            # batch all same-shape experts of one layer/projection: key on the name with indices removed
            layer_key = re.sub(r"\.experts\.\d+\.", ".experts.*.", module)
            if add_quant(module, SourceRef(name), tuple(info.shape), info.dtype, layer_key):
                continue
        order.append(("copy", name))

    for kind, key in order:
        if kind == "copy":
            units.append(Unit("copy", tensor=key))
            continue
        g, scheme, dtype = batch_meta[key]
        items = batches[key]
        per = max(1, batch_bytes // (items[0].shape[0] * items[0].shape[1] * 2))
        for i in range(0, len(items), per):
            units.append(Unit("quant", items=tuple(items[i:i + per]), group=g, scheme=scheme, src_dtype=dtype))
    return ShardPlan(shard.name, split_parts(output, units, lambda n: shard.tensors[n], max_shard_bytes))


# ---- execution (one shard; runs in a worker process when workers > 1) --------------------------------
@dataclass
class ShardResult:
    source: str
    source_sha256: str
    source_size: int
    outputs: list = field(default_factory=list)  # [{name, sha256, size}] in order
    tensors: dict = field(default_factory=dict)  # output tensor name -> manifest entry
    bytes_read: int = 0


def _read_2d(f: SafetensorsFile, ref: SourceRef) -> torch.Tensor:
    t = f.get(ref.tensor, copy=False)
    if ref.expert is not None:
        t = t[ref.expert]
    if ref.rows is not None:
        t = t[ref.rows[0]:ref.rows[1]]
    return t


def run_shard(plan: ShardPlan, src_path: Path, out_dir: Path, threads: int | None = None,
              progress: Callable[[int], None] | None = None) -> ShardResult:
    if threads:
        torch.set_num_threads(threads)
    f = SafetensorsFile(src_path)
    entries: dict[str, dict] = {}
    outputs = []
    read = 0
    try:
        for out_name, units in plan.parts:
            specs = [spec for u in units for spec in unit_outputs(u, lambda n: f.header.tensors[n])]
            writer = ShardWriter(out_dir / out_name, specs, metadata={"format": "pt"})
            part_entries: dict[str, dict] = {}
            try:
                for u in units:
                    if u.kind == "copy":
                        info = f.header.tensors[u.tensor]
                        writer.write(u.tensor, f.get(u.tensor, copy=False))
                        part_entries[u.tensor] = {"shape": list(info.shape),
                                                  "dtype": str(info.dtype).removeprefix("torch."),
                                                  "source_tensor": u.tensor}
                        read += info.nbytes
                    else:
                        read += _run_quant_unit(u, f, writer, part_entries)
                    if progress:
                        progress(read)
                sha, size = writer.finish()
            except BaseException:
                writer.abort()
                raise
            outputs.append({"name": out_name, "sha256": sha, "size": size})
            for k, v in part_entries.items():
                entries[k] = {**v, "shard": out_name, "source_shard": plan.source}
    finally:
        f.close()
    return ShardResult(plan.source, sha256_file(src_path), src_path.stat().st_size, outputs, entries, read)


def _run_quant_unit(u: Unit, f: SafetensorsFile, writer: ShardWriter, entries: dict) -> int:
    s = u.scheme
    w = torch.stack([_read_2d(f, it.source) for it in u.items])  # [B, N, K] in the source dtype
    res = rtn(w, s.num_bits, s.group_size, s.symmetric, u.scale_dtype, pack=(s.num_bits == 4))
    if not torch.isfinite(res.qparams.scale).all():
        bad = int((~torch.isfinite(res.qparams.scale)).flatten(1).any(1).nonzero()[0])
        raise NonFiniteWeight(f"{u.items[bad].module}: weight holds NaN or Inf values")
    sqnr = res.sqnr_db().tolist()
    for b, it in enumerate(u.items):
        meta = {"scheme": s.label, "method": "rtn", "group": u.group.name, "source_tensor": it.source.tensor,
                "sqnr_db": round(sqnr[b], 4)}
        if it.source.expert is not None:
            meta["source_slice"] = {"expert": it.source.expert, "rows": list(it.source.rows)}
        for name, dtype, shape in quant_outputs(it.module, it.shape, s, u.scale_dtype):
            suffix = name.rsplit(".", 1)[1]
            if suffix == "weight_packed":
                t = res.q[b]
            elif suffix == "weight_scale":
                t = res.qparams.scale[b].to(dtype)
            elif suffix == "weight_shape":
                t = torch.tensor(it.shape, dtype=torch.int64)
            else:  # weight_zero_point: packed along the output dim -> [ceil(N/8), G]
                t = pack_int4(res.qparams.zero_point[b].transpose(0, 1)).transpose(0, 1).contiguous()
            writer.write(name, t)
            entries[name] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), **meta}
    return int(w.numel() * w.element_size())


def _worker(args):
    plan, src_path, out_dir, threads = args
    return run_shard(plan, src_path, out_dir, threads)


# ---- orchestration ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvertOptions:
    recipe: str | Recipe = "int4-experts-rtn"
    workers: int = 1
    resume: bool = True
    overwrite: bool = False
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    batch_bytes: int = DEFAULT_BATCH_BYTES


@dataclass
class ConvertResult:
    output: str
    seconds: float
    bytes_read: int
    bytes_written: int
    tensors_total: int
    tensors_quantized: int
    peak_rss_bytes: int
    shards_resumed: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def peak_rss_bytes() -> int:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return max(own, kids)


def output_shard_names(src: Checkpoint) -> dict[str, str]:
    n = len(src.shards)
    return {s.name: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, s in enumerate(src.shards)}


def _source_fingerprint(src: Checkpoint) -> list[dict]:
    return [{"name": s.name, "size": s.size, "mtime_ns": s.path.stat().st_mtime_ns} for s in src.shards]


def _prepare_output(out: Path, opts: ConvertOptions, identity: dict) -> dict[str, dict]:
    """Create/validate the output dir; return journal records of shards already finished (resume)."""
    journal = out / JOURNAL_DIR
    if out.exists() and not out.is_dir():
        raise OutputExists(f"output {str(out)!r} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        manifest = out / MANIFEST_NAME
        if opts.overwrite:
            shutil.rmtree(out)
        elif opts.resume and manifest.is_file() and journal.is_dir():
            from .io.checkpoint import read_json_file

            m = read_json_file(manifest, MANIFEST_NAME, ResumeMismatch)
            if m.get("status") == "complete":
                raise OutputExists(f"{out} already holds a complete conversion",
                                   hint="pass --overwrite to convert again, or choose another directory")
            if m.get("identity") != identity:
                raise ResumeMismatch(f"{out} holds an unfinished conversion of a different source, recipe or "
                                     "quantkit version; refusing to mix them")
            done = {}
            for p in sorted(journal.glob("*.json")):
                try:
                    rec = read_json_file(p, p.name, ResumeMismatch)
                except QuantkitError:
                    continue  # a torn journal entry: redo that shard
                outs = rec.get("outputs") or []
                if outs and all((out / o["name"]).is_file() and (out / o["name"]).stat().st_size == o["size"]
                                for o in outs):
                    done[rec["source"]] = rec
            return done
        else:
            raise OutputExists(f"output directory {str(out)!r} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    journal.mkdir(exist_ok=True)
    return {}


def convert(src_dir: str | os.PathLike, out_dir: str | os.PathLike, opts: ConvertOptions = ConvertOptions(),
            progress: Callable[[int, int], None] | None = None) -> ConvertResult:
    """Convert `src_dir` into `out_dir` per `opts.recipe`. `progress(done_bytes, total_bytes)` is called
    as source bytes are consumed."""
    t0 = time.perf_counter()
    recipe = opts.recipe if isinstance(opts.recipe, Recipe) else load_recipe(opts.recipe)
    if recipe.needs_calibration:
        raise QuantkitError(f"recipe {recipe.name!r} needs calibration (GPTQ/AWQ/KV scales), "
                            "which this version of convert does not run",
                            hint="use an RTN recipe such as int4-experts-rtn")
    src = Checkpoint.open(src_dir)
    if src.quantization_config is not None:
        qm = src.quantization_config.get("quant_method")
        raise QuantkitError(f"source is already quantized (quant_method {qm!r}); this version converts "
                            "BF16/FP16/FP32 checkpoints", hint="convert from the unquantized release")
    out = Path(out_dir)
    hidden = src.config.get("hidden_size") if isinstance(src.config.get("hidden_size"), int) else None
    names = output_shard_names(src)
    plans = [plan_shard(s, names[s.name], recipe, hidden, opts.batch_bytes, opts.max_shard_bytes) for s in src.shards]

    identity = {"tool_version": __version__, "recipe_sha256": recipe.sha256,
                "source": _source_fingerprint(src), "batch_bytes": opts.batch_bytes,
                "max_shard_bytes": opts.max_shard_bytes}
    done = _prepare_output(out, opts, identity)
    write_json_atomic(out / MANIFEST_NAME, {"status": "in_progress", "identity": identity})
    journal = out / JOURNAL_DIR

    total = src.total_bytes
    finished_bytes = sum(src.shard(s).size for s in done)
    results: dict[str, dict] = dict(done)

    def record(res: ShardResult):
        rec = asdict(res)
        write_json_atomic(journal / f"{res.source}.json", rec, indent=None)  # this shard is now done
        results[res.source] = rec

    todo = [p for p in plans if p.source not in done]
    if progress:
        progress(finished_bytes, total)
    if opts.workers <= 1 or len(todo) <= 1:
        for p in todo:
            base = finished_bytes
            res = run_shard(p, src.root / p.source, out,
                            progress=(lambda r, b=base: progress(b + r, total)) if progress else None)
            finished_bytes += src.shard(p.source).size
            record(res)
            if progress:
                progress(finished_bytes, total)
    else:
        import multiprocessing as mp

        threads = max(1, (os.cpu_count() or 1) // opts.workers)
        with ProcessPoolExecutor(max_workers=opts.workers, mp_context=mp.get_context("spawn")) as ex:
            for res in ex.map(_worker, [(p, src.root / p.source, out, threads) for p in todo]):
                record(res)
                finished_bytes += res.source_size
                if progress:
                    progress(finished_bytes, total)

    return _finalize(src, out, recipe, plans, results, identity, t0, resumed=len(done))


def _quantization_config(recipe: Recipe, results: dict[str, dict]) -> dict:
    """compressed-tensors config: the most used scheme targets ["Linear"] (the form vLLM's MoE path and
    transformers accept); any other scheme (e.g. a group-size fallback) gets a group of exact module
    names, which compressed-tensors matches before class names. Every 2-D weight left unquantized is
    listed in `ignore`."""
    by_label: dict[str, list[str]] = {}
    kept = set()
    for rec in results.values():
        for name, e in rec["tensors"].items():
            if name.endswith(".weight_packed"):
                by_label.setdefault(e["scheme"], []).append(name[: -len(".weight_packed")])
            elif name.endswith(".weight") and len(e["shape"]) == 2:
                kept.add(name[: -len(".weight")])
    labels = sorted(by_label, key=lambda lb: (-len(by_label[lb]), lb))
    groups = {}
    for i, label in enumerate(labels):
        targets = ["Linear"] if i == 0 else sorted(by_label[label])
        groups[f"group_{i}"] = {"targets": targets, "input_activations": None, "output_activations": None,
                                "weights": _scheme_from_label(label, recipe).weights_config()}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": groups, "ignore": sorted(kept), "kv_cache_scheme": None}


def _scheme_from_label(label: str, recipe: Recipe) -> Scheme:
    for g in recipe.groups:
        cands = [g.scheme, Scheme(g.scheme.num_bits, "int", g.scheme.symmetric, "channel", None)]
        if isinstance(g.scheme.fallback, int):
            cands.append(Scheme(g.scheme.num_bits, "int", g.scheme.symmetric, "group", g.scheme.fallback))
        for cand in cands:
            if cand.label == label:
                return cand
    raise AssertionError(f"no recipe scheme has label {label}")


def _finalize(src: Checkpoint, out: Path, recipe: Recipe, plans: list[ShardPlan], results: dict[str, dict],
              identity: dict, t0: float, resumed: int) -> ConvertResult:
    ordered = [results[p.source] for p in plans]
    tensors: dict[str, dict] = {}
    weight_map: dict[str, str] = {}
    out_shards = [{**o, "source_shard": r["source"]} for r in ordered for o in r["outputs"]]
    for rec in ordered:
        for name in sorted(rec["tensors"]):
            tensors[name] = rec["tensors"][name]
            weight_map[name] = rec["tensors"][name]["shard"]
    total_size = sum(o["size"] for o in out_shards)
    write_json_atomic(out / INDEX_NAME, {"metadata": {"total_size": total_size},
                                         "weight_map": dict(sorted(weight_map.items()))})
    config = dict(src.config)
    qc = _quantization_config(recipe, results)
    config["quantization_config"] = qc
    write_json_atomic(out / "config.json", config)
    for p in src.non_weight_files():
        copy_file_atomic(p, out / p.name)

    quantized_modules = {n.rsplit(".", 1)[0] for n, e in tensors.items() if "scheme" in e}
    manifest = {
        "status": "in_progress",
        "format_version": 1,
        "tool": {"name": "quantkit", "version": __version__},
        "identity": identity,
        "recipe": {"name": recipe.name, "sha256": recipe.sha256, "text": recipe.text},
        "source": {"config_sha256": hashlib.sha256((src.root / "config.json").read_bytes()).hexdigest(),
                   "shards": [{"name": r["source"], "size": r["source_size"], "sha256": r["source_sha256"]}
                              for r in ordered]},
        "shards": [{"name": o["name"], "size": o["size"], "sha256": o["sha256"], "source_shard": o["source_shard"]}
                   for o in out_shards],
        "summary": {"tensors_total": len(tensors), "modules_quantized": len(quantized_modules),
                    "bytes_read": sum(r["source_size"] for r in ordered), "bytes_written": total_size},
        "quantization_config": qc,
        "tensors": tensors,
    }
    write_json_atomic(out / MANIFEST_NAME, manifest)  # still in_progress: journal removed next
    shutil.rmtree(out / JOURNAL_DIR, ignore_errors=True)
    manifest["status"] = "complete"
    write_json_atomic(out / MANIFEST_NAME, manifest)  # the last write: only now does it look finished
    return ConvertResult(str(out), round(time.perf_counter() - t0, 3), manifest["summary"]["bytes_read"],
                         total_size, len(tensors), len(quantized_modules), peak_rss_bytes(), resumed)
