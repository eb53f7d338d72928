"""Stage 2 of `verify`, the format (headers and small tensors): config.json's `quantization_config`
against the tensors. Each quantized module resolves to one config group (exact name > `re:` pattern >
class name, as compressed-tensors matches), is not ignored, and carries the tensors the group implies
(pack/layout.py): packed modules (`weight_packed`: INT4, NVFP4, MXFP4) a packed group, FP8 modules (a
float8 `weight` + `weight_scale`) a `float-quantized` group. compressed-tensors' own decompressor (the
judge) must reproduce our dequantization bit for bit. The same pass measures each module's weight SQNR
against the reference."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..arch import check_expert_shapes, text_config
from ..arch import validate as validate_config
from ..arch.layout import POST_ATTN_NORM, SHARED_GATE_UP
from ..errors import ConfigError, QuantkitError
from ..match.recipe import Scheme
from ..pack.config import TARGET_HINT
from ..pack.targets import matches as _target_matches
from ..pack import checks
from ..pack import kv as kvrules
from ..pack import fp4 as fp4pack
from ..pack.config import group_problem, targeting, weights_label
from ..pack.names import FLOAT_FORMATS, PACKED_FORMATS, Format, Tensor
from ..pack.int4 import dequantize_module
from ..pack.layout import FP4_SUFFIXES, INPUT_SCALE, INT4_SUFFIXES
from ..quant.fp8 import FP8_DTYPE, FP8Layout, dequantize as fp8_dequantize
from ..quant.int4 import sqnr_db
from ..read.checkpoint import Checkpoint
from ..read.sources import SourceFormatError, detect_format, scan
from ..read.tensors import TensorReader
from .common import Listing, capped_db

KERNEL_MODULES = 4  # modules the kernel check runs the INT4 GEMM on
# FP8 scales are float32 (docs/format.md); a module passed through from a compressed-tensors source keeps
# its source's scale dtype, which compressed-tensors also writes as bfloat16 / float16
FP8_SOURCE_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _matches(pattern: str, name: str) -> bool:
    """The checkpoint's own targets and ignore list are input: checked as a recipe's are (pack/targets.py)."""
    return _target_matches(pattern, name, ConfigError, TARGET_HINT)


@dataclass(frozen=True)
class _Group:
    name: str
    targets: tuple[str, ...]
    weights: dict
    ok: bool  # the weights config is one this version can check (INT4 group/channel, NVFP4, MXFP4, FP8)
    kind: str = "int4"  # the encoding its format names: int4 | nvfp4 | mxfp4 | fp8 | other (checks nothing)
    format: str = Format.PACKED  # its compressed-tensors format (the top-level one unless mixed-precision)
    input_activations: dict | None = None

    @property
    def symmetric(self) -> bool:
        return self.weights.get("symmetric", True) is not False

    @property
    def group_size(self) -> int | None:
        if self.kind != "int4":
            return self.weights.get("group_size")
        return self.weights.get("group_size") if self.weights.get("strategy") == "group" else None

    @property
    def label(self) -> str:
        return weights_label(self.weights, self.input_activations)

    @property
    def scheme(self) -> Scheme | None:
        return Scheme.from_weights_config(self.weights, self.input_activations)

    @property
    def packed(self) -> bool:
        return self.kind in ("int4", "nvfp4", "mxfp4")

    @property
    def fp8_layout(self) -> FP8Layout:
        """FP8 groups (ok): where the scales of a module's weight live."""
        bs = self.weights.get("block_structure")
        return FP8Layout(self.weights["strategy"], (bs[0], bs[1]) if self.weights["strategy"] == "block" else None)


def _config_groups(qc: dict | None, problems: Listing, judge: "Judge",
                   holds: str = "packed") -> tuple[list[_Group], list[str]]:
    """(groups, ignore) from config.json's quantization_config, reporting what makes it unloadable.
    `holds`: what the shards hold, for the messages ("packed", "FP8", "packed and FP8")."""
    if not isinstance(qc, dict):
        problems.add(f"config.json has no quantization_config, but the shards hold {holds} weights")
        return [], []
    if qc.get("quant_method") != "compressed-tensors":
        problems.add(f"quantization_config.quant_method is {qc.get('quant_method')!r}, not 'compressed-tensors'")
    top_format = qc.get("format")
    allowed = [*(PACKED_FORMATS if "packed" in holds else ()), *(FLOAT_FORMATS if "FP8" in holds else ())]
    if top_format not in (*PACKED_FORMATS, *FLOAT_FORMATS, "mixed-precision"):
        problems.add(f"quantization_config.format is {top_format!r}; {holds} weights need one of "
                     f"{', '.join(allowed)} (or mixed-precision)")
    if qc.get("quantization_status") != "compressed":
        problems.add(f"quantization_config.quantization_status is {qc.get('quantization_status')!r}, not "
                     f"'compressed': loaders would not decompress the {holds} weights")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        problems.add("quantization_config.ignore must be a list of module names or 're:' patterns")
        ignore = []
    groups = []
    raw = qc.get("config_groups")
    if not isinstance(raw, dict) or not raw:
        problems.add("quantization_config.config_groups is missing or empty")
        raw = {}
    for gname, g in raw.items():
        where = f"quantization_config.config_groups.{str(gname)[:40]}"
        problem = group_problem(gname, g)
        if problem is None and (not isinstance(g.get("targets"), list) or not isinstance(g.get("weights"), dict)):
            problem = f"{where} must hold `targets` (a list) and `weights` (an object)"
        if problem is not None:
            problems.add(problem)
            continue
        w = g["weights"]
        ok = True
        fmt = g.get("format", top_format) if top_format == "mixed-precision" else top_format
        fmt = fmt if isinstance(fmt, str) else str(fmt)[:40]  # a non-string format was reported above
        kind = PACKED_FORMATS.get(fmt) or ("fp8" if fmt in FLOAT_FORMATS else None)
        targets = tuple(g["targets"])
        acts = g.get("input_activations")
        if kind is None:
            # another format (e.g. dense, int-quantized): nothing here to check, but it still takes part in
            # the precedence, and a quantized module it targets is reported
            groups.append(_Group(gname, targets, w, False, "other", str(fmt), acts))
            continue
        problem = checks.scheme_problem(kind, w)
        if problem:
            problems.add(f"{where}.weights: {problem} (format {fmt})")
            ok = False
        for key, args in (("weights", w), ("input_activations", acts)):
            err = judge.args_error(args) if args else None
            if err:
                problems.add(f"{where}.{key}: compressed-tensors rejects it: {err}")
                ok = False
        groups.append(_Group(gname, targets, w, ok, kind, str(fmt), acts))
    return groups, ignore


def _group_for(module: str, groups: list[_Group], has: str = Tensor.PACKED) -> tuple[_Group | None, str | None]:
    """compressed-tensors' precedence: an exact name, then a `re:` pattern, then a class name (quantized
    modules are Linear layers). Returns (group, problem); `has` says what the module holds."""
    hit = targeting(module, groups)
    if len(hit) > 1:
        return None, (f"{module}: matched by several config groups at the same precedence "
                      f"({', '.join(g.name for g in hit)})")
    if hit:
        return hit[0], None
    return None, f"{module}: has {has} but no config group targets it"


def _wrong_group(module: str, has: str, group: _Group, want: str) -> str:
    return (f"{module}: has {has}, but the config group that targets it, {group.name}, is {group.format} "
            f"({group.label}), not {want}")


class Judge:
    """compressed-tensors' own decompressor, when importable; else only our unpacking is exercised."""

    def __init__(self):
        self.ct = None
        self.name = "quantkit (compressed-tensors not importable)"
        self._schemes: dict[str, Any] = {}
        if importlib.util.find_spec("compressed_tensors") is None:
            return
        try:
            from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
            from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        except ImportError:  # an incompatible version: fall back to our own unpack
            return
        import compressed_tensors

        self.ct = (PackedQuantizationCompressor, QuantizationArgs, QuantizationScheme)
        self.name = f"compressed-tensors {getattr(compressed_tensors, '__version__', '?')}"

    def args_error(self, weights: dict) -> str | None:
        if self.ct is None:
            return None
        try:
            self.ct[1](**weights)
        except Exception as e:  # pydantic ValidationError and friends: the message is the finding
            return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        return None

    def decompress(self, local: dict[str, torch.Tensor], group: _Group) -> torch.Tensor | None:
        if self.ct is None:
            return None
        compressor, args, scheme_cls = self.ct
        if group.kind != "int4":  # the format's own compressor (nvfp4- / mxfp4-pack-quantized, float-quantized)
            from compressed_tensors.compressors import BaseCompressor

            compressor = BaseCompressor.get_value_from_registry(group.format)
        # keyed by what the scheme is, not the group's name: group_0 of two checkpoints judged by one Judge
        # (a prefill/decode pair) may be different schemes
        key = json.dumps([group.format, group.weights, group.input_activations], sort_keys=True, default=str)
        scheme = self._schemes.get(key)
        if scheme is None:
            acts = args(**group.input_activations) if group.input_activations else None
            scheme = self._schemes[key] = scheme_cls(targets=["Linear"], weights=args(**group.weights),
                                                     input_activations=acts)
        return compressor.decompress(dict(local), scheme)[Tensor.WEIGHT]


@dataclass
class Findings:
    """What the format pass finds: the problems, and (with a reference) each module's weight SQNR and the
    (module, SQNR now, SQNR the manifest recorded) of the drift check; `kernel_modules` (a list, or None: not
    collected) receives up to KERNEL_MODULES INT4 modules' tensors for the kernel check."""

    problems: Listing = field(default_factory=Listing)
    sqnr: dict[str, float] = field(default_factory=dict)
    drift: list[tuple[str, float, float]] = field(default_factory=list)
    kernel_modules: list[tuple[str, dict]] | None = None


@dataclass(frozen=True)
class _Pass:
    """What every module's check reads and where it reports: the checkpoint, its config groups and ignore list,
    the manifest's tensor table, the readers, the judge and the findings."""

    ck: Checkpoint
    groups: list[_Group]
    ignore: list[str]
    mtable: dict
    reader: TensorReader
    ref_reader: "_Reference | None"
    judge: Judge
    found: Findings


def tensor_pass(ck: Checkpoint, manifest: dict | None, ref_ck: Checkpoint | None, judge: Judge, found: Findings,
                say) -> int:
    """Format checks of every quantized module (packed: INT4, NVFP4, MXFP4; FP8), and (with a reference)
    its weight SQNR, in one read of each shard, into `found`. Returns the number of quantized modules seen."""
    problems = found.problems
    qc = ck.quantization_config
    by_module: dict[str, dict] = {}
    for name in ck.location:
        module, _, suffix = name.rpartition(".")
        if suffix in INT4_SUFFIXES or suffix in FP4_SUFFIXES or suffix == INPUT_SCALE:
            by_module.setdefault(module, {})[suffix] = ck.info(name)
    quantized = sorted(m for m, s in by_module.items() if Tensor.PACKED in s)
    qset = set(quantized)
    fp8 = _fp8_modules(ck, qset)
    # the groups are checked when there are quantized weights (a KV-scales-only output has a "dense"
    # config and no weight groups)
    holds = " and ".join(w for w, present in (("packed", quantized), ("FP8", fp8)) if present)
    groups, ignore = (_config_groups(qc, problems, judge, holds) if holds
                      else ([], (qc or {}).get("ignore") or []))
    for m, s in sorted(by_module.items()):
        if m not in qset and any(x in s for x in (Tensor.SHAPE, Tensor.ZERO_POINT, Tensor.G_IDX)):
            problems.add(f"{m}: has {', '.join(sorted(s))} but no weight_packed")
        elif m not in qset and Tensor.SCALE in s and Tensor.WEIGHT.of(m) not in ck.location:
            problems.add(f"{m}.weight_scale: no weight_packed or weight beside it")
    _check_dense_modules(ck, groups, ignore, qset, problems)
    if qc is None and not quantized and not fp8:
        problems.add("config.json has no quantization_config and no shard holds weight_packed or an FP8 "
                     "weight: this is not a quantized checkpoint")
    elif isinstance(qc, dict):
        _check_kv_scales(ck, qc, problems)
    mtable = (manifest or {}).get("tensors") if isinstance((manifest or {}).get("tensors"), dict) else {}
    reader = TensorReader.of(ck)
    _check_config_shapes(ck, {m: by_module[m] for m in quantized}, reader, problems)
    ref_reader = _Reference(ref_ck) if ref_ck is not None else None
    p = _Pass(ck, groups, ignore, mtable, reader, ref_reader, judge, found)
    shard_of = {m: ck.location[Tensor.PACKED.of(m)] for m in quantized}
    shard_of.update({m: ck.location[f"{m}.weight"] for m in fp8})
    try:
        for si, shard in enumerate(ck.shards):
            todo = [m for m in quantized if shard_of[m] == shard.name]
            todo_fp8 = [m for m in fp8 if shard_of[m] == shard.name]
            if todo or todo_fp8:
                say(f"format{' + sqnr' if ref_reader else ''}: {shard.name} ({si + 1}/{len(ck.shards)}, "
                    f"{len(todo) + len(todo_fp8)} modules)")
            for m in todo:
                _check_module(p, m, by_module[m])
            for m in todo_fp8:
                _check_fp8_module(p, m)
            reader.release()  # bounded memory: the mapped pages of one shard at a time
            if ref_reader is not None:
                ref_reader.release()
    finally:
        reader.release()
        if ref_reader is not None:
            ref_reader.release()
    return len(quantized) + len(fp8)


def _check_config_shapes(ck: Checkpoint, packed: dict[str, dict], reader: TensorReader, problems: Listing) -> None:
    """config.json against the tensors, as convert holds a source (arch.validate): the dense weights' shapes,
    then each packed module's logical [out, in] (INT4: its weight_shape; FP4: two codes a byte). A config that
    disagrees with its experts loads in no engine."""
    try:
        spec = validate_config(ck.config, {n: ck.info(n).shape for n in ck.location})
        if spec is None:
            return
        logical = {}
        for m, infos in packed.items():
            ws = infos.get(Tensor.SHAPE)
            if ws is not None and tuple(ws.shape) == (2,) and not ws.dtype.is_floating_point:
                logical[Tensor.WEIGHT.of(m)] = tuple(int(v) for v in reader.get(Tensor.SHAPE.of(m)).tolist())
            elif ws is None and infos[Tensor.PACKED].dtype == torch.uint8 and len(infos[Tensor.PACKED].shape) == 2:
                logical[Tensor.WEIGHT.of(m)] = (infos[Tensor.PACKED].shape[0], infos[Tensor.PACKED].shape[1] * 2)
        check_expert_shapes(spec, logical)
    except QuantkitError as e:
        problems.add(e.message)


def _check_kv_scales(ck: Checkpoint, qc: dict, problems: Listing) -> None:
    """FP8 KV-cache scales against `kv_cache_scheme` (pack/kv.py's rules)."""
    cfg, prefix = text_config(ck.config)
    for p in kvrules.checkpoint_problems(ck.location, ck.info, qc.get("kv_cache_scheme"),
                                         num_layers=cfg.get("num_hidden_layers"),
                                         kv_heads=cfg.get("num_key_value_heads") or cfg.get("num_attention_heads"),
                                         mla="kv_lora_rank" in cfg, prefix=prefix):
        problems.add(p)


def _fp8_modules(ck: Checkpoint, packed: set) -> list[str]:
    """Modules stored FP8: a `.weight` of a one-byte float dtype (the dtype and shape are checked later),
    beside no `weight_packed` (that is reported as a packed module holding both)."""
    out = []
    for name in ck.location:
        if name.endswith(".weight") and name[: -len(".weight")] not in packed:
            dt = ck.info(name).dtype
            if dt.is_floating_point and dt.itemsize == 1:
                out.append(name[: -len(".weight")])
    return sorted(out)


_EMBEDDING = re.compile(r".*(embed|wte|wpe)", re.IGNORECASE)


def _check_dense_modules(ck: Checkpoint, groups: list[_Group], ignore: list[str], qset: set, problems) -> None:
    """A 2-D float weight left dense must not be targeted: a loader would look for weight_packed (or, under
    an FP8 group, read it as float8 with a weight_scale)."""
    if not groups:
        return
    for name in ck.location:
        if not name.endswith(".weight"):
            continue
        m = name[: -len(".weight")]
        info = ck.info(name)
        if m in qset:
            problems.add(f"{m}: holds both weight and weight_packed")
            continue
        if len(info.shape) != 2 or not info.dtype.is_floating_point or info.dtype.itemsize == 1:
            continue
        if any(_matches(p, m) for p in ignore):
            continue
        g, _ = _group_for(m, groups)
        if g is not None and g.kind == "other":
            continue
        by_name = g is not None and (m in g.targets or any(t.startswith("re:") and _matches(t, m) for t in g.targets))
        # a ["Linear"] class target cannot see module classes here: embeddings are not Linear, skip them
        if by_name or (g is not None and not _EMBEDDING.match(m)):
            want = Tensor.PACKED if g.packed else "a float8 weight and a weight_scale"
            problems.add(f"{m}.weight: stored unquantized, but {g.name} targets it and it is not in ignore "
                         f"(loaders would expect {want})")


def _check_module(p: _Pass, m: str, infos: dict) -> None:
    """One packed module (`weight_packed`: INT4, NVFP4, MXFP4): its group, tensors, dtypes, shapes and values;
    compressed-tensors' decompression equals quantkit's bit for bit; the SQNR."""
    ck, groups, reader, problems = p.ck, p.groups, p.reader, p.found.problems
    if any(_matches(pattern, m) for pattern in p.ignore):
        problems.add(f"{m}: quantized (has weight_packed) but listed in quantization_config.ignore")
    group, why = _group_for(m, groups)
    if group is None:
        if groups or ck.quantization_config is not None:
            problems.add(why)
        return
    if not group.packed:
        problems.add(_wrong_group(m, Tensor.PACKED, group, "a packed format"))
        return
    if not group.ok:
        return  # the group's config problem is already reported once
    found = checks.header_problems(m, infos, group.kind, group.weights, group.scheme, group.name)
    for x in found:
        problems.add(x)
    if found:
        return
    if group.kind == "int4":
        n, k = (int(v) for v in reader.get(Tensor.SHAPE.of(m)).tolist())
    else:  # FP4 stores no shape: two codes a byte, never padded
        n, k = infos[Tensor.PACKED].shape[0], infos[Tensor.PACKED].shape[1] * 2
    found = checks.shape_problems(m, infos, group.kind, group.weights, group.scheme, group.name, group.label, n, k)
    for x in found:
        problems.add(x)
    bad = bool(found)
    entry = p.mtable.get(Tensor.PACKED.of(m)) if isinstance(p.mtable.get(Tensor.PACKED.of(m)), dict) else {}
    # a module passed through with its source's own args is labelled `<label>+source` (match/shards.py pass_unit)
    if entry.get("scheme") and str(entry["scheme"]).removesuffix("+source") != group.label:
        problems.add(f"{m}: the manifest records scheme {entry['scheme']}, config.json gives {group.label} "
                     f"({group.name})")
    if bad:
        return
    local = {s: reader.get(f"{m}.{s}") for s in infos}
    bits = group.scheme.num_bits
    found = checks.value_problems(m, group.kind, local, symmetric=group.symmetric, num_bits=bits)
    for x in found:
        problems.add(x)
    if found:
        return
    if group.kind == "int4":
        mine = dequantize_module(local, torch.float32, bits)  # [N, K]
    else:
        mine = fp4pack.dequantize_module(group.kind, local, torch.float32)
    try:
        theirs = p.judge.decompress(local, group)
    except Exception as e:  # third-party code on untrusted tensors: its failure is the finding
        problems.add(f"{m}: compressed-tensors cannot decompress it: {type(e).__name__}: {str(e)[:160]}")
        theirs = None
    else:
        if theirs is not None and (tuple(theirs.shape) != (n, k) or not torch.equal(theirs, mine.to(theirs.dtype))):
            diff = (theirs.float() - mine).abs().max().item() if tuple(theirs.shape) == (n, k) else float("nan")
            problems.add(f"{m}: compressed-tensors decompresses it differently from quantkit "
                         f"(shape {list(theirs.shape)}, max |diff| {diff:.3g})")
    kernel_modules = p.found.kernel_modules
    if kernel_modules is not None and len(kernel_modules) < KERNEL_MODULES and group.kind == "int4" and bits == 4:
        kernel_modules.append((m, local))
    if p.ref_reader is not None:
        _measure(p, m, entry, mine, "weight_shape says" if group.kind == "int4" else "the stored weight is")




def _awq_scaled(m: str, entry: dict, mtable: dict) -> bool:
    """Is the module's stored weight a scaled one? AWQ modules are (their own up->down scales), and so are the
    shared expert's gate/up of a layer whose post-attention norm AWQ changed (the norm scale is compensated
    there, so they were quantized from W * s: quantkit/calib/awq_pass.py)."""
    if entry.get("method") == "awq" or entry.get("modified_by") == "awq":
        return True
    hit = SHARED_GATE_UP.match(m)
    norm = mtable.get(f"{hit[1]}.{POST_ATTN_NORM}.weight") if hit else None
    return isinstance(norm, dict) and norm.get("modified_by") == "awq"


def _measure(p: _Pass, m: str, entry: dict, mine: torch.Tensor, says: str) -> None:
    """Weight SQNR of our dequantization `mine` [N, K] (float32) against the reference's weight, and the
    SQNR the manifest recorded for the module, if any, for the drift check."""
    problems = p.found.problems
    n, k = mine.shape
    if _awq_scaled(m, entry, p.mtable):
        # AWQ folds per-channel scales into the norm, router, shared expert and up_proj: the stored weight is
        # the scaled one, so it is compared with the reference at the model level (KL, top-1), not here
        return
    ref = _reference_weight(m, entry, p.ref_reader)
    if isinstance(ref, str):
        problems.add(ref)
        return
    if tuple(ref.shape) != (n, k):
        problems.add(f"{m}: the reference weight is {list(ref.shape)}, {says} {[n, k]}")
        return
    db = capped_db(float(sqnr_db(ref, mine)))
    p.found.sqnr[m] = db
    recorded = entry.get("sqnr_db")
    if isinstance(recorded, (int, float)) and not isinstance(recorded, bool):  # the manifest's nan / inf alike
        p.found.drift.append((m, db, capped_db(float(recorded))))


def _check_fp8_module(p: _Pass, m: str) -> None:
    """One FP8 (`float-quantized`) module: `<m>.weight` float8_e4m3fn [N, K] + `<m>.weight_scale` of the
    shape its group's strategy implies ([1], [N, 1], [ceil(N/b0), ceil(K/b1)]), positive and finite;
    compressed-tensors' decompression equals quantkit's q.float() * scale bit for bit; the SQNR."""
    ck, problems = p.ck, p.found.problems
    winfo = ck.info(f"{m}.weight")
    has = f"an FP8 weight ({str(winfo.dtype).removeprefix('torch.')})"
    if any(_matches(pattern, m) for pattern in p.ignore):
        problems.add(f"{m}: stored FP8 (a float8 weight) but listed in quantization_config.ignore (loaders would "
                     "read the float8 codes as an unquantized weight)")
    group, why = _group_for(m, p.groups, has)
    if group is None:
        if p.groups or ck.quantization_config is not None:
            problems.add(why)
        return
    if group.kind != "fp8":
        problems.add(_wrong_group(m, has, group, "float-quantized (FP8)"))
        return
    if not group.ok:
        return  # the group's config problem is already reported once
    sname = Tensor.SCALE.of(m)
    found = []
    if winfo.dtype != FP8_DTYPE:
        found.append(f"{m}.weight: dtype {str(winfo.dtype).removeprefix('torch.')}, expected float8_e4m3fn "
                     f"({group.name} is {group.label})")
    if len(winfo.shape) != 2 or not all(winfo.shape):
        found.append(f"{m}.weight: shape {list(winfo.shape)}, expected a non-empty 2-D [out, in]")
    if sname not in ck.location:
        found.append(f"{sname}: missing ({group.name} is {group.label})")
    for x in found:
        problems.add(x)
    if found:
        return
    n, k = winfo.shape
    layout = group.fp8_layout
    want = layout.scale_shape(n, k)
    sinfo = ck.info(sname)
    entry = p.mtable.get(f"{m}.weight") if isinstance(p.mtable.get(f"{m}.weight"), dict) else {}
    bad = False
    dtypes = FP8_SOURCE_SCALE_DTYPES if entry.get("method") == "passthrough" else (torch.float32,)
    if sinfo.dtype not in dtypes:
        problems.add(f"{sname}: dtype {str(sinfo.dtype).removeprefix('torch.')}, expected float32")
        bad = True
    have = tuple(sinfo.shape)
    if have != want and not (want == (1,) and have in ((), (1, 1))):  # a per-tensor scale of another rank
        problems.add(f"{sname}: shape {list(have)}, expected {list(want)} for weight [{n}, {k}] under "
                     f"{group.name} ({group.label})")
        bad = True
    acts = group.input_activations or {}
    gs = acts.get("group_size")
    if acts.get("strategy") == "group" and type(gs) is int and gs > 0 and k % gs:
        problems.add(f"{m}: in_features {k} is not a multiple of {gs}, the group size of {group.name}'s dynamic "
                     "input activations (compressed-tensors and vLLM cannot run it)")
        bad = True
    # a module passed through with its source's own args is labelled `<label>+source` (match/shards.py pass_unit)
    if entry.get("scheme") and str(entry["scheme"]).removesuffix("+source") != group.label:
        problems.add(f"{m}: the manifest records scheme {entry['scheme']}, config.json gives {group.label} "
                     f"({group.name})")
    if bad:
        return
    q, stored_scale = p.reader.get(f"{m}.weight"), p.reader.get(sname)
    found = checks.value_problems(m, "fp8", {Tensor.SCALE: stored_scale})
    for x in found:
        problems.add(x)
    if found:
        return
    scale = stored_scale.float().reshape(want)
    mine = fp8_dequantize(q, scale, layout, torch.float32)  # [N, K]: q.float() * scale, one rounding
    nan = int(torch.isnan(mine).sum())
    if nan:
        problems.add(f"{m}.weight: {nan} NaN code(s)")
        return
    try:
        theirs = p.judge.decompress({Tensor.WEIGHT: q, Tensor.SCALE: stored_scale}, group)
    except Exception as e:  # third-party code on untrusted tensors: its failure is the finding
        problems.add(f"{m}: compressed-tensors cannot decompress it: {type(e).__name__}: {str(e)[:160]}")
    else:
        # float32 scales: both sides compute float32(q) * scale, one IEEE multiply, so the bits agree;
        # a passed-through bf16/fp16 scale: compressed-tensors multiplies in that dtype, i.e. rounds the exact
        # product (q has 4 significant bits, the scale 8 or 11: exact in float32) once, as mine.to() does
        if theirs is not None and (tuple(theirs.shape) != (n, k) or not torch.equal(theirs, mine.to(theirs.dtype))):
            diff = (theirs.float() - mine).abs().max().item() if tuple(theirs.shape) == (n, k) else float("nan")
            problems.add(f"{m}: compressed-tensors decompresses it differently from quantkit "
                         f"(shape {list(theirs.shape)}, max |diff| {diff:.3g})")
    if p.ref_reader is not None:
        _measure(p, m, entry, mine, "the stored weight is")


class _Reference:
    """The reference checkpoint's weights as floats (block-FP8 dequantized, read.tensors), per shard."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self.reader = TensorReader.of(ck)
        try:
            self.stored = scan(ck, detect_format(ck.config))
        except SourceFormatError:
            self.stored = {}

    def release(self) -> None:
        self.reader.release()


def _reference_weight(m: str, entry: dict, ref: _Reference) -> torch.Tensor | str:
    """The reference's float32 weight for module `m`, located through the manifest's `source_tensor` /
    `source_slice` (fused 3-D experts), else `m.weight`; quantized reference modules (FP8, and INT4 or FP4
    such as Kimi K2.5's QAT experts) are decoded. A string is a problem to report."""
    ck = ref.ck
    src = entry.get("source_tensor") if isinstance(entry.get("source_tensor"), str) else f"{m}.weight"
    sl = entry.get("source_slice")
    stored = next((src[: -len(x)] for x in (".weight", Tensor.PACKED.dotted) if src.endswith(x)), m)
    sw = ref.stored.get(stored)
    if sw is not None and sl is None:  # FP8, INT4 or FP4 in the reference: its decoded values
        return ref.reader.decode(sw, torch.float32)
    if src not in ck.location:
        return f"{m}: the reference holds no tensor {src}"
    w = ref.reader.get(src)
    if isinstance(sl, dict):
        e, rows = sl.get("expert"), sl.get("rows")
        if w.ndim != 3 or type(e) is not int or not isinstance(rows, list) or len(rows) != 2 or not 0 <= e < w.shape[0]:
            return f"{m}: the manifest's source_slice {sl} does not fit reference tensor {src} {list(w.shape)}"
        w = w[e, rows[0]:rows[1]]
    if w.dtype.itemsize == 1 and w.dtype.is_floating_point:
        return f"{m}: the reference weight {src} is FP8 without a scale quantkit can read"
    return w.float()
