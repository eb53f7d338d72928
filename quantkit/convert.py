"""`quantkit convert`: stream a checkpoint shard by shard into a compressed-tensors checkpoint.

Pipeline (one way): open + validate the source -> plan every shard (recipe matched to tensors, output
shapes fixed, group sizes checked: nothing is written before the whole plan is valid) -> for each source
shard, read its tensors lazily, quantize routed experts in batches, stream the output shard to a
temporary file and rename it -> write the index, config.json, copied files, and the manifest last.

Each source shard maps to its own output shard(s), so shards are independent units of work: they can
run in parallel (`workers`), resume after a crash (a journal records each finished shard), and the
output is byte-identical whatever the order they finish in.

Sources (io/sources.py): BF16/FP16/FP32, block-FP8 releases (DeepSeek-V3 / Kimi K2 / GLM FP8) and
compressed-tensors FP8/INT4 checkpoints. Per module, what the source stores and what the recipe asks
decide the work (`decide`): quantize a float weight (INT4 RTN, or FP8), dequantize an FP8 weight on read
and re-quantize it, or pass a quantized weight through unchanged (FP8 kept as FP8 with its scales
renamed to compressed-tensors' `weight_scale`; INT4 never re-quantized). Every decision that is not
"quantize as asked" is reported in `ConvertResult.notes` and the manifest.

Memory: one work batch (at most `batch_bytes` of source weights, all experts of a layer that fit) plus
the pages of the source shard being read; never the model. FP8 weights are dequantized per tensor, in
row strips (quant/fp8.py), straight into the batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from . import __version__
from .errors import GroupSizeError, NonFiniteWeight, OutputBusy, OutputExists, QuantkitError, ResumeMismatch, UnsupportedDtype
from .io.checkpoint import INDEX_NAME, Checkpoint, Shard
from .io.safetensors import SafetensorsFile, TensorInfo
from .io.sources import (Notes, SourceFormat, StoredWeight, detect_format, fp8_input_activations,
                         fp8_weights_config, read_scale, scan)
from .io import prehash
from .io.writer import ShardWriter, copy_file_atomic, sha256_file, wait_durable, write_json_atomic
from .quant import fp8
from .quant.int4 import QParams, RTNResult, native_available, native_threads, pack_int4, rtn
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
    """Where a 2-D weight comes from: a whole tensor, or rows r0:r1 of expert e of a fused 3-D tensor.
    An FP8 source weight also names its scale tensor and layout: it is dequantized to BF16 on read."""

    tensor: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    scale: str | None = None
    layout: fp8.FP8Layout | None = None
    scale_fmt: str | None = None
    encoding: str | None = None  # the source encoding when not dense ("fp8-block" | "fp8")


@dataclass(frozen=True)
class QuantItem:
    module: str  # output module name, e.g. model.layers.3.mlp.experts.7.down_proj
    source: SourceRef
    shape: tuple[int, int]  # [out, in]


@dataclass(frozen=True)
class Unit:
    """One step of work: copy a tensor; quantize a batch of same-shape weights with one scheme to INT4
    ("quant") or FP8 ("fp8"); or pass one already-quantized module through ("pass")."""

    kind: str  # "copy" | "quant" | "fp8" | "pass"
    tensor: str | None = None  # copy: source tensor name
    items: tuple[QuantItem, ...] = ()
    group: WeightGroup | None = None
    scheme: Scheme | None = None
    src_dtype: torch.dtype | None = None
    # pass: (output name, source tensor, output dtype, output shape) per tensor, the module's scheme
    # label, its compressed-tensors config (JSON text, hashable) and why it is passed through
    renames: tuple[tuple[str, str, torch.dtype, tuple[int, ...]], ...] = ()
    label: str | None = None
    config: str | None = None
    reason: str | None = None

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.src_dtype if self.src_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16

    @property
    def layout(self) -> fp8.FP8Layout:
        return fp8.FP8Layout(self.scheme.strategy, self.scheme.block_structure)


def quant_outputs(module: str, shape: tuple[int, int], scheme: Scheme, scale_dtype: torch.dtype):
    """(name, dtype, shape) of the tensors that replace `module.weight` (compressed-tensors pack-quantized,
    or float-quantized for an FP8 scheme)."""
    n, k = shape
    if scheme.type == "float":
        layout = fp8.FP8Layout(scheme.strategy, scheme.block_structure)
        return [(f"{module}.weight", fp8.FP8_DTYPE, (n, k)),
                (f"{module}.weight_scale", torch.float32, layout.scale_shape(n, k))]
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
    if u.kind == "pass":
        return [(name, dtype, shape) for name, _, dtype, shape in u.renames]
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
    exceed the shard size limit. `foreign`: companion tensors (scales) this shard's modules read from
    other source shards, as (tensor, shard file name)."""

    source: str  # source shard file name
    parts: tuple[tuple[str, tuple[Unit, ...]], ...]  # (output file name, units written to it)
    foreign: tuple[tuple[str, str], ...] = ()

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


def canonical_json(d) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def scheme_config(scheme: Scheme) -> dict:
    """format + compressed-tensors args of a scheme convert applies (FP8: dynamic FP8 activations)."""
    if scheme.type == "float":
        layout = fp8.FP8Layout(scheme.strategy, scheme.block_structure)
        return {"format": "float-quantized", "weights": fp8_weights_config(layout),
                "input_activations": fp8_input_activations(layout)}
    return {"format": "pack-quantized", "weights": scheme.weights_config(), "input_activations": None}


def _pass_unit(sw: StoredWeight, reason: str, group: WeightGroup | None, info: Callable[[str], TensorInfo]) -> Unit:
    """Write a stored-quantized module unchanged. Block-FP8 `weight_scale_inv` (a multiplier despite
    its name) is exactly compressed-tensors' block `weight_scale`: renamed, widened to float32."""
    renames = []
    for suffix, src in sw.tensors:
        si = info(src)
        widen = sw.encoding == "fp8-block" and suffix == "weight_scale"
        renames.append((f"{sw.module}.{suffix}", src, torch.float32 if widen else si.dtype, tuple(si.shape)))
    cfg = {"format": sw.format, "weights": sw.weights, "input_activations": sw.input_activations}
    label = sw.label
    if sw.encoding != "fp8-block":
        ours = _our_config_for(sw)
        if ours is None or canonical_json(ours) != canonical_json(cfg):
            label += "+source"  # the source's own args (e.g. another observer): a config group of its own
    return Unit("pass", items=(QuantItem(sw.module, SourceRef(sw.primary), sw.shape),), group=group,
                renames=tuple(renames), label=label, config=json.dumps(cfg), reason=reason)


def _our_config_for(sw: StoredWeight) -> dict | None:
    w = sw.weights
    try:
        s = Scheme(int(w.get("num_bits", 4)), w.get("type", "int"), bool(w.get("symmetric", True)),
                   w.get("strategy", "group"), w.get("group_size"),
                   tuple(w["block_structure"]) if w.get("block_structure") else None)
    except (QuantkitError, TypeError, ValueError):
        return None
    return scheme_config(s)


def effective_scheme(module: str, scheme: Scheme, shape: tuple[int, int]) -> Scheme:
    """The scheme applied to a [N, K] weight: INT4 group-size `fallback`s, and for FP8 block schemes the
    K % b1 rule — dynamic 1 x b1 activation groups (compressed-tensors, vLLM) need K to be a multiple of
    the block width, so such a module takes `fallback: channel` (per-channel FP8) or is an error."""
    k = shape[1]
    try:
        s = scheme.for_in_features(k)
    except GroupSizeError as e:
        raise GroupSizeError(f"{module}: {e.message}") from None
    if s.type == "float" and s.strategy == "block" and k % s.block_structure[1]:
        if s.fallback == "channel":
            return Scheme(8, "float", True, "channel", None)
        raise GroupSizeError(f"{module}: in_features {k} is not a multiple of the FP8 block width "
                             f"{s.block_structure[1]}", hint="set `fallback: channel` in the recipe's FP8 scheme "
                             "(per-channel FP8 for such modules), or leave them unquantized")
    return s


def decide(sw: StoredWeight | None, scheme: Scheme | None, targeted: bool) -> tuple[str, str | None]:
    """What happens to one weight: ("copy"|"quantize"|"dequantize"|"pass", reason). `sw` is how the
    source stores it (None: dense), `scheme` the effective recipe scheme for it (None: untouched;
    never computed for INT4 sources, which are never re-quantized), `targeted` whether a recipe group
    matches it."""
    if sw is None:
        return ("copy", None) if scheme is None else ("quantize", None)
    if sw.encoding == "int4":
        return "pass", ("int4-source-targeted" if targeted else "int4-source")
    if scheme is None:
        return "pass", "fp8-kept"
    if scheme.type == "float" and fp8.FP8Layout(scheme.strategy, scheme.block_structure) == sw.layout:
        return "pass", "fp8-same-scheme"
    return "dequantize", None


NOTE_TEXT = {
    "int4-source": "{n} module(s) already INT4 in the source ({labels}) passed through unchanged",
    "int4-source-targeted": ("{n} module(s) targeted by the recipe are already INT4 in the source ({labels}): "
                             "passed through unchanged, not re-quantized (INT4 -> INT4 would compound "
                             "rounding error; convert from the BF16 or FP8 release to re-quantize them)"),
    "fp8-kept": ("{n} FP8 module(s) not targeted by the recipe kept as the source stores them ({labels}; "
                 "bit-exact, a block-FP8 weight_scale_inv written as weight_scale)"),
    "fp8-same-scheme": "{n} FP8 module(s) already in the recipe's FP8 scheme ({labels}) passed through bit-exact",
    "fp8-dequantized": ("{n} FP8 module(s) dequantized to BF16 on read and re-quantized ({labels})"),
    "kv-dropped": "{n} KV-cache scale tensor(s) of the source replaced by the new scales",
    "fp8-partial-k": ("{n} block-FP8 module(s) passed through have in_features that is not a multiple of the "
                      "block width ({labels}): compressed-tensors and vLLM cannot run their dynamic 1 x block "
                      "activation groups; target them with an FP8 scheme with `fallback: channel`"),
}


def plan_shard(shard: Shard, output: str, recipe: Recipe, hidden: int | None,
               batch_bytes: int = DEFAULT_BATCH_BYTES, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
               stored: Mapping[str, StoredWeight] | None = None, skip: frozenset[str] = frozenset(),
               location: Mapping[str, str] | None = None,
               info: Callable[[str], TensorInfo] | None = None, calibrated: bool = False) -> ShardPlan:
    """Match every tensor of `shard` against `recipe`. Raises GroupSizeError before any work.
    `stored`: modules the source stores quantized (io/sources.scan); `skip`: tensors not to copy
    (companions of stored modules, replaced KV scales); `location`/`info`: tensor -> shard / header
    entry across the whole checkpoint, for companions stored in another shard."""
    stored = stored or {}
    info = info or (lambda n: shard.tensors[n])
    units: list[Unit] = []
    batches: dict[tuple, list[QuantItem]] = {}
    batch_meta: dict[tuple, tuple] = {}
    order: list[tuple] = []  # unit order: copies and batches by first appearance
    foreign: dict[str, str] = {}

    def add_quant(module, ref, shape, dtype, layer_key, g, scheme=None):
        if g.method != "rtn" and not calibrated:
            raise QuantkitError(f"{module}: method {g.method} needs calibration data")
        scheme = scheme or effective_scheme(module, g.scheme, shape)
        kind = "fp8" if scheme.type == "float" else "quant"
        key = (kind, layer_key, g.name, scheme, shape, dtype)
        if key not in batches:
            batches[key] = []
            batch_meta[key] = (kind, g, scheme, dtype)
            order.append(("quant", key))
        batches[key].append(QuantItem(module, ref, shape))

    def need(tensor):
        where = (location or {}).get(tensor, shard.name)
        if where != shard.name:
            foreign[tensor] = where

    for name in sorted(shard.tensors):
        if name in skip:
            continue
        tinfo = shard.tensors[name]
        module = name.rsplit(".", 1)[0]
        sw = stored.get(module)
        if sw is not None and sw.primary == name:
            g = recipe.match(module)
            scheme = None if g is None or sw.encoding == "int4" else effective_scheme(module, g.scheme, sw.shape)
            action, reason = decide(sw, scheme, g is not None)
            layer_key = re.sub(r"\.experts\.\d+\.", ".experts.*.", module)
            if action == "pass":
                u = _pass_unit(sw, reason, g, info)
                for _, src, _, _ in u.renames:
                    need(src)
                order.append(("unit", u))
            else:  # dequantize on read, then quantize as the recipe says
                need(sw.scale)
                ref = SourceRef(name, scale=sw.scale, layout=sw.layout, scale_fmt=sw.scale_fmt, encoding=sw.encoding)
                add_quant(module, ref, sw.shape, torch.bfloat16, layer_key, g, scheme)
            continue
        fused = _split_fused(name, tinfo, hidden) if tinfo.dtype in FLOAT_DTYPES else None
        if fused is not None:
            groups = [recipe.match(mod) for mod, _, _ in fused]
            matched = [g is not None for g in groups]
            if any(matched) and not all(matched):
                raise QuantkitError(f"{name}: the recipe quantizes only some of the experts it holds",
                                    hint="target all experts of a fused tensor, or none")
            if any(matched):
                for (mod, ref, shape), g in zip(fused, groups):
                    add_quant(mod, ref, shape, tinfo.dtype, (name, ref.rows is not None and ref.rows[0] > 0), g)
                continue
        elif name.endswith(".weight") and len(tinfo.shape) == 2 and tinfo.dtype in FLOAT_DTYPES:
            module = name[: -len(".weight")]
            g = recipe.match(module)
            if g is not None:
                # batch all same-shape experts of one layer/projection: key on the name with indices removed
                layer_key = re.sub(r"\.experts\.\d+\.", ".experts.*.", module)
                add_quant(module, SourceRef(name), tuple(tinfo.shape), tinfo.dtype, layer_key, g)
                continue
        elif name.endswith(".weight") and len(tinfo.shape) == 2 and recipe.match(name[: -len(".weight")]) is not None:
            # targeted, but neither a float weight nor one the source stores quantized: never copy it
            # through as if the recipe had not asked for it
            raise UnsupportedDtype(f"{name}: the recipe quantizes this weight, but its dtype "
                                   f"{str(tinfo.dtype).removeprefix('torch.')} cannot be quantized")
        order.append(("copy", name))

    for kind, key in order:
        if kind == "copy":
            units.append(Unit("copy", tensor=key))
            continue
        if kind == "unit":
            units.append(key)
            continue
        ukind, g, scheme, dtype = batch_meta[key]
        items = batches[key]
        per = max(1, batch_bytes // (items[0].shape[0] * items[0].shape[1] * 2))
        for i in range(0, len(items), per):
            units.append(Unit(ukind, items=tuple(items[i:i + per]), group=g, scheme=scheme, src_dtype=dtype))
    return ShardPlan(shard.name, split_parts(output, units, lambda n: shard.tensors[n], max_shard_bytes),
                     tuple(sorted(foreign.items())))


# ---- execution (one shard; runs in a worker process when workers > 1) --------------------------------
@dataclass
class ShardResult:
    source: str
    source_sha256: str
    source_size: int
    outputs: list = field(default_factory=list)  # [{name, sha256, size}] in order
    tensors: dict = field(default_factory=dict)  # output tensor name -> manifest entry
    bytes_read: int = 0
    schemes: dict = field(default_factory=dict)  # scheme label -> {format, weights, input_activations}
    notes: list = field(default_factory=list)  # what reading the source found (e.g. broken ue8m0 promise)


class _Reader:
    """Tensors of one source shard, plus the few companions (scales) stored in other shards."""

    def __init__(self, src_path: Path, foreign: tuple[tuple[str, str], ...]):
        self.f = SafetensorsFile(src_path)
        self._root = src_path.parent
        self._where = dict(foreign)
        self._others: dict[str, SafetensorsFile] = {}
        self.notes = Notes()

    def get(self, name: str) -> torch.Tensor:
        shard = self._where.get(name)
        if shard is None:
            return self.f.get(name, copy=False)
        if shard not in self._others:
            self._others[shard] = SafetensorsFile(self._root / shard)
        return self._others[shard].get(name, copy=True)  # small (scales): copied, the mapping closes soon

    def read_2d(self, ref: SourceRef, out: torch.Tensor) -> None:
        """Write the weight `ref` names into `out` [N, K] (dequantizing FP8 into it directly)."""
        if ref.layout is not None:
            scale = read_scale(self.get, ref.scale, ref.layout, ref.scale_fmt, self.notes)
            fp8.dequantize(self.get(ref.tensor), scale, ref.layout, out.dtype, out=out)
            return
        if ref.tensor not in self._where:
            info = self.f.header.tensors[ref.tensor]
            shape = info.shape[1:] if ref.expert is not None else info.shape
            if ref.rows is not None:
                shape = (ref.rows[1] - ref.rows[0], *shape[1:])
            if info.dtype == out.dtype and out.is_contiguous() and tuple(out.shape) == tuple(shape):
                # rows of one expert of a row-major tensor are one byte range: read it in place
                per_expert = info.nbytes // info.shape[0] if ref.expert is not None else 0
                row = info.shape[-1] * out.element_size()
                offset = (ref.expert or 0) * per_expert + (ref.rows[0] * row if ref.rows is not None else 0)
                self.f.readinto(ref.tensor, out, offset)
                return
        out.copy_(self.view(ref))

    def view(self, ref: SourceRef) -> torch.Tensor:
        """The stored (dense) weight `ref` names, as a view: the whole tensor or rows of one expert."""
        t = self.get(ref.tensor)
        if ref.expert is not None:
            t = t[ref.expert]
        if ref.rows is not None:
            t = t[ref.rows[0]:ref.rows[1]]
        return t

    def close(self):
        self.f.close()
        for o in self._others.values():
            o.close()


@dataclass(frozen=True)
class Spool:
    """What the calibrated pass (quantkit.calib.quantize) left for convert: tensor name -> spool file,
    and per-module metadata (method, tokens, fallback)."""

    files: dict = field(default_factory=dict)
    modules: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.files)


class _SpoolReader:
    def __init__(self, spool: Spool):
        self.spool = spool
        self._open: dict[str, SafetensorsFile] = {}

    def has(self, name: str) -> bool:
        return name in self.spool.files

    def get(self, name: str) -> torch.Tensor:
        path = self.spool.files[name]
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path].get(name, copy=True)

    def close(self):
        for f in self._open.values():
            f.close()


def run_shard(plan: ShardPlan, src_path: Path, out_dir: Path, threads: int | None = None,
              progress: Callable[[int], None] | None = None, spool: Spool = Spool()) -> ShardResult:
    if threads:
        torch.set_num_threads(threads)
    sp = _SpoolReader(spool)
    # sha256 of the source shard, computed while it is converted (hashlib releases the GIL): the pages
    # are read once from disk and shared with the mapping
    from concurrent.futures import ThreadPoolExecutor

    hasher = ThreadPoolExecutor(1)
    src_hash = hasher.submit(prehash.sha256, src_path)  # started by the CLI before the imports, if it could
    hasher.shutdown(wait=False)
    r = _Reader(src_path, plan.foreign)
    f = r.f
    entries: dict[str, dict] = {}
    schemes: dict[str, dict] = {}
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
                        entry = {"shape": list(info.shape), "dtype": str(info.dtype).removeprefix("torch."),
                                 "source_tensor": u.tensor}
                        if sp.has(u.tensor):  # changed by the calibrated pass (AWQ scale folding)
                            writer.write(u.tensor, sp.get(u.tensor).to(info.dtype).reshape(info.shape))
                            entry["modified_by"] = "awq"
                        else:
                            writer.write(u.tensor, f.get(u.tensor, copy=False))
                        part_entries[u.tensor] = entry
                        read += info.nbytes
                    elif u.kind == "pass":
                        read += _run_pass_unit(u, r, writer, part_entries)
                        schemes[u.label] = json.loads(u.config)
                    elif u.group is not None and u.group.method != "rtn":
                        read += _run_spool_unit(u, sp, writer, part_entries)
                        schemes[u.scheme.label] = scheme_config(u.scheme)
                    else:
                        read += _run_quant_unit(u, r, writer, part_entries, sp)
                        schemes[u.scheme.label] = scheme_config(u.scheme)
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
        r.close()
        sp.close()
    return ShardResult(plan.source, src_hash.result(), src_path.stat().st_size, outputs, entries, read,
                       dict(sorted(schemes.items())), r.notes.items)


def _run_pass_unit(u: Unit, r: _Reader, writer: ShardWriter, entries: dict) -> int:
    meta = {"scheme": u.label, "method": "passthrough", "reason": u.reason}
    if u.group is not None:
        meta["group"] = u.group.name
    read = 0
    for name, src, dtype, shape in u.renames:
        t = r.get(src)
        read += t.numel() * t.element_size()
        writer.write(name, t.to(dtype).reshape(shape))
        entries[name] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "source_tensor": src, **meta}
    return read


def _read_batch(u: Unit, r: _Reader, sp: _SpoolReader | None = None) -> torch.Tensor:
    n, k = u.items[0].shape
    dtype = u.src_dtype
    w = torch.empty((len(u.items), n, k), dtype=dtype)  # [B, N, K] in the source (or dequantized) dtype
    for b, it in enumerate(u.items):
        if sp is not None and it.source.expert is None and sp.has(it.source.tensor):
            w[b].copy_(sp.get(it.source.tensor))  # modified by the calibrated pass (AWQ folding)
        else:
            r.read_2d(it.source, w[b])
    return w


def _run_spool_unit(u: Unit, sp: _SpoolReader, writer: ShardWriter, entries: dict) -> int:
    """Write modules quantized by the calibrated pass (GPTQ/AWQ) from the spool."""
    read = 0
    for it in u.items:
        meta = {**_item_meta(u, it, u.group.method, 0.0), **sp.spool.modules.get(it.module, {})}
        for name, dtype, shape in quant_outputs(it.module, it.shape, u.scheme, u.scale_dtype):
            if not sp.has(name):
                raise QuantkitError(f"{it.module}: the calibrated pass produced no {name.rsplit('.', 1)[1]}",
                                    hint="re-run with --overwrite; if it persists, report it")
            t = sp.get(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise QuantkitError(f"{name}: calibrated result is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")
            writer.write(name, t)
            entries[name] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), **meta}
        read += it.shape[0] * it.shape[1] * 2
    return read


def _item_meta(u: Unit, it: QuantItem, method: str, sqnr: float) -> dict:
    meta = {"scheme": u.scheme.label, "method": method, "group": u.group.name, "source_tensor": it.source.tensor,
            "sqnr_db": round(sqnr, 4)}
    if it.source.expert is not None:
        meta["source_slice"] = {"expert": it.source.expert, "rows": list(it.source.rows)}
    if it.source.encoding is not None:
        meta["source_encoding"] = it.source.encoding  # dequantized from FP8 on read
    return meta


def _run_quant_unit(u: Unit, r: _Reader, writer: ShardWriter, entries: dict, sp: _SpoolReader | None = None) -> int:
    s = u.scheme
    w = (_mapped_views(u, r, sp) if u.kind != "fp8" and s.num_bits == 4 else None) or _read_batch(u, r, sp)
    if u.kind == "fp8":
        res = fp8.quantize_fp8(w, u.layout)
        if not bool(res.finite.all()):
            bad = int((~res.finite).nonzero()[0])
            raise NonFiniteWeight(f"{u.items[bad].module}: weight holds NaN or Inf values")
        sqnr = res.sqnr_db().tolist()
        for b, it in enumerate(u.items):
            meta = _item_meta(u, it, "rtn", sqnr[b])
            (wn, wd, ws), (sn, sd, ss) = quant_outputs(it.module, it.shape, s, u.scale_dtype)
            writer.write(wn, res.q[b])
            writer.write(sn, res.scale[b].reshape(ss))
            entries[wn] = {"shape": list(ws), "dtype": "float8_e4m3fn", **meta}
            entries[sn] = {"shape": list(ss), "dtype": "float32", **meta}
        return int(w.numel() * w.element_size())
    pack = s.num_bits == 4
    for b, (it, res) in enumerate(_rtn_items(u, w, pack)):
        # NaN/Inf anywhere in a matrix makes its sum of squares non-finite (a NaN group would otherwise
        # quantize silently with scale 1): free to check here; the exact test runs only on the failure path
        if not bool(torch.isfinite(res.signal).all()):
            if not bool(torch.isfinite(w[b]).all()):
                raise NonFiniteWeight(f"{it.module}: weight holds NaN or Inf values")
        meta = _item_meta(u, it, "rtn", float(res.sqnr_db()))
        for name, dtype, shape in quant_outputs(it.module, it.shape, s, u.scale_dtype):
            suffix = name.rsplit(".", 1)[1]
            if suffix == "weight_packed":
                t = res.q
            elif suffix == "weight_scale":
                t = res.qparams.scale.to(dtype)
            elif suffix == "weight_shape":
                t = torch.tensor(it.shape, dtype=torch.int64)
            else:  # weight_zero_point: packed along the output dim -> [ceil(N/8), G]
                t = pack_int4(res.qparams.zero_point.transpose(0, 1)).transpose(0, 1).contiguous()
            writer.write(name, t)
            entries[name] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), **meta}
    return sum(int(x.numel() * x.element_size()) for x in w)


def _rtn_items(u: Unit, w, pack: bool):
    """(item, RTNResult of that one matrix) for each item of an RTN unit: `w` is the unit's [B, N, K]
    batch, or a list of B zero-copy [N, K] views of the mapped source (see `_mapped_views`)."""
    s = u.scheme
    if isinstance(w, torch.Tensor):
        res = rtn(w, s.num_bits, s.group_size, s.symmetric, u.scale_dtype, pack=pack)
        zp = res.qparams.zero_point
        for b, it in enumerate(u.items):
            yield it, RTNResult(res.q[b], QParams(res.qparams.scale[b], None if zp is None else zp[b]),
                                res.signal[b], res.noise[b])
    else:
        for it, x in zip(u.items, w):
            yield it, rtn(x, s.num_bits, s.group_size, s.symmetric, u.scale_dtype, pack=pack)


def _mapped_views(u: Unit, r: _Reader, sp: _SpoolReader | None) -> list[torch.Tensor] | None:
    """The unit's weights as [N, K] views of this shard's mapping (no copy: the fused kernel reads the
    page cache directly), when every item is a dense tensor (or expert rows) of the unit's dtype stored
    in this shard and untouched by the calibrated pass; else None (the caller reads a batch)."""
    if u.src_dtype not in (torch.bfloat16, torch.float32) or not native_available():
        return None
    views = []
    for it in u.items:
        ref = it.source
        if (ref.layout is not None or ref.tensor in r._where
                or (sp is not None and ref.expert is None and sp.has(ref.tensor))):
            return None
        t = r.view(ref)  # this shard's own tensor (not foreign): a view of its mapping
        if t.dtype != u.src_dtype or not t.is_contiguous() or tuple(t.shape) != tuple(it.shape):
            return None
        views.append(t)
    return views


def _worker(args):
    plan, src_path, out_dir, threads, spool = args
    res = run_shard(plan, src_path, out_dir, threads, spool=spool)
    wait_durable()  # this process's shards are on disk before the parent journals them
    return res


# ---- orchestration ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvertOptions:
    recipe: str | Recipe = "int4-experts-rtn"
    workers: int = 1
    resume: bool = True
    overwrite: bool = False
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    batch_bytes: int = DEFAULT_BATCH_BYTES
    # FP8 KV-cache scales to ship: a safetensors file of float32 `model.layers.L.self_attn.{k,v}_scale`
    # (as `quantkit calibrate` writes). None: calibrate if the recipe has a kv_cache section.
    kv_scales: str | None = None
    # Calibration data for GPTQ/AWQ groups (and in-convert KV calibration); None: the recipe's
    # `calibration` section, then quantkit's defaults (the shipped calibration set).
    dataset: str | None = None
    num_samples: int | None = None
    seq_len: int | None = None


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
    modules_passed_through: int = 0
    notes: list = field(default_factory=list)  # what was not quantized as asked, and why (also in the manifest)

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


def _only_own_debris(out: Path) -> bool:
    """What a run killed before its first manifest leaves: an empty journal and temporaries."""
    for p in out.iterdir():
        if p.name == JOURNAL_DIR and p.is_dir() and not any(p.glob("*.json")):
            continue
        if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file():
            continue
        return False
    return True


def _finished(out: Path, o: dict) -> bool:
    """A journaled output shard is still the one the journal describes (size, then sha256)."""
    p = out / o["name"]
    return p.is_file() and p.stat().st_size == o["size"] and sha256_file(p) == o["sha256"]


@contextlib.contextmanager
def output_lock(out: Path):
    """Hold an exclusive lock on the output directory (created if missing) for the whole conversion, so that
    a second convert into the same OUT fails at once instead of interleaving its shards and journal with
    this one's. The lock is the directory's own (flock on its descriptor): nothing is added to OUT or
    beside it, and it goes with the process however that ends."""
    if out.exists() and not out.is_dir():
        raise OutputExists(f"output {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock on this platform: no lock
        yield
        return
    fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputBusy(f"{out} is being written by another quantkit convert") from None
        except OSError:
            pass  # a filesystem without flock support: convert unlocked, as before
        yield
    finally:
        os.close(fd)


def _clear_dir(d: Path) -> None:
    """Remove everything inside d, keeping d itself."""
    for p in d.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _prepare_output(out: Path, opts: ConvertOptions, identity: dict) -> dict[str, dict]:
    """Validate the output dir (created by `output_lock`); return journal records of shards already
    finished (resume)."""
    journal = out / JOURNAL_DIR
    if any(out.iterdir()):
        manifest = out / MANIFEST_NAME
        if opts.overwrite:
            _clear_dir(out)  # in place: the lock is held on this directory
        elif opts.resume and manifest.is_file():
            from .io.checkpoint import read_json_file

            m = read_json_file(manifest, MANIFEST_NAME, ResumeMismatch)
            if m.get("status") == "complete":
                raise OutputExists(f"{out} already holds a complete conversion",
                                   hint="pass --overwrite to convert again, or choose another directory")
            if m.get("identity") != identity:
                raise ResumeMismatch(f"{out} holds an unfinished conversion of a different source, recipe or "
                                     "quantkit version; refusing to mix them")
            journal.mkdir(exist_ok=True)  # killed after _finalize removed it: every shard is redone
            done = {}
            for p in sorted(journal.glob("*.json")):
                try:
                    rec = read_json_file(p, p.name, ResumeMismatch)
                except QuantkitError:
                    continue  # a torn journal entry: redo that shard
                outs = rec.get("outputs") or []
                if outs and all(_finished(out, o) for o in outs):
                    done[rec["source"]] = rec
            return done
        elif not (opts.resume and _only_own_debris(out)):
            raise OutputExists(f"output directory {str(out)!r} is not empty")
    journal.mkdir(exist_ok=True)
    return {}


def _plan_notes(plans: list[ShardPlan], kv_dropped: int, stored: Mapping[str, StoredWeight]) -> list[str]:
    """One line per kind of decision that is not "quantize as asked" (deterministic order)."""
    counts: dict[str, dict[str, int]] = {}
    for p in plans:
        for u in p.units:
            if u.kind == "pass":
                counts.setdefault(u.reason, {}).setdefault(u.label, 0)
                counts[u.reason][u.label] += 1
                lay = stored[u.items[0].module].layout
                if lay is not None and lay.block is not None and u.items[0].shape[1] % lay.block[1]:
                    counts.setdefault("fp8-partial-k", {}).setdefault(u.label, 0)
                    counts["fp8-partial-k"][u.label] += 1
            elif u.kind in ("quant", "fp8"):
                for it in u.items:
                    if it.source.encoding is not None:
                        key = f"{it.source.encoding} -> {u.scheme.label}"
                        counts.setdefault("fp8-dequantized", {}).setdefault(key, 0)
                        counts["fp8-dequantized"][key] += 1
    if kv_dropped:
        counts["kv-dropped"] = {"": kv_dropped}
    notes = []
    for reason in NOTE_TEXT:
        if reason in counts:
            c = counts[reason]
            labels = ", ".join(f"{n} {lb}" for lb, n in sorted(c.items()))
            notes.append(NOTE_TEXT[reason].format(n=sum(c.values()), labels=labels))
    return notes


def convert(src_dir: str | os.PathLike, out_dir: str | os.PathLike, opts: ConvertOptions = ConvertOptions(),
            progress: Callable[[int, int], None] | None = None,
            log: Callable[[str], None] | None = None) -> ConvertResult:
    """Convert `src_dir` into `out_dir` per `opts.recipe`. `progress(done_bytes, total_bytes)` is called
    as source bytes are consumed; `log(line)` receives each note (what is passed through or re-quantized
    rather than quantized as asked) as soon as it is known — the CLI prints them on stderr."""
    t0 = time.perf_counter()
    recipe = opts.recipe if isinstance(opts.recipe, Recipe) else load_recipe(opts.recipe)
    calibrated = any(g.method != "rtn" for g in recipe.groups)
    src = Checkpoint.open(src_dir)
    fmt = detect_format(src.config)
    stored = scan(src, fmt)
    want_kv = opts.kv_scales is not None or recipe.kv_cache is not None
    source_kv = frozenset(n for n in src.location if _KV_NAME.match(n))
    companions = frozenset(t for sw in stored.values() for _, t in sw.tensors[1:])
    skip = companions | (source_kv if want_kv else frozenset())

    out = Path(out_dir)
    hidden = src.config.get("hidden_size") if isinstance(src.config.get("hidden_size"), int) else None
    names = output_shard_names(src)
    plans = [plan_shard(s, names[s.name], recipe, hidden, opts.batch_bytes, opts.max_shard_bytes, stored=stored,
                        skip=skip, location=src.location, info=src.info, calibrated=calibrated) for s in src.shards]
    notes = _plan_notes(plans, len(source_kv) if want_kv else 0, stored)
    # KV scales: read and checked (or calibrated) once the plan is known to be valid, before any write
    kv = _kv_scales(src, recipe, opts) if want_kv else None
    for n in notes:
        if log:
            log(n)

    data = _calibration_data(src, recipe, opts) if calibrated else None
    identity = {"tool_version": __version__, "recipe_sha256": recipe.sha256,
                "config_sha256": hashlib.sha256((src.root / "config.json").read_bytes()).hexdigest(),
                "source": _source_fingerprint(src), "batch_bytes": opts.batch_bytes,
                "max_shard_bytes": opts.max_shard_bytes,
                "calibration": None if data is None else {k: data.describe()[k] for k in
                                                          ("source", "sha256", "num_samples", "seq_len", "seed")}}
    if opts.overwrite and out.exists():
        o, sr = out.resolve(), src.root.resolve()
        if sr == o or sr.is_relative_to(o):
            raise OutputExists(f"--overwrite would delete {str(out)!r}, which holds the source checkpoint",
                               hint="choose an output directory outside the source checkpoint")
    with output_lock(out):
        done = _prepare_output(out, opts, identity)
        write_json_atomic(out / MANIFEST_NAME, {"status": "in_progress", "identity": identity}, durable=False)
        journal = out / JOURNAL_DIR
        spool = Spool()
        if calibrated and len(done) < len(plans):
            spool = _run_calibrated_pass(src, recipe, data, journal / "calib", log)

        total = src.total_bytes
        finished_bytes = sum(src.shard(s).size for s in done)
        results: dict[str, dict] = dict(done)

        def record(res: ShardResult):
            rec = asdict(res)
            # this shard is now done; no fsync: a record lost to a power cut only means the shard is redone
            write_json_atomic(journal / f"{res.source}.json", rec, indent=None, durable=False)
            results[res.source] = rec

        todo = [p for p in plans if p.source not in done]
        if progress:
            progress(finished_bytes, total)
        # Streaming RTN is thousands of small cache-sized ops: OpenMP barriers cost more than a second thread
        # gains (measured by bench/convert_rtn.py), so each shard runs single-threaded; --workers runs shards
        # in parallel processes instead.
        # The fused RTN kernel (quantkit.quant._rtn_native) has no such barriers: it splits rows over the
        # cores when shards run one at a time.
        prev_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with native_threads(_cpu_count() if opts.workers <= 1 else 1):
                _run_shards(todo, src, out, opts, spool, record, progress, finished_bytes, total)
        finally:
            torch.set_num_threads(prev_threads)

        for p in plans:  # what reading found (e.g. scales breaking a ue8m0 promise), in shard order
            for n in results[p.source].get("notes") or []:
                if n not in notes:
                    notes.append(n)
                    if log:
                        log(n)
        kv_out = _write_kv_scales(out, kv) if kv is not None else None
        kv_scheme = kv.config() if kv is not None else (fmt.kv_cache_scheme if source_kv else None)
        return _finalize(src, fmt, out, recipe, plans, results, identity, t0, resumed=len(done), notes=notes,
                         kv=kv, kv_out=kv_out, kv_scheme=kv_scheme,
                         calibration=None if data is None else data.describe())


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _run_shards(todo, src: Checkpoint, out: Path, opts: ConvertOptions, spool, record, progress, finished_bytes: int,
                total: int) -> None:
    if opts.workers <= 1 or len(todo) <= 1:
        for p in todo:
            base = finished_bytes
            res = run_shard(p, src.root / p.source, out,
                            progress=(lambda r, b=base: progress(b + r, total)) if progress else None, spool=spool)
            finished_bytes += src.shard(p.source).size
            record(res)
            if progress:
                progress(finished_bytes, total)
    else:
        import multiprocessing as mp

        threads = 1
        with ProcessPoolExecutor(max_workers=opts.workers, mp_context=mp.get_context("spawn")) as ex:
            for res in ex.map(_worker, [(p, src.root / p.source, out, threads, spool) for p in todo]):
                record(res)
                finished_bytes += res.source_size
                if progress:
                    progress(finished_bytes, total)


def _expert_report(tensors: dict[str, dict]) -> dict:
    """Calibration tokens seen per expert (by layer, in expert order) and every fallback with its reason."""
    tokens: dict[str, dict[int, int]] = {}
    fallbacks: dict[str, str] = {}
    for name, e in tensors.items():
        if not name.endswith(".weight_packed") or "tokens" not in e:
            continue
        module = name[: -len(".weight_packed")]
        if e.get("fallback"):
            fallbacks[module] = e["fallback"]
        m = re.match(r"^(.*\.experts)\.(\d+)\.[^.]+$", module)
        if m:
            tokens.setdefault(m[1], {})[int(m[2])] = e["tokens"]
    return {"expert_tokens": {p: [c[i] for i in sorted(c)] for p, c in sorted(tokens.items())},
            "fallbacks": dict(sorted(fallbacks.items()))}


def _calibration_data(src: Checkpoint, recipe: Recipe, opts: ConvertOptions):
    """Token samples for the calibrated groups: options first, then the recipe's calibration section."""
    from .calib.data import load_calibration_data, load_tokenizer
    from .calibrate import DEFAULT_NUM_SAMPLES, DEFAULT_SEQ_LEN

    cal = recipe.calibration
    vocab = _text_config(src.config).get("vocab_size")
    return load_calibration_data(opts.dataset or (cal.dataset if cal else None), tokenizer=load_tokenizer(src.root),
                                 vocab_size=vocab if isinstance(vocab, int) else None,
                                 num_samples=opts.num_samples or (cal.num_samples if cal else DEFAULT_NUM_SAMPLES),
                                 seq_len=opts.seq_len or (cal.seq_len if cal else DEFAULT_SEQ_LEN))


def _run_calibrated_pass(src: Checkpoint, recipe: Recipe, data, spool_dir: Path, log) -> Spool:
    """GPTQ/AWQ layer by layer (quantkit.calib.quantize), spooled under the journal. A spool left by an
    interrupted run of the same identity is reused when it is complete, and continued from the last
    finished layer when it is not."""
    from .calib.quantize import PROGRESS_NAME, run_calibrated
    from .io.checkpoint import read_json_file

    done = spool_dir / "index.json"
    if done.is_file():
        index = read_json_file(done, "calibration spool index")
    else:
        if spool_dir.exists() and not (spool_dir / PROGRESS_NAME).is_file():
            shutil.rmtree(spool_dir)
        if log:
            log(f"calibrating {', '.join(sorted({g.method for g in recipe.groups if g.method != 'rtn'}))} on "
                f"{data.num_samples} samples x {data.seq_len} tokens, layer by layer")
        index = run_calibrated(src.root, recipe, data.samples, spool_dir, log=log or (lambda m: None))
        write_json_atomic(done, index)
    files = {}
    for layer in index["layers"]:
        meta = read_json_file(spool_dir / f"{layer}.json", f"{layer}.json")
        for name in meta["tensors"] + meta["overrides"]:
            files[name] = str(spool_dir / f"{layer}.safetensors")
    return Spool(files, index["modules"])


# ---- KV-cache scales -------------------------------------------------------------------------------
KV_SHARD_NAME = "model-kv-scales.safetensors"
_KV_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


class KVScalesError(QuantkitError):
    """A KV-scales file (or calibration result) does not fit the model being converted."""

    hint = ("the file must hold float32 model.layers.L.self_attn.k_scale / v_scale for every attention layer, "
            "shape [1] (strategy tensor) or [num_kv_heads, 1, 1] (attn_head); re-run `quantkit calibrate` "
            "on this model")


class CalibrationNeeded(QuantkitError):
    """The recipe asks for FP8 KV-cache scales, and neither a scales file nor a calibrator is at hand."""

    hint = ("run `quantkit calibrate SRC --output kv.safetensors` first, then "
            "`quantkit convert SRC OUT --recipe RECIPE --kv-scales kv.safetensors`")


@dataclass(frozen=True)
class KVScales:
    scales: dict  # tensor name -> float32 tensor, validated
    strategy: str  # tensor | attn_head
    origin: dict  # {"file": path, "sha256": ...} or {"calibrate": {dataset, num_samples, seq_len}}

    def config(self) -> dict:
        return {"num_bits": 8, "type": "float", "strategy": self.strategy, "dynamic": False, "symmetric": True}

    def ordered(self) -> list[tuple[str, torch.Tensor]]:
        """Layer by layer, k before v: the order the extra shard stores them in (deterministic)."""
        key = lambda n: (int(_KV_NAME.match(n)[1]), _KV_NAME.match(n)[2])  # noqa: E731
        return [(n, self.scales[n]) for n in sorted(self.scales, key=key)]


def _find_calibrate():
    """`quantkit.calibrate.calibrate` when that module exists (it is optional); None otherwise."""
    try:
        from . import calibrate as mod
    except ModuleNotFoundError as e:
        if e.name in (f"{__package__}.calibrate",):
            return None
        raise
    return getattr(mod, "calibrate", None)


def _kv_scales(src: Checkpoint, recipe: Recipe, opts: ConvertOptions) -> KVScales:
    want = recipe.kv_cache.strategy if recipe.kv_cache is not None else None
    if opts.kv_scales is not None:
        path = Path(opts.kv_scales)
        if not path.is_file():
            raise KVScalesError(f"KV-scales file {str(path)!r} does not exist")
        with SafetensorsFile(path) as f:
            scales = {n: f.get(n) for n in f.header.tensors}
        origin = {"file": str(path), "sha256": sha256_file(path)}
    else:
        calibrate = _find_calibrate()
        if calibrate is None:
            raise CalibrationNeeded(f"recipe {recipe.name!r} asks for FP8 KV-cache scales (kv_cache), which need "
                                    "calibration on real activations; no --kv-scales file was given")
        from .recipe import CalibrationSpec

        cal = recipe.calibration or CalibrationSpec()
        res = calibrate(str(src.root), dataset=cal.dataset, num_samples=cal.num_samples, seq_len=cal.seq_len,
                        strategy=want)
        scales = {n: t.detach().cpu() for n, t in dict(res.scales).items()}
        origin = {"calibrate": {"dataset": cal.dataset, "num_samples": cal.num_samples, "seq_len": cal.seq_len}}
    if "kv_lora_rank" in _text_config(src.config):
        # MLA caches one latent per token and layer: a per-"head" scale there has one head, [1, 1, 1],
        # which is the same number as the per-tensor scale engines load ([1], strategy tensor)
        scales = {n: (t.reshape(1) if tuple(t.shape) == (1, 1, 1) else t) for n, t in scales.items()}
        want = "tensor" if want == "attn_head" else want
    return KVScales(scales, validate_kv_scales(scales, src, want), origin)


def _text_config(config: dict) -> dict:
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) and "num_hidden_layers" not in config else config


def validate_kv_scales(scales: Mapping[str, torch.Tensor], src: Checkpoint, strategy: str | None = None) -> str:
    """Check KV scales against the source model; return their strategy ("tensor" | "attn_head")."""
    cfg = _text_config(src.config)
    n_layers = cfg.get("num_hidden_layers")
    if not isinstance(n_layers, int) or n_layers <= 0:
        raise KVScalesError("config.json has no num_hidden_layers to check the KV scales against")
    kv_heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    attn_layers = sorted({int(m[1]) for n in src.location if (m := re.match(r"^model\.layers\.(\d+)\.self_attn\.", n))
                          and int(m[1]) < n_layers})
    if not scales:
        raise KVScalesError("the KV scales are empty")
    shapes = set()
    for name, t in scales.items():
        m = _KV_NAME.match(name)
        if m is None:
            raise KVScalesError(f"unexpected tensor {name[:100]!r} among the KV scales "
                                "(expected model.layers.L.self_attn.k_scale / v_scale)")
        layer = int(m[1])
        if layer >= n_layers:
            raise KVScalesError(f"{name}: layer {layer} does not exist (the model has {n_layers} layers)")
        if layer not in attn_layers:
            raise KVScalesError(f"{name}: the source has no model.layers.{layer}.self_attn weights")
        if t.dtype != torch.float32:
            raise KVScalesError(f"{name} is {str(t.dtype).removeprefix('torch.')}; KV scales must be float32")
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise KVScalesError(f"{name} holds a scale that is not a positive finite number")
        shapes.add(tuple(t.shape))
    missing = [f"model.layers.{L}.self_attn.{kv}_scale" for L in attn_layers for kv in "kv"
               if f"model.layers.{L}.self_attn.{kv}_scale" not in scales]
    if missing:  # an engine would silently use 1.0 for the missing ones
        raise KVScalesError(f"{len(missing)} KV scale(s) missing, e.g. {missing[0]}")
    if len(shapes) != 1:
        raise KVScalesError(f"the KV scales mix shapes {sorted(shapes)}; use one strategy for all layers")
    (shape,) = shapes
    if shape == (1,):
        found = "tensor"
    elif len(shape) == 3 and shape[1:] == (1, 1) and shape[0] == kv_heads:
        found = "attn_head"
        if "kv_lora_rank" in cfg:
            raise KVScalesError("per-head KV scales (attn_head) do not apply to MLA models: the engine caches one "
                                "latent per token and layer, scaled by a single k_scale")
    else:
        raise KVScalesError(f"KV scale shape {list(shape)} is neither [1] (tensor) nor [{kv_heads}, 1, 1] "
                            f"(attn_head, num_key_value_heads = {kv_heads})")
    if strategy is not None and strategy != found:
        raise KVScalesError(f"the recipe's kv_cache.strategy is {strategy!r}, but the scales are per {found}")
    return found


def _write_kv_scales(out: Path, kv: KVScales) -> dict:
    items = kv.ordered()
    writer = ShardWriter(out / KV_SHARD_NAME, [(n, t.dtype, tuple(t.shape)) for n, t in items],
                         metadata={"format": "pt"})
    try:
        for n, t in items:
            writer.write(n, t.contiguous())
        sha, size = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return {"name": KV_SHARD_NAME, "sha256": sha, "size": size}


# ---- config.json quantization_config ---------------------------------------------------------------
def _is_routed_expert(module: str) -> bool:
    return re.search(r"(^|\.)experts\.\d+\.", module) is not None


def _patterns(modules: list[str]) -> dict[str, list[str]]:
    """`re:` patterns standing for `modules`: indices become \\d+, names differing only in their last
    segment share one alternation, e.g. re:model\\.layers\\.\\d+\\.self_attn\\.(o_proj|q_proj)$."""
    members: dict[str, list[str]] = {}
    lasts: dict[str, set[str]] = {}
    for m in modules:
        parts = m.split(".")
        prefix = r"\.".join(r"\d+" if p.isdigit() else re.escape(p) for p in parts[:-1])
        members.setdefault(prefix, []).append(m)
        lasts.setdefault(prefix, set()).add(parts[-1])
    out = {}
    for prefix in sorted(members):
        last = sorted(lasts[prefix])
        alt = re.escape(last[0]) if len(last) == 1 else "(" + "|".join(map(re.escape, last)) + ")"
        pat = (prefix + r"\." if prefix else "") + alt + "$"
        if not any(_is_routed_expert(m) for m in members[prefix]):
            # transformers 5 picks the experts' config group as the one whose re: targets contain
            # "experts"; shared experts must not look like that. expert[s] is the same regex.
            pat = pat.replace("experts", "expert[s]")
        out["re:" + pat] = members[prefix]
    return out


def _quantization_config(results: dict[str, dict], kv_scheme: dict | None) -> dict | None:
    """compressed-tensors config for what was written (None when nothing is quantized).

    INT4 only (the Kimi-K2-Thinking style, the most widely loadable): the most used scheme targets
    ["Linear"]; any other scheme (e.g. a group-size fallback) gets a group of exact module names, which
    compressed-tensors matches before class names. With FP8 groups: top-level "mixed-precision" (a
    `format` per group) when formats differ; each format's most used scheme targets `re:` patterns of its
    modules (the INT4 expert group first: transformers takes its expert scheme from the first group whose
    re: targets mention "experts", its dense scheme from the first that does not), other schemes exact
    names. Every 2-D weight left unquantized is listed in `ignore`, which wins over every target."""
    by_label: dict[str, list[str]] = {}
    configs: dict[str, dict] = {}
    kept = set()
    for rec in results.values():
        configs.update(rec.get("schemes") or {})
        for name, e in rec["tensors"].items():
            if name.endswith(".weight_packed") or (name.endswith(".weight") and "scheme" in e):
                by_label.setdefault(e["scheme"], []).append(name.rsplit(".", 1)[0])
            elif name.endswith(".weight") and len(e["shape"]) == 2:
                kept.add(name[: -len(".weight")])
    if not by_label and kv_scheme is None:
        return None

    def group(label, targets, with_format):
        c = configs[label]
        g = {"targets": targets, "input_activations": c["input_activations"], "output_activations": None,
             "weights": c["weights"]}
        if with_format:
            g["format"] = c["format"]
        return g

    rank = lambda lb: (-len(by_label[lb]), lb)  # noqa: E731
    formats = sorted({configs[lb]["format"] for lb in by_label})
    groups = {}
    if not formats:  # KV scales only
        top = "dense"
    elif formats == ["pack-quantized"]:
        for i, label in enumerate(sorted(by_label, key=rank)):
            groups[f"group_{i}"] = group(label, ["Linear"] if i == 0 else sorted(by_label[label]), False)
        top = "pack-quantized"
    else:
        int_labels = sorted((lb for lb in by_label if configs[lb]["format"] == "pack-quantized"), key=rank)
        fp_labels = sorted((lb for lb in by_label if configs[lb]["format"] != "pack-quantized"), key=rank)
        mains = [lbs[0] for lbs in (int_labels, fp_labels) if lbs]
        rest = sorted((lb for lb in by_label if lb not in mains), key=rank)
        exact = {m for lb in rest for m in by_label[lb]}
        every = [m for lb in by_label for m in by_label[lb]] + sorted(kept)
        targets: dict[str, list[str]] = {}
        for lb in mains:
            mine = set(by_label[lb])
            targets[lb] = []
            for pat, members in _patterns(by_label[lb]).items():
                rx = re.compile(pat[3:])
                clash = [m for m in every if rx.match(m) and m not in mine and m not in exact and m not in kept]
                targets[lb] += sorted(members) if clash else [pat]  # a clash: name them instead
        mixed = len(formats) > 1
        for i, label in enumerate(mains + rest):
            groups[f"group_{i}"] = group(label, targets.get(label) or sorted(by_label[label]), mixed)
        top = "mixed-precision" if mixed else formats[0]
    return {"quant_method": "compressed-tensors", "format": top,
            "quantization_status": "compressed", "config_groups": groups, "ignore": sorted(kept),
            "kv_cache_scheme": kv_scheme}


def _finalize(src: Checkpoint, fmt: SourceFormat, out: Path, recipe: Recipe, plans: list[ShardPlan],
              results: dict[str, dict], identity: dict, t0: float, resumed: int, notes: list[str],
              kv: KVScales | None, kv_out: dict | None, kv_scheme: dict | None,
              calibration: dict | None = None) -> ConvertResult:
    wait_durable()  # every shard written by this process is on disk before the index and manifest
    ordered = [results[p.source] for p in plans]
    tensors: dict[str, dict] = {}
    weight_map: dict[str, str] = {}
    out_shards = [{**o, "source_shard": r["source"]} for r in ordered for o in r["outputs"]]
    for rec in ordered:
        for name in sorted(rec["tensors"]):
            tensors[name] = rec["tensors"][name]
            weight_map[name] = rec["tensors"][name]["shard"]
    if kv_out is not None:
        out_shards.append({**kv_out, "source_shard": None})
        for name, t in kv.ordered():
            tensors[name] = {"shape": list(t.shape), "dtype": "float32", "shard": KV_SHARD_NAME, "source_shard": None,
                             "kv_cache": kv.strategy}
            weight_map[name] = KV_SHARD_NAME
    total_size = sum(o["size"] for o in out_shards)
    write_json_atomic(out / INDEX_NAME, {"metadata": {"total_size": total_size},
                                         "weight_map": dict(sorted(weight_map.items()))})
    config = dict(src.config)
    qc = _quantization_config(results, kv_scheme)
    if qc is None:
        config.pop("quantization_config", None)  # nothing quantized: the source's (FP8) config must not stay
    else:
        config["quantization_config"] = qc
    write_json_atomic(out / "config.json", config)
    for p in src.non_weight_files():
        copy_file_atomic(p, out / p.name)

    modules = {n.rsplit(".", 1)[0]: e for n, e in tensors.items() if "scheme" in e}
    quantized = [m for m, e in modules.items() if e["method"] != "passthrough"]
    manifest = {
        "status": "in_progress",
        "format_version": 1,
        "tool": {"name": "quantkit", "version": __version__},
        "identity": identity,
        "recipe": {"name": recipe.name, "sha256": recipe.sha256, "text": recipe.text},
        "source": {"config_sha256": hashlib.sha256((src.root / "config.json").read_bytes()).hexdigest(),
                   "format": {"kind": fmt.kind, "description": fmt.describe(),
                              "block": list(fmt.block) if fmt.block else None, "scale_fmt": fmt.scale_fmt,
                              "modules_to_not_convert": list(fmt.not_converted)},
                   "shards": [{"name": r["source"], "size": r["source_size"], "sha256": r["source_sha256"]}
                              for r in ordered]},
        "shards": [{"name": o["name"], "size": o["size"], "sha256": o["sha256"], "source_shard": o["source_shard"]}
                   for o in out_shards],
        "summary": {"tensors_total": len(tensors), "modules_quantized": len(quantized),
                    "modules_passed_through": len(modules) - len(quantized),
                    "bytes_read": sum(r["source_size"] for r in ordered), "bytes_written": total_size},
        "notes": notes,
        "calibration": None if calibration is None else {**calibration, **_expert_report(tensors)},
        "kv_cache": (None if kv is None else {"strategy": kv.strategy, "scheme": kv.config(), "origin": kv.origin,
                                             "shard": KV_SHARD_NAME, "tensors": len(kv.scales)}),
        "quantization_config": qc,
        "tensors": tensors,
    }
    write_json_atomic(out / MANIFEST_NAME, manifest)  # still in_progress: journal removed next
    shutil.rmtree(out / JOURNAL_DIR, ignore_errors=True)
    manifest["status"] = "complete"
    write_json_atomic(out / MANIFEST_NAME, manifest)  # the last write: only now does it look finished
    return ConvertResult(str(out), round(time.perf_counter() - t0, 3), manifest["summary"]["bytes_read"],
                         total_size, len(tensors), len(quantized), peak_rss_bytes(), resumed,
                         len(modules) - len(quantized), list(notes))
