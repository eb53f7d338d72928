"""The plan of a conversion: every tensor of every source shard matched to the recipe and turned into a
unit of work (match/units.py), output shapes fixed, group sizes checked, output shards sized. Nothing
is written before the whole plan is valid.

Per module, what the source stores and what the recipe asks decide the work (`decide`): copy it,
quantize a float weight (INT4 RTN, FP8, or from the calibrated pass), dequantize an FP8 weight on read
and re-quantize it, or pass a stored-quantized weight through unchanged (FP8 kept as FP8 with its
scales renamed to compressed-tensors' `weight_scale`; INT4 re-quantized only to FP4, decoded on read). Every decision that is
not "quantize as asked" becomes a note (`plan_notes`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import torch

from .. import options
from ..arch import fused_experts
from ..errors import CalibrationNeeded, GroupSizeError, RecipeError, UnsupportedDtype
from ..pack.config import canonical_json, is_nvfp4_w4a4, scheme_config
from ..quant.fp8 import FP8Layout
from ..read.checkpoint import Shard
from ..read.safetensors import TensorInfo
from ..read.sources import FLOAT_DTYPES, StoredWeight
from ..read.safetensors import ELEMENT_SIZE
from .recipe import Recipe, Scheme, WeightGroup, fused_rows_ok
from .units import CalibratedUnit, CopyUnit, DecodeUnit, FP4Unit, FP8Unit, PassUnit, QuantItem, RTNUnit, SourceRef, Unit
from ..arch.layout import FUSED_GATE_UP, QWEN_EXPERTS, any_expert, expert_parts, partner
from ..pack.names import Tensor

DEFAULT_BATCH_BYTES = options.BATCH_BYTES


def _pair_key(key: str) -> str:
    """One batch key for both halves of a gate/up pair: the key with the projection name cut to its base."""
    base, _, last = key.rpartition(".")
    return f"{base}.gate_up" if partner(last) else key
DEFAULT_MAX_SHARD_BYTES = options.MAX_SHARD_BYTES


def spec_bytes(specs) -> int:
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


def fused_items(name: str, info: TensorInfo, hidden: int | None):
    """Per-expert (module, SourceRef, shape) for a fused 3-D expert tensor, or None if not fused."""
    split = fused_experts(name, tuple(info.shape), hidden)
    if split is None:
        return None
    return [(module, SourceRef(name, e, rows), shape) for module, e, rows, shape in split]


def split_parts(output: str, units: list[Unit], info: Callable[[str], TensorInfo], max_bytes: int):
    parts: list[list[Unit]] = [[]]
    size = 0
    for u in units:
        b = spec_bytes(u.outputs(info))
        if parts[-1] and size + b > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append(u)
        size += b
    if len(parts) == 1:
        return ((output, tuple(parts[0])),)
    stem = output.removesuffix(".safetensors")
    return tuple((f"{stem}-part{i + 1:03d}of{len(parts):03d}.safetensors", tuple(p)) for i, p in enumerate(parts))


def pass_unit(sw: StoredWeight, reason: str, group: WeightGroup | None, info: Callable[[str], TensorInfo]) -> PassUnit:
    """Write a stored-quantized module unchanged. Block-FP8 `weight_scale_inv` (a multiplier despite
    its name) is exactly compressed-tensors' block `weight_scale`: renamed, widened to float32."""
    renames = []
    for suffix, src in sw.tensors:
        si = info(src)
        widen = sw.encoding == "fp8-block" and suffix == Tensor.SCALE
        renames.append((f"{sw.module}.{suffix}", src, torch.float32 if widen else si.dtype, tuple(si.shape)))
    cfg = {"format": sw.format, "weights": sw.weights, "input_activations": sw.input_activations}
    label = sw.label
    if sw.encoding != "fp8-block":
        ours = Scheme.from_weights_config(sw.weights, sw.input_activations)
        if ours is None or canonical_json(scheme_config(ours)) != canonical_json(cfg):
            label += "+source"  # the source's own args (e.g. another observer): a config group of its own
    return PassUnit(QuantItem(sw.module, SourceRef(sw.primary), sw.shape), group, tuple(renames), label,
                    json.dumps(cfg), reason)


def effective_scheme(module: str, scheme: Scheme, shape: tuple[int, int],
                     rows_of: Callable[[str], int | None] | None = None) -> Scheme:
    """The scheme applied to `module`'s [N, K] weight (Scheme.for_in_features; with `rows_of`, a module's
    output rows, also the fused-Linear rows rule of block FP8), errors naming the module."""
    try:
        ok = True
        if rows_of is not None and scheme.type == "float" and scheme.strategy == "block":
            ok = fused_rows_ok(module, rows_of, scheme.block_structure[0])
        return scheme.for_in_features(shape[1], ok)
    except GroupSizeError as e:
        raise GroupSizeError(f"{module}: {e.message}", hint=e.hint) from None


def decide(sw: StoredWeight | None, scheme: Scheme | None, targeted: bool,
           rotated: bool = False) -> tuple[str, str | None]:
    """What happens to one weight: ("copy"|"quantize"|"dequantize"|"pass"|"decode", reason). `sw` is how the
    source stores it (None: dense), `scheme` the effective recipe scheme for it (None: untouched; for
    INT4 sources computed only when the group's scheme is FP4: INT4 is re-quantized to FP4 only, never to
    INT4 or FP8), `targeted` whether a recipe group matches it, `rotated` whether the recipe's rotation turns it
    (read/rotate.py refuses INT4 / FP4 modules it would turn; an FP8 one is decoded, turned and written as BF16
    or quantized as the recipe says, never passed through)."""
    if rotated and sw is not None and sw.layout is not None:
        return ("decode", "rotated") if scheme is None else ("dequantize", None)
    if sw is None:
        return ("copy", None) if scheme is None else ("quantize", None)
    if sw.encoding == "int4":
        if scheme is not None and scheme.fp4:  # INT4 -> FP4: decoded on read, re-quantized (another grid)
            return "dequantize", None
        return "pass", ("int4-source-targeted" if targeted else "int4-source")
    if sw.encoding in ("nvfp4", "mxfp4"):
        if scheme is None:
            return "pass", "fp4-kept"
        # NVFP4 W4A4 asked of a weights-only NVFP4 module: it needs calibrated input scales, so it is decoded and
        # re-quantized like any other (a W4A4 source module under a W4A16 recipe passes through as it is)
        same = scheme.fp4 == sw.encoding and not (scheme.w4a4 and not is_nvfp4_w4a4(sw.weights, sw.input_activations))
        return ("pass", "fp4-same-scheme") if same else ("dequantize", None)
    keep = scheme is None or (scheme.type == "float" and scheme.num_bits == 8
                              and FP8Layout(scheme.strategy, scheme.block_structure) == sw.layout)
    if keep and sw.layout.block is not None and sw.shape[1] % sw.layout.block[1]:
        # a partial block along K: compressed-tensors and vLLM run dynamic 1 x width activation groups, which
        # K must fill; no FP8 layout holds these scales exactly, so the module is written as its BF16 values
        return "decode", "fp8-partial-block"
    if scheme is None:
        return "pass", "fp8-kept"
    if keep:
        return "pass", "fp8-same-scheme"
    return "dequantize", None


NOTE_TEXT = {
    "int4-source": "{n} module(s) already INT4 in the source ({labels}) passed through unchanged",
    "int4-source-targeted": ("{n} module(s) targeted by the recipe are already INT4 in the source ({labels}): "
                             "passed through unchanged, not re-quantized (INT4 -> INT4 or FP8 would compound "
                             "rounding error; only an FP4 scheme re-quantizes them; convert from the BF16 or FP8 "
                             "release to re-quantize them otherwise)"),
    "fp8-kept": ("{n} FP8 module(s) not targeted by the recipe kept as the source stores them ({labels}; "
                 "bit-exact, a block-FP8 weight_scale_inv written as weight_scale)"),
    "fp8-same-scheme": "{n} FP8 module(s) already in the recipe's FP8 scheme ({labels}) passed through bit-exact",
    "fp8-dequantized": ("{n} FP8 module(s) dequantized to BF16 on read and re-quantized ({labels})"),
    "fp4-dequantized": ("{n} FP4 module(s) decoded on read and re-quantized ({labels}; each one's SQNR against "
                        "the FP4 values is in the manifest)"),
    "int4-dequantized": ("{n} INT4 module(s) decoded on read and re-quantized to FP4 ({labels}; each one's SQNR "
                         "against the decoded INT4 values is in the manifest)"),
    "fp4-kept": "{n} FP4 module(s) not targeted by the recipe kept as the source stores them ({labels})",
    "fp4-same-scheme": "{n} FP4 module(s) already in the recipe's FP4 scheme ({labels}) passed through bit-exact",
    "rotated": ("{n} FP8 module(s) turned by the recipe's rotation written as their rotated BF16 values ({labels}; "
                "each one's SQNR against its rotated float32 values is in the manifest)"),
    "kv-dropped": "{n} KV-cache scale tensor(s) of the source replaced by the new scales",
    "fp8-partial-block": ("{n} block-FP8 module(s) have in_features that is not a multiple of the block width "
                          "({labels}): no engine runs their dynamic 1 x block activation groups, so they are written "
                          "as their BF16 values (what the releases' fp8_cast_bf16 gives; each one's SQNR against "
                          "the FP8 values is in the manifest); an FP8 scheme with `fallback: channel` re-quantizes "
                          "them instead"),
}


@dataclass(frozen=True)
class ShardContext:
    """What planning one shard reads besides the shard and the recipe: the whole checkpoint's facts and the
    sizes of the work. `stored`: modules the source stores quantized (read/sources.scan); `skip`: tensors not to
    copy (companions of stored modules, replaced KV scales); `location`/`info`: tensor -> shard / header entry
    across the whole checkpoint, for companions stored in another shard (None: the shard's own); `hidden`: the
    config's hidden_size, which fused 3-D expert tensors are held to; `calibrated`: the calibrated pass runs, so
    GPTQ/AWQ groups are planned (else they are an error)."""

    hidden: int | None = None
    batch_bytes: int = DEFAULT_BATCH_BYTES
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    stored: Mapping[str, StoredWeight] | None = None
    skip: frozenset[str] = frozenset()
    location: Mapping[str, str] | None = None
    info: Callable[[str], TensorInfo] | None = None
    calibrated: bool = False
    rotated: frozenset[str] = frozenset()  # tensors the recipe's rotation turns (read/rotate.py)


def plan_shard(shard: Shard, output: str, recipe: Recipe, ctx: ShardContext = ShardContext()) -> ShardPlan:
    """Match every tensor of `shard` against `recipe`. Raises GroupSizeError before any work."""
    m = _ShardMatcher(shard, recipe, ctx)
    for name in sorted(shard.tensors):
        if name not in ctx.skip:
            m.match(name)
    return ShardPlan(shard.name, split_parts(output, m.units(), lambda n: shard.tensors[n], ctx.max_shard_bytes),
                     tuple(sorted(m.foreign.items())))


class _ShardMatcher:
    """One shard's plan as it is built: copies, single units and quantization batches in the order their first
    tensor appears, and the companion tensors read from other shards (`foreign`)."""

    def __init__(self, shard: Shard, recipe: Recipe, ctx: ShardContext):
        self.shard, self.recipe, self.ctx = shard, recipe, ctx
        self.stored = ctx.stored or {}
        self.info = ctx.info or (lambda n: shard.tensors[n])
        self.loc = ctx.location if ctx.location is not None else {n: shard.name for n in shard.tensors}
        self.batches: dict[tuple, list[QuantItem]] = {}
        self.batch_meta: dict[tuple, tuple] = {}
        self.order: list[tuple] = []  # unit order: copies and batches by first appearance
        self.foreign: dict[str, str] = {}

    def match(self, name: str) -> None:
        """One tensor of the shard: a stored-quantized module's primary tensor, a float weight the recipe targets
        (one Linear, or each expert of a fused 3-D tensor), or a tensor to copy."""
        tinfo = self.shard.tensors[name]
        module = name.rsplit(".", 1)[0]
        sw = self.stored.get(module)
        if sw is not None and sw.primary == name:
            self.stored_module(name, module, sw)
            return
        recipe = self.recipe
        fused = fused_items(name, tinfo, self.ctx.hidden) if tinfo.dtype in FLOAT_DTYPES else None
        if fused is not None:
            groups = [recipe.match(mod) for mod, _, _ in fused]
            matched = [g is not None for g in groups]
            if any(matched) and not all(matched):
                raise RecipeError(f"{name}: the recipe quantizes only some of the experts it holds",
                                    hint="target all experts of a fused tensor, or none")
            if any(matched):
                for (mod, ref, shape), g in zip(fused, groups):
                    self.add_quant(mod, ref, shape, tinfo.dtype, (name, ref.rows is not None and ref.rows[0] > 0), g)
                return
        elif name.endswith(".weight") and len(tinfo.shape) == 2 and tinfo.dtype in FLOAT_DTYPES:
            module = name[: -len(".weight")]
            g = recipe.match(module)
            if g is not None:
                # batch all same-shape experts of one layer/projection: key on the name with indices removed
                layer_key = any_expert(module)
                self.add_quant(module, SourceRef(name), tuple(tinfo.shape), tinfo.dtype, layer_key, g)
                return
        elif name.endswith(".weight") and len(tinfo.shape) == 2 and recipe.match(name[: -len(".weight")]) is not None:
            # targeted, but neither a float weight nor one the source stores quantized: never copy it
            # through as if the recipe had not asked for it
            raise UnsupportedDtype(f"{name}: the recipe quantizes this weight, but its dtype "
                                   f"{str(tinfo.dtype).removeprefix('torch.')} cannot be quantized")
        self.order.append(("copy", name))

    def stored_module(self, name: str, module: str, sw: StoredWeight) -> None:
        """A module the source stores quantized, at its primary tensor `name`: passed through, decoded to its
        float values, or dequantized on read and quantized as the recipe says (`decide`)."""
        g = self.recipe.match(module)
        scheme = None if g is None or (sw.encoding == "int4" and not g.scheme.fp4) else \
            effective_scheme(module, g.scheme, sw.shape, self.rows_of)
        action, reason = decide(sw, scheme, g is not None, name in self.ctx.rotated)
        layer_key = any_expert(module)
        if action == "pass":
            u = pass_unit(sw, reason, g, self.info)
            for _, src, _, _ in u.renames:
                self.need(src)
            self.order.append(("unit", u))
        elif action == "decode":
            for _, t in sw.tensors:
                self.need(t)
            ref = SourceRef(name, scale=sw.scale, layout=sw.layout, scale_fmt=sw.scale_fmt, encoding=sw.encoding)
            self.order.append(("unit", DecodeUnit(QuantItem(module, ref, sw.shape), reason, sw.label)))
        else:  # dequantize on read, then quantize as the recipe says
            for _, t in sw.tensors:
                self.need(t)
            ref = SourceRef(name, scale=sw.scale, layout=sw.layout, scale_fmt=sw.scale_fmt, encoding=sw.encoding,
                            stored=sw if sw.layout is None else None)
            self.add_quant(module, ref, sw.shape, torch.bfloat16, layer_key, g, scheme)

    def rows_of(self, module):
        """Output rows of a module anywhere in the checkpoint (dense or stored quantized), None if absent."""
        if module in self.stored:
            return self.stored[module].shape[0]
        return self.info(f"{module}.weight").shape[0] if f"{module}.weight" in self.loc else None

    def add_quant(self, module, ref, shape, dtype, layer_key, g, scheme=None):
        """One weight into the batch of its kind, layer/projection, group, scheme, shape and dtype."""
        if g.method != "rtn" and not self.ctx.calibrated:
            raise CalibrationNeeded(f"{module}: method {g.method} needs calibration data",
                                    hint="GPTQ/AWQ groups are quantized by the calibrated pass, which `quantkit convert` "
                                         "runs before it streams the shards")
        scheme = scheme or effective_scheme(module, g.scheme, shape, self.rows_of)
        if g.method != "rtn":
            kind = CalibratedUnit
        else:
            kind = FP4Unit if scheme.fp4 else FP8Unit if scheme.type == "float" else RTNUnit
        partner = self.partner_item(module, g) if kind is FP4Unit and scheme.fp4 == "nvfp4" else None
        if partner is not None:  # the pair in one batch: one read gives both halves' amax
            layer_key = ("pair", _pair_key(layer_key) if isinstance(layer_key, str) else layer_key[0])
        key = (kind.__name__, layer_key, g.name, scheme, shape, dtype)
        if key not in self.batches:
            self.batches[key] = []
            self.batch_meta[key] = (kind, g, scheme, dtype)
            self.order.append(("quant", key))
        self.batches[key].append(QuantItem(module, ref, shape, partner))

    def partner_item(self, module, g):
        """NVFP4: the other half of a gate/up pair, targeted by the same group (one global scale)."""
        base, _, last = module.rpartition(".")
        other = partner(last)  # NVFP4: vLLM fuses gate and up (w13), which must share one global scale
        if other is None or self.recipe.match(f"{base}.{other}") is not g:
            return None
        ref = self.ref_of(f"{base}.{other}")
        if ref is None:
            return None
        for t in ([t for _, t in ref.stored.tensors] if ref.stored is not None else (ref.tensor, ref.scale)):
            if t is not None:
                self.need(t)
        return QuantItem(f"{base}.{other}", ref, self.shape_of(ref))

    def ref_of(self, module):
        """Where a module's float weight comes from, anywhere in the checkpoint (None: not a float weight)."""
        sw = self.stored.get(module)
        if sw is not None:
            g = self.recipe.match(module)
            if sw.encoding == "int4" and not (g is not None and g.scheme.fp4):
                return None  # INT4 in the source: re-quantized to FP4 only
            return SourceRef(sw.primary, scale=sw.scale, layout=sw.layout, scale_fmt=sw.scale_fmt,
                             encoding=sw.encoding, stored=sw if sw.layout is None else None)
        if f"{module}.weight" in self.loc:
            return SourceRef(f"{module}.weight")
        m = expert_parts(module)
        fused = f"{m[0]}.{FUSED_GATE_UP}" if m else None
        if fused in self.loc and m[2] in (QWEN_EXPERTS.gate, QWEN_EXPERTS.up):  # transformers' fused layout
            rows = self.info(fused).shape[1]
            return SourceRef(fused, m[1], (0, rows // 2) if m[2] == QWEN_EXPERTS.gate else (rows // 2, rows))
        return None

    def shape_of(self, ref):
        if ref.stored is not None:  # FP4 in the source: the decoded [N, K], not the packed bytes' shape
            return tuple(ref.stored.shape)
        i = self.info(ref.tensor)
        shape = tuple(i.shape[1:] if ref.expert is not None else i.shape)
        return (ref.rows[1] - ref.rows[0], shape[1]) if ref.rows is not None else shape

    def need(self, tensor):
        """A companion tensor this shard's units read: noted when another shard stores it."""
        where = (self.ctx.location or {}).get(tensor, self.shard.name)
        if where != self.shard.name:
            self.foreign[tensor] = where

    def units(self) -> list[Unit]:
        """The units in order; each batch cut to `batch_bytes` of bf16 weights (a gate/up pair never split)."""
        units: list[Unit] = []
        for kind, key in self.order:
            if kind == "copy":
                units.append(CopyUnit(key))
                continue
            if kind == "unit":
                units.append(key)
                continue
            ukind, g, scheme, dtype = self.batch_meta[key]
            items = self.batches[key]
            per = max(1, self.ctx.batch_bytes // (items[0].shape[0] * items[0].shape[1] * 2))
            if items[0].partner is not None:  # never split a gate/up pair over two batches
                per = max(2, per - per % 2)
            for i in range(0, len(items), per):
                units.append(ukind(tuple(items[i:i + per]), g, scheme, dtype))
        return units


def output_shard_names(src) -> dict[str, str]:
    n = len(src.shards)
    return {s.name: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, s in enumerate(src.shards)}


def plan_notes(plans: list[ShardPlan], kv_dropped: int, stored: Mapping[str, StoredWeight]) -> list[str]:
    """One line per kind of decision that is not "quantize as asked" (deterministic order)."""
    counts: dict[str, dict[str, int]] = {}
    for p in plans:
        for u in p.units:
            if isinstance(u, PassUnit):
                counts.setdefault(u.reason, {}).setdefault(u.label, 0)
                counts[u.reason][u.label] += 1
            elif isinstance(u, DecodeUnit):
                counts.setdefault(u.reason, {}).setdefault(u.label, 0)
                counts[u.reason][u.label] += 1
            elif isinstance(u, (RTNUnit, FP8Unit, FP4Unit, CalibratedUnit)):
                for it in u.items:
                    if it.source.encoding is not None:
                        key = f"{it.source.encoding} -> {u.scheme.label}"
                        enc = it.source.encoding
                        reason = ("fp4-dequantized" if enc in ("nvfp4", "mxfp4") else "int4-dequantized"
                                  if enc == "int4" else "fp8-dequantized")
                        counts.setdefault(reason, {}).setdefault(key, 0)
                        counts[reason][key] += 1
    if kv_dropped:
        counts["kv-dropped"] = {"": kv_dropped}
    notes = []
    for reason in NOTE_TEXT:
        if reason in counts:
            c = counts[reason]
            labels = ", ".join(f"{n} {lb}" for lb, n in sorted(c.items()))
            notes.append(NOTE_TEXT[reason].format(n=sum(c.values()), labels=labels))
    return notes


