"""What a source checkpoint holds, and how to read its weights as plain floats (dequantize on read).

The format is read from config.json's `quantization_config`, never guessed from tensor names; the
tensors must then agree with it (docs/format.md, "Sources"):

- `dense`: no quantization_config; `<m>.weight` bf16/fp16/fp32.
- `fp8-block` (DeepSeek-V3, Kimi K2, GLM FP8 releases): `quant_method: fp8` with `weight_block_size:
  [b0, b1]`; `<m>.weight` float8_e4m3fn + `<m>.weight_scale_inv` float32 `[ceil(N/b0), ceil(K/b1)]`.
- `compressed-tensors`: `quant_method: compressed-tensors`, status `compressed`, groups
  `float-quantized` / `naive-quantized` (FP8: `<m>.weight` float8 + `<m>.weight_scale`) and/or
  `pack-quantized` (INT4: `<m>.weight_packed` + `weight_scale` + `weight_shape` [+ `weight_zero_point`,
  `weight_g_idx`]), alone or mixed-precision.

`scan` maps every quantized module to a `StoredWeight` (its tensors, shape and scheme); everything else
in the checkpoint is dense. `read_weight` dequantizes one FP8 weight to BF16 while streaming (in row
strips, quant/fp8.py): w = q.float() * scale (per block / row / tensor), rounded once to BF16 — exactly what the
releases' own `fp8_cast_bf16` scripts produce, so converting an FP8 release equals converting its BF16
dequantization. INT4 and FP4 weights are decoded by read/tensors.py (`TensorReader.decode`) when convert
re-quantizes them (INT4 only to FP4: INT4 -> INT4 compounds rounding error, match/shards.decide).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import SourceFormatError, SourceSchemeError, SourceTensorError
from ..quant.fp8 import FP8_DTYPE, FP8Layout, dequantize as fp8_dequantize
from ..pack.layout import FP4_SUFFIXES, FP8_SUFFIXES, INT4_SUFFIXES
from ..pack import checks
from ..pack.config import config_groups, fp8_input_activations, fp8_weights_config, targeting, weights_label
from ..pack.names import FLOAT_FORMATS, FP4_FORMATS, PACKED_FORMATS, Format, Tensor
from .checkpoint import Checkpoint
from .tensors import read_scale  # noqa: F401 (the reader decodes FP8 scales; re-exported)

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_DTYPES = FLOAT_DTYPES + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())
# the compressed-tensors formats convert reads
READ_FORMATS = (*FLOAT_FORMATS, Format.PACKED, *FP4_FORMATS)
# an FP8 module of a compressed-tensors source may carry static activation scales: passed through with it
FP8_SOURCE_SUFFIXES = FP8_SUFFIXES + (Tensor.INPUT_SCALE, Tensor.INPUT_ZERO_POINT)




@dataclass(frozen=True)
class SourceFormat:
    kind: str  # "dense" | "fp8-block" | "compressed-tensors"
    block: tuple[int, int] | None = None  # fp8-block: weight_block_size
    scale_fmt: str | None = None  # fp8-block: "ue8m0" promises power-of-two scales
    not_converted: tuple[str, ...] = ()  # fp8-block: modules_to_not_convert (left in BF16 by the release)
    groups: tuple[dict, ...] = ()  # compressed-tensors: the config_groups, each with its resolved `format`
    kv_cache_scheme: dict | None = None  # compressed-tensors: the source's KV-cache scheme, if any

    def describe(self) -> str:
        if self.kind == "dense":
            return "dense (unquantized)"
        if self.kind == "fp8-block":
            return (f"block-FP8 e4m3 {self.block[0]}x{self.block[1]}"
                    + (", ue8m0 scales" if self.scale_fmt == "ue8m0" else ""))
        fmts = sorted({g["format"] for g in self.groups})
        return "compressed-tensors " + "+".join(fmts)


def detect_format(config: dict) -> SourceFormat:
    """The source format from config.json (see the module docstring); raises SourceFormatError."""
    qc = config.get("quantization_config")
    if qc is None:
        return SourceFormat("dense")
    if not isinstance(qc, dict):
        raise SourceFormatError("config.json quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        bs = qc.get("weight_block_size")
        if not (isinstance(bs, list) and len(bs) == 2 and all(type(b) is int and b > 0 for b in bs)):
            raise SourceFormatError(f"FP8 source without a valid weight_block_size ({bs!r}): only block-wise "
                                    "FP8 (DeepSeek-V3 style) is read")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise SourceFormatError(f"FP8 source format fmt={qc.get('fmt')!r}: only e4m3 is read")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise SourceFormatError(f"FP8 source with activation_scheme={qc.get('activation_scheme')!r}: only "
                                    "dynamic activations (no stored input scales) are read")
        sf = qc.get("scale_fmt")
        if sf not in (None, "ue8m0"):
            raise SourceFormatError(f"FP8 source with scale_fmt={sf!r}: only float32 or ue8m0 scales are read")
        nc = qc.get("modules_to_not_convert") or ()
        if not isinstance(nc, (list, tuple)) or not all(isinstance(m, str) for m in nc):
            raise SourceFormatError("quantization_config.modules_to_not_convert must be a list of module names")
        return SourceFormat("fp8-block", (bs[0], bs[1]), sf, tuple(nc))
    if method == "compressed-tensors":
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise SourceFormatError(f"compressed-tensors source with quantization_status {status!r}: only "
                                    "'compressed' checkpoints are read")
        groups = []
        for g in sorted(config_groups(qc, SourceFormatError), key=lambda g: g.name):
            if g.format not in READ_FORMATS:
                raise SourceFormatError(f"compressed-tensors group {g.name} has format {str(g.format)[:60]!r}; "
                                        f"convert reads {', '.join(READ_FORMATS)}")
            w = g.weights or {}
            check_group_args(g.name, g.format, w)
            groups.append({"name": g.name, "format": Format(g.format), "targets": list(g.targets), "weights": w,
                           "input_activations": g.input_activations})
        return SourceFormat("compressed-tensors", groups=tuple(groups), kv_cache_scheme=qc.get("kv_cache_scheme"))
    raise SourceFormatError(f"source is quantized with quant_method {method!r}, which convert does not read",
                            hint="convert from the BF16 or block-FP8 release of the model")


def one_line(msg: str, limit: int = 300) -> str:
    """An error message built from hostile names (tensor, module, group): control characters escaped, cut to
    `limit` characters, so that it stays one short line."""
    if not msg.isprintable():
        msg = msg.encode("unicode_escape").decode("ascii")
    return msg if len(msg) <= limit else msg[:limit] + "..."


def group_kind(fmt: str) -> str:
    """The encoding (pack/checks.py kinds) a compressed-tensors format stores: int4, fp8, nvfp4, mxfp4."""
    return "fp8" if fmt in FLOAT_FORMATS else PACKED_FORMATS[fmt]


def check_group_args(name: str, fmt: str, w) -> None:
    """A source config group's weight args are a scheme of its format that convert reads (pack/checks.py,
    the rule verify holds outputs to): num_bits, type, strategy, group_size, symmetric, block_structure."""
    problem = checks.scheme_problem(group_kind(fmt), w)
    if problem:
        raise SourceSchemeError(one_line(f"compressed-tensors group {str(name)[:60]} (format {fmt}): weights: {problem}"))


# ---- per-module view -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredWeight:
    """One module's weight as the source stores it, when the source quantized it."""

    module: str
    encoding: str  # "fp8-block" | "fp8" (compressed-tensors float-quantized) | "int4" (pack-quantized) | "nvfp4" | "mxfp4"
    shape: tuple[int, int]  # [N, K] = [out, in]
    tensors: tuple[tuple[str, str], ...]  # (output suffix, source tensor): the primary first
    weights: dict  # compressed-tensors QuantizationArgs (dict) that describe this encoding
    input_activations: dict | None = None
    format: str = Format.FLOAT  # compressed-tensors format for a pass-through
    layout: FP8Layout | None = None  # FP8 encodings: where the scales live
    scale_fmt: str | None = None  # fp8-block "ue8m0"

    @property
    def primary(self) -> str:
        return self.tensors[0][1]

    @property
    def scale(self) -> str:
        return dict(self.tensors)[Tensor.SCALE]

    @property
    def label(self) -> str:
        return weights_label(self.weights, self.input_activations)


def _layout_from_args(w: dict, module: str) -> FP8Layout:
    s = w.get("strategy")
    if s == "block":
        bs = w.get("block_structure") or [128, 128]
        return FP8Layout("block", (int(bs[0]), int(bs[1])))
    if s in ("tensor", "channel"):
        return FP8Layout(s)
    raise SourceFormatError(f"{module}: FP8 strategy {s!r} is not one convert reads (tensor, channel, block)")


def _ct_group(fmt: SourceFormat, module: str, want_float: bool) -> dict:
    """The source config group that describes `module` (compressed-tensors rules: exact name, then
    `re:`, then class-name targets such as "Linear")."""
    cands = [g for g in fmt.groups if (g["format"] in FLOAT_FORMATS) == want_float]  # FP8, or the packed formats
    pool = targeting(module, cands, lambda g: g["targets"])
    if not pool:
        raise SourceFormatError(f"{module} is stored {'FP8' if want_float else 'INT4'}, but no config group "
                                "of the source's quantization_config targets it")
    return pool[0]


def scan(ck: Checkpoint, fmt: SourceFormat) -> dict[str, StoredWeight]:
    """Every module the source stores quantized, checked against the format: module -> StoredWeight.
    Companion tensors (scales, shapes, ...) may live in another shard than the weight."""
    loc = {n: i for s in ck.shards for n, i in s.tensors.items()}  # tensor -> TensorInfo
    out: dict[str, StoredWeight] = {}
    f8 = sorted(n for n, i in loc.items() if i.dtype in (FP8_DTYPE, torch.float8_e5m2)
                and not (n.endswith(Tensor.SCALE.dotted) and
                         n[: -len(Tensor.SCALE)] + Tensor.PACKED in loc))  # NVFP4 scales
    if fmt.kind == "dense":
        if f8:
            raise SourceFormatError(f"{f8[0]} is float8, but config.json has no quantization_config saying how "
                                    "to dequantize it", hint="restore the release's config.json")
        return out
    if fmt.kind == "fp8-block":
        for name in f8:
            info = loc[name]
            m = _fp8_module(name, info, "block-FP8 sources")
            layout = FP8Layout("block", fmt.block)
            sname = Tensor.RELEASE_SCALE.of(m)
            _check_scale(loc, m, sname, layout.scale_shape(*info.shape))
            out[m] = StoredWeight(m, "fp8-block", tuple(info.shape), ((Tensor.WEIGHT, name), (Tensor.SCALE, sname)),
                                  fp8_weights_config(layout), fp8_input_activations(layout), Format.FLOAT,
                                  layout, fmt.scale_fmt)
        orphans = [n for n in loc if n.endswith(Tensor.RELEASE_SCALE.dotted) and
                   n[: -len(Tensor.RELEASE_SCALE)] + Tensor.WEIGHT not in loc]
        if orphans:
            raise SourceFormatError(f"{orphans[0]} has no weight next to it")
        return out
    # compressed-tensors
    for name in sorted(loc):
        if name.endswith(Tensor.PACKED.dotted):
            m = name[: -len(Tensor.PACKED.dotted)]
            g = _ct_group(fmt, m, want_float=False)
            _check_packed_headers(m, loc, g)
            kind = g["format"].fp4
            if kind:  # two E2M1 codes a byte, never padded: no weight_shape
                rows, cols = loc[name].shape[0], loc[name].shape[1] * 2
                tensors = tuple((s, f"{m}.{s}") for s in FP4_SUFFIXES if f"{m}.{s}" in loc)
                out[m] = StoredWeight(m, kind, (rows, cols), tensors, dict(g["weights"]), g["input_activations"],
                                      g["format"])
                continue
            rows = loc[name].shape[0]
            cols = loc[name].shape[1] * (32 // int(g["weights"].get("num_bits", 4)))
            tensors = tuple((s, f"{m}.{s}") for s in INT4_SUFFIXES if f"{m}.{s}" in loc)
            # the exact in_features is in weight_shape (a tensor): record the padded one from the header
            out[m] = StoredWeight(m, "int4", (rows, cols), ((Tensor.PACKED, name),) + tensors[1:],
                                  dict(g["weights"]), g["input_activations"], g["format"])
    for name in f8:
        info = loc[name]
        m = _fp8_module(name, info, "compressed-tensors FP8 groups")
        g = _ct_group(fmt, m, want_float=True)
        layout = _layout_from_args(g["weights"], m)
        _check_scale(loc, m, Tensor.SCALE.of(m), layout.scale_shape(*info.shape))
        tensors = ((Tensor.WEIGHT, name),) + tuple((s, f"{m}.{s}") for s in FP8_SOURCE_SUFFIXES[1:] if f"{m}.{s}" in loc)
        out[m] = StoredWeight(m, "fp8", tuple(info.shape), tensors, dict(g["weights"]), g["input_activations"],
                              g["format"], layout)
    return out


def _fp8_module(name: str, info, where: str) -> str:
    """The module of an FP8 `.weight` tensor; anything else stored in float8 is refused."""
    if not name.endswith(".weight") or len(info.shape) != 2 or info.dtype != FP8_DTYPE:
        raise SourceFormatError(f"{name} {info.dtype} {list(info.shape)}: only 2-D float8_e4m3fn `.weight` "
                                f"tensors are read from {where}")
    return name[: -len(".weight")]


def _check_scale(loc: dict, module: str, sname: str, want: tuple[int, ...]) -> None:
    if sname not in loc:
        raise SourceFormatError(f"{module}.weight is float8 but {sname} is missing",
                                hint="the checkpoint is incomplete; re-download the shard that holds it")
    si = loc[sname]
    ok = tuple(si.shape) == want or (want == (1,) and tuple(si.shape) in ((), (1, 1)))
    if not ok or si.dtype not in SCALE_DTYPES:
        raise SourceFormatError(f"{sname} is {si.dtype} {list(si.shape)}; expected float32 {list(want)}")


# ---- every quantized module against its scheme (pack/checks.py), before anything is written ----------
def _check_packed_headers(m: str, loc: dict, g: dict) -> None:
    """A packed source module (INT4, NVFP4, MXFP4) as its headers show it: the tensors its group implies,
    their dtypes, weight_packed 2-D and non-empty (what `scan` computes the module's shape from)."""
    kind = group_kind(g["format"])
    suffixes = checks.INT4_SUFFIXES if kind == "int4" else checks.FP4_SUFFIXES
    infos = {s: loc[f"{m}.{s}"] for s in suffixes if f"{m}.{s}" in loc}
    found = checks.header_problems(m, infos, kind, g["weights"], _scheme(g["weights"]), f"group {g['name'][:60]}")
    if found:
        raise SourceTensorError(one_line(found[0]))


_SCHEMES: dict[str, object] = {}  # the args a Scheme is built from -> the Scheme


def _scheme(w: dict):
    """The match.recipe.Scheme of a group's weight args (valid: detect_format checked every group's args),
    parsed once per distinct args."""
    from ..pack.scheme import Scheme

    key = repr([w.get(f) for f in ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure")])
    if key not in _SCHEMES:
        _SCHEMES[key] = Scheme.parse_weights_config(w)
    return _SCHEMES[key]


def validate(ck: Checkpoint, stored: dict[str, StoredWeight]) -> dict[str, tuple[int, int]]:
    """Every module the source stores quantized (passed through or re-quantized alike) against its scheme,
    by the rules verify holds outputs to (pack/checks.py): INT4 weight_shape positive and agreeing with the
    packed data, every tensor the shape its scheme implies, group sizes dividing in_features; scales finite,
    positive and plausible, NVFP4 global scales finite and positive, no E8M0 255. Reads only the small
    tensors (scales, weight_shape, g_idx), one shard's mapping at a time. Raises SourceTensorError naming
    the tensor and the rule. -> each module's logical weight shape [out, in] (INT4: what weight_shape holds),
    for the caller to hold against config.json (arch.check_expert_shapes)."""
    from .tensors import TensorReader

    by_shard: dict[str, list[StoredWeight]] = {}
    for sw in stored.values():
        by_shard.setdefault(ck.location[sw.primary], []).append(sw)
    shapes: dict[str, tuple[int, int]] = {}
    with TensorReader.of(ck) as r:
        for shard in sorted(by_shard):
            for sw in sorted(by_shard[shard], key=lambda x: x.module):
                found = _module_problems(r, sw, shapes)
                if found:
                    raise SourceTensorError(one_line(found[0]))
            r.release()
    return shapes


def _module_problems(r, sw: StoredWeight, shapes: dict[str, tuple[int, int]]) -> list[str]:
    m, local = sw.module, dict(sw.tensors)
    if sw.encoding in ("fp8", "fp8-block"):
        suffix = Tensor.RELEASE_SCALE if sw.encoding == "fp8-block" else Tensor.SCALE
        found = checks.value_problems(m, "fp8", {suffix: r.get(sw.scale)}, scale=suffix)
        if not found and Tensor.INPUT_SCALE in local:  # a static activation scale, passed through with the module
            found = checks.value_problems(m, "fp8", {Tensor.INPUT_SCALE: r.get(local[Tensor.INPUT_SCALE])},
                                          scale=Tensor.INPUT_SCALE)
        return found
    infos = {s: r.info(t) for s, t in local.items()}
    scheme = _scheme(sw.weights)
    group = "its config group"
    if sw.encoding == "int4":
        n, k = (int(v) for v in r.get(local[Tensor.SHAPE]).tolist())
    else:
        n, k = sw.shape
    shapes[m] = (n, k)
    found = checks.shape_problems(m, infos, sw.encoding, sw.weights, scheme, group, sw.label, n, k)
    if found:
        return found
    small = {s: r.get(t) for s, t in local.items() if s != Tensor.PACKED}
    return checks.value_problems(m, sw.encoding, small, symmetric=scheme.symmetric, num_bits=scheme.num_bits)


# ---- reading -------------------------------------------------------------------------------------
@dataclass
class Notes:
    """Messages about the source found while reading (e.g. scales that break a ue8m0 promise)."""

    items: list[str] = field(default_factory=list)

    def add(self, msg: str) -> None:
        if msg not in self.items:
            self.items.append(msg)


def read_weight(get: Callable[[str], torch.Tensor], sw: StoredWeight, dtype: torch.dtype = torch.bfloat16,
                notes: Notes | None = None) -> torch.Tensor:
    """Dequantize one FP8 weight [N, K] to `dtype` (BF16: what the releases' fp8_cast_bf16 writes)."""
    if sw.layout is None:
        raise SourceFormatError(f"{sw.module} is stored {sw.encoding}; it is passed through, never dequantized "
                                "for re-quantization")
    return fp8_dequantize(get(sw.primary), read_scale(get, sw.scale, sw.layout, sw.scale_fmt, notes), sw.layout, dtype)
