"""`quantkit export QMODEL OUT.gguf`: a quantkit output (or any compressed-tensors checkpoint quantkit reads) as a
GGUF that llama.cpp runs, experts keeping their codes and scales (docs/export.md).

Two passes over the checkpoint's headers and one over its data:
1. plan: every tensor's GGUF name, GGML type and shape from the headers (and the few-byte `weight_shape`s),
   with what llama.cpp cannot represent refused by name before a byte is written;
2. write: GGUF header, metadata and tensor table (gguf-py's GGUFWriter, split into llama.cpp's
   `-0000N-of-0000M.gguf` files past `split_max_size`), then the tensors in order, an expert stack one expert at
   a time: resident memory stays within one expert's arrays plus the mapped pages being read.

Routed experts: INT4 symmetric (group 32k or channel) -> Q4_0, asymmetric -> Q4_1 (m = -(8 + z) s rounded to fp16:
counted), INT8 symmetric -> Q8_0, MXFP4 -> MXFP4 bit for bit, NVFP4 -> NVFP4 + each expert's global scale as a
`.scale` tensor (qwen3_moe, whose llama.cpp graph applies it), BF16 -> BF16. Other modules keep their dtype; FP8
modules are decoded (BF16 by default, F32 exact); norms, routers, biases F32 as llama.cpp needs. Output files
appear only when complete (written under a hidden temporary name, fsynced, renamed).
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..arch import check_expert_shapes, fused_experts, layer_index, parse_config
from ..arch import validate as validate_config
from ..arch.layout import ATTN, EXPERT_PROJ, KV_B, ROUTER_BIAS, enumerate_tensors, expert_role
from ..arch.layout import K as K_PROJ, Q as Q_PROJ
from ..errors import ConfigMismatch, ExportError, NotRepresentable, OutputExists
from ..pack.int4 import unpack_ints, unpack_zero_point
from ..pack.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from ..pack.names import Tensor
from ..read.checkpoint import Checkpoint
from ..read.files import check_regular, parse_json, read_bytes
from ..read.sources import StoredWeight, detect_format, scan, validate
from ..read.tensors import TensorReader
from . import blocks
from .llama_arch import GGUF_ARCH, mixtral_permute, refusals, write_hparams, yarn_betas
from .vocab import write_vocab

NOT_TEXT = "not the text model (vision tower, projector)"
MTP = "MTP layers (llama.cpp's main graph does not run them)"
F32_NAMES = ("ffn_gate_inp", "exp_probs_b", "indexer.proj")
W4A8_NOTE = ("llama.cpp multiplies Q4_0 / Q4_1 / MXFP4 / Q8_0 weights with activations quantized to 8 bits "
             "(Q8_0 / Q8_1): what it serves is close to W4A8, not the checkpoint's W4A16")


@dataclass(frozen=True)
class ExportOptions:
    split_max_size: int = 0  # bytes per GGUF file (0: one file)
    fp8: str = "bf16"  # FP8 modules decoded to: bf16 (one rounding, as the releases' fp8_cast_bf16) | f32 (exact)
    pre_tokenizer: str | None = None  # llama.cpp's pre-tokenizer name (default: "default")
    overwrite: bool = False


@dataclass(frozen=True)
class Copy:
    """A chunk that is a checkpoint tensor's bytes as they are: copied file to file (copy_file_range), never
    through this process's memory."""

    tensor: str


@dataclass
class Item:
    """One GGUF tensor: numpy-order logical shape, GGML type, bytes, and how to produce them."""

    name: str
    qtype: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    nbytes: int
    chunks: Callable[[], Iterator[np.ndarray]]
    source: str  # what it was made from (the report)


@dataclass
class Plan:
    arch: str
    items: list[Item] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)  # why -> tensors or modules not exported
    experts: dict[str, int] = field(default_factory=dict)  # "Q4_0 <- INT4 g32 symmetric" -> expert tensors
    counts: blocks.Inexact = field(default_factory=blocks.Inexact)


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - a dependency
        raise ExportError("the gguf package is not installed", hint="pip install 'gguf>=0.17'") from None
    return gguf


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.contiguous().numpy()


# ---- what each stored module becomes ----------------------------------------------------------------------
@dataclass(frozen=True)
class Encoding:
    qtype: str  # GGML type name
    k: int  # in_features
    label: str


def _int_arg(w: dict, key: str, default=None):
    v = w.get(key, default)
    return v if v is None or (type(v) is int and v > 0) else None


# llama.cpp 0.3.36 graphs that multiply a routed expert's output by its `.scale` tensor (NVFP4's global scale):
# build_moe_ffn receives the scales only where the graph passes them (src/models/qwen3moe.cpp); elsewhere the loader
# would read them and the graph ignore them
NVFP4_EXPERT_ARCHS = ("qwen3_moe",)


def encoding_of(sw: StoredWeight, reader: TensorReader, fp8: str, nvfp4: str | None = None) -> Encoding:
    """The GGML type a stored module is written as; NotRepresentable when GGUF has no exact type for it. `nvfp4`:
    why NVFP4 cannot be written here (None: a routed expert of an architecture whose llama.cpp graph applies the
    global scale)."""
    w = sw.weights or {}
    n, k = sw.shape
    if sw.encoding == "int4":
        t = dict(sw.tensors)
        shape = reader.get(t[Tensor.SHAPE]).reshape(-1).tolist() if Tensor.SHAPE in t else [n, k]
        if len(shape) != 2 or int(shape[0]) != n or not 0 < int(shape[1]) <= k:
            raise ExportError(f"{sw.module}: weight_shape {shape} does not match its packed rows ({n} x <= {k})")
        k = int(shape[1])
        bits = int(w.get("num_bits", 4))
        if Tensor.G_IDX in t:
            raise NotRepresentable(f"{sw.module}: INT4 with actorder 'group' (weight_g_idx): a GGML block needs its "
                                   "columns in order")
        strategy, group = w.get("strategy"), _int_arg(w, "group_size")
        if strategy == "channel":
            group = k
        if strategy not in ("group", "channel") or not group or group % blocks.QK or k % group:
            raise NotRepresentable(f"{sw.module}: INT{bits} {strategy} group {w.get('group_size')} over {k} columns: "
                                   f"GGML blocks are {blocks.QK} columns, so a group must be a multiple of {blocks.QK}")
        sym = w.get("symmetric", True) is not False
        label = f"INT{bits} {'channel' if strategy == 'channel' else f'g{group}'} {'symmetric' if sym else 'asymmetric'}"
        if bits == 4:
            return Encoding("Q4_0" if sym else "Q4_1", k, label)
        if bits == 8 and sym:
            return Encoding("Q8_0", k, label)
        raise NotRepresentable(f"{sw.module}: {label}: no exact GGML type (Q8_0 is symmetric)")
    if sw.encoding == "mxfp4":
        if k % blocks.QK:
            raise NotRepresentable(f"{sw.module}: MXFP4 over {k} columns is not whole GGML blocks of {blocks.QK}")
        return Encoding("MXFP4", k, "MXFP4")
    if sw.encoding == "nvfp4":
        if nvfp4 is not None:
            raise NotRepresentable(f"{sw.module}: NVFP4: {nvfp4}",
                                   hint="export an MXFP4 (mxfp4-experts) or INT4 conversion of the same source")
        if k % blocks.QK_NVFP4:
            raise NotRepresentable(f"{sw.module}: NVFP4 over {k} columns is not whole GGML superblocks of "
                                   f"{blocks.QK_NVFP4}")
        return Encoding("NVFP4", k, "NVFP4 (global scale as the expert's .scale)")
    if sw.encoding in ("fp8", "fp8-block"):
        return Encoding("F32" if fp8 == "f32" else "BF16", k, f"FP8 decoded to {fp8.upper()}")
    raise NotRepresentable(f"{sw.module}: stored as {sw.encoding}: no GGML type")  # pragma: no cover


def module_bytes(reader: TensorReader, sw: StoredWeight, enc: Encoding, counts: blocks.Inexact,
                 rows: list[int] | None = None) -> np.ndarray:
    """One stored module as the rows of GGML blocks (or floats) of `enc`, rows reordered by `rows`."""
    t = dict(sw.tensors)
    if enc.qtype in ("Q4_0", "Q4_1", "Q8_0"):
        packed = reader.get(t[Tensor.PACKED])
        scale = reader.get(t[Tensor.SCALE]).float().numpy()
        n = packed.shape[0]
        r = slice(None) if rows is None else rows
        if enc.qtype == "Q8_0":
            q = unpack_ints(packed, enc.k, 8).numpy()
            return blocks.q8_0(q[r], scale[r], counts)
        if enc.qtype == "Q4_0":
            return blocks.q4_0_packed(packed.numpy()[r], enc.k, scale[r], counts)
        u = blocks.int4_nibbles(packed.numpy(), enc.k)
        z = unpack_zero_point(reader.get(t[Tensor.ZERO_POINT]), n).numpy()
        return blocks.q4_1(u[r], scale[r], z[r], counts)
    if enc.qtype == "NVFP4":
        sc = reader.get(t[Tensor.SCALE]).view(torch.uint8).numpy()
        if ((sc & 0x80) | ((sc & 0x7F) == 0x7F)).any():
            raise NotRepresentable(f"{sw.module}: an NVFP4 group scale that is negative or NaN: GGML's UE4M3 is "
                                   "unsigned")
        codes = blocks.fp4_codes(reader.get(t[Tensor.PACKED]).numpy())
        return blocks.nvfp4(codes if rows is None else codes[rows], sc if rows is None else sc[rows])
    if enc.qtype == "MXFP4":
        e = reader.get(t[Tensor.SCALE]).view(torch.uint8).numpy()
        if (e == 255).any():
            raise NotRepresentable(f"{sw.module}: an E8M0 scale of 255 (NaN in MX): GGML's MXFP4 has no NaN")
        packed = reader.get(t[Tensor.PACKED]).numpy()
        return blocks.mxfp4_packed(packed if rows is None else packed[rows], e if rows is None else e[rows])
    w = reader.decode(sw, torch.float32 if enc.qtype == "F32" else torch.bfloat16)
    return _np(w if rows is None else w[rows])


# ---- the plan --------------------------------------------------------------------------------------------
def _dense_type(gguf, name: str, dtype: torch.dtype, ndim: int):
    Q = gguf.GGMLQuantizationType
    if ndim <= 1 or name.endswith("norm.weight") or not name.endswith(".weight") or any(f in name for f in F32_NAMES):
        return Q.F32
    return _ggml_of(dtype, gguf) or Q.F32


def _cast(t: torch.Tensor, qtype, gguf) -> np.ndarray:
    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return t.float().numpy()
    if qtype == Q.F16:
        return t.to(torch.float16).numpy()
    return _np(t.to(torch.bfloat16))


def _ggml_of(dtype: torch.dtype, gguf):
    """The GGML type that holds a torch float dtype's bytes as they are, or None."""
    Q = gguf.GGMLQuantizationType
    return {torch.bfloat16: Q.BF16, torch.float16: Q.F16, torch.float32: Q.F32}.get(dtype)


def _same_type(dtype: torch.dtype, qtype, gguf) -> bool:
    return _ggml_of(dtype, gguf) == qtype


def _bytes_per_row(gguf, qtype, k: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return k // block * size


def _text_config(config: dict, spec):
    """The transformers config object llama.cpp's hyper-parameters are read from; its config class refusing
    config.json (a token id of NaN, a value of the wrong type) is one line naming config.json."""
    from ..hf import build_config

    try:
        return build_config(config)
    except Exception as e:  # the config class's own validation: TypeError, ValueError, its strict-dataclass errors
        why = " ".join(str(e).split())[:200] or type(e).__name__
        raise ExportError(f"config.json: transformers' {spec.model_type} config class refuses it: {why}",
                          hint="config.json was edited or is corrupt; restore the checkpoint's own") from None


def check_layout(spec, ck: Checkpoint, stored: dict[str, StoredWeight], weights: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the config implies (arch.layout.enumerate_tensors: attention and MLA projections and norms,
    dense and MoE layers, shared experts, embeddings and head) present in the checkpoint with that shape, and no
    weight or bias in the text model that the config does not imply: a config.json whose sizes, ranks, head counts,
    dense-layer count or shared experts disagree with the tensors would write GGUF keys that describe another
    model. `weights`: each stored (quantized) module's logical [out, in]. MTP layers are checked when the
    checkpoint holds them (transformers' save_pretrained drops them); their extras are not exported anyway."""
    p, L = spec.prefix, spec.num_layers
    owned = {t for sw in stored.values() for _, t in sw.tensors}
    have: dict[str, tuple[int, ...]] = {n: tuple(ck.info(n).shape) for n in ck.location
                                        if n not in owned and n.startswith(p)}
    have.update({Tensor.WEIGHT.of(m): tuple(nk) for m, nk in weights.items() if m.startswith(p)})
    if any(fused_experts(n, shape) for n, shape in have.items()):
        return  # experts stored fused: build_plan refuses them by name
    held = {layer_index(n) for n in have}
    expected = {n: tuple(shape) for n, (shape, _) in enumerate_tensors(spec, mtp=True).items()}
    for name in sorted(expected, key=_order):
        li = layer_index(name)
        if li is not None and li >= L and li not in held:
            continue
        want, got = expected[name], have.get(name)
        if got is None:
            raise ConfigMismatch(f"config.json implies {name} {list(want)}, which the checkpoint does not hold")
        if got != want:
            raise ConfigMismatch(f"config.json contradicts {name}: the checkpoint holds {list(got)}, the config "
                                 f"implies {list(want)}")
    for name in sorted(have, key=_order):
        li = layer_index(name)
        if name in expected or name.rpartition(".")[2] not in (Tensor.WEIGHT, "bias") or (li is not None and li >= L):
            continue
        raise ConfigMismatch(f"{name} {list(have[name])}: config.json implies no such tensor")


@dataclass(frozen=True)
class _Planning:
    """What making the plan's items reads: the checkpoint's tensors, its parsed config (arch.ModelSpec), gguf-py,
    the options, and the plan the items go into."""

    reader: TensorReader
    spec: object
    gguf: object
    options: ExportOptions
    plan: Plan


def build_plan(ck: Checkpoint, reader: TensorReader, options: ExportOptions) -> tuple[Plan, object, object]:
    """(the plan, the parsed config, transformers' config object) from the headers alone: config.json held
    against the tensors (`_checked`), every tensor sorted into routed-expert stacks and single tensors
    (`_sort_tensors`), then each made one GGUF item or more. What llama.cpp cannot represent is refused here."""
    gguf = _gguf()
    spec, stored, cfg = _checked(ck)
    ctx = _Planning(reader, spec, gguf, options, Plan(arch=spec.arch))
    experts, singles = _sort_tensors(ctx, ck, stored)
    # routed experts: one [E, N, K] tensor per layer and projection, of one type
    for (li, role), by_e in sorted(experts.items()):
        _expert_items(ctx, li, role, by_e)
    # everything else
    tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, GGUF_ARCH[spec.arch]), spec.num_layers)
    for m, s in sorted(singles, key=lambda x: _order(x[0])):
        _single_items(ctx, tmap, m, s)
    return ctx.plan, spec, cfg


def _checked(ck: Checkpoint):
    """(spec, stored modules, transformers' config object): config.json held against every tensor's header shape
    before anything is built from it (as convert does), the stored modules against their schemes, and the model
    against what llama.cpp computes as transformers does."""
    config = ck.config
    spec = validate_config(config, {n: tuple(ck.info(n).shape) for n in ck.location}) or parse_config(config)
    if spec.arch not in GGUF_ARCH:
        raise NotRepresentable(f"model_type {spec.model_type}: not exported to GGUF (exported: qwen3_moe, mixtral, "
                               "deepseek_v3 / kimi_k2 / kimi_k25, glm4_moe, glm_moe_dsa)")
    fmt = detect_format(config)
    stored = scan(ck, fmt)
    logical = validate(ck, stored)  # every quantized module against its scheme -> its logical [out, in]
    weights = {m: tuple(logical.get(m, sw.shape)) for m, sw in stored.items()}
    check_expert_shapes(spec, {Tensor.WEIGHT.of(m): nk for m, nk in weights.items()})
    check_layout(spec, ck, stored, weights)
    cfg = _text_config(config, spec)
    why = refusals(spec.arch, cfg, spec)
    if why:
        raise NotRepresentable(f"llama.cpp would compute this model differently from transformers: {why[0]}")
    return spec, stored, cfg


def _sort_tensors(ctx: _Planning, ck: Checkpoint, stored: dict[str, StoredWeight]):
    """(routed experts: (layer, role) -> expert -> (module, source), singles: [(module or tensor name, source)]);
    a source is a StoredWeight or a checkpoint tensor name. A stored module's companions travel with it; tensors
    outside the text model and MTP layers are counted in `plan.dropped`; fused experts are refused."""
    plan, prefix, L = ctx.plan, ctx.spec.prefix, ctx.spec.num_layers
    owner = {src: m for m, sw in stored.items() for _, src in sw.tensors}
    dense: dict[str, str] = {}  # text-model tensor name -> checkpoint tensor name
    for name in sorted(ck.location):
        if name in owner:
            continue
        if prefix and not name.startswith(prefix):
            plan.dropped[NOT_TEXT] += 1
            continue
        dense[name[len(prefix):]] = name
    modules: dict[str, StoredWeight] = {m[len(prefix):]: sw for m, sw in stored.items()
                                        if not prefix or m.startswith(prefix)}
    if prefix and len(modules) != len(stored):
        plan.dropped[NOT_TEXT] += len(stored) - len(modules)

    def mtp(name: str) -> bool:
        li = layer_index(name)
        return li is not None and li >= L

    experts: dict[tuple[int, str], dict[int, tuple[str, object]]] = {}
    singles: list[tuple[str, object]] = []  # (module or tensor name, StoredWeight | checkpoint tensor name)
    for m, sw in modules.items():
        if mtp(m):
            plan.dropped[MTP] += 1
            continue
        ex = _expert(m)
        if ex:
            experts.setdefault(ex[:2], {})[ex[2]] = (m, sw)
        else:
            singles.append((m, sw))
    for t, src in dense.items():
        if mtp(t):
            plan.dropped[MTP] += 1
            continue
        if t.endswith("rotary_emb.inv_freq"):
            continue
        if fused_experts(t, tuple(ctx.reader.info(src).shape)):
            raise NotRepresentable(f"{t}: experts stored fused; export reads per-expert tensors (as quantkit writes)")
        m, _, suffix = t.rpartition(".")
        ex = _expert(m)
        if ex and suffix == Tensor.WEIGHT:
            experts.setdefault(ex[:2], {})[ex[2]] = (m, src)
        elif ex:
            raise NotRepresentable(f"{t}: a routed expert's {suffix}: llama.cpp's experts take weights only")
        else:
            singles.append((t, src))
    return experts, singles


def _expert_items(ctx: _Planning, li: int, role: str, by_e: dict[int, tuple[str, object]]) -> None:
    """Layer `li`'s `role` projection of every routed expert as one [E, N, K] GGUF tensor of one type (and, for
    NVFP4, the experts' global scales as its `.scale` tensor), converted one expert at a time."""
    reader, spec, gguf, plan = ctx.reader, ctx.spec, ctx.gguf, ctx.plan
    Q, counts = gguf.GGMLQuantizationType, plan.counts
    nvfp4_why = None if spec.arch in NVFP4_EXPERT_ARCHS else (
        f"GGML's NVFP4 keeps the global scale in a separate .scale tensor, which llama.cpp 0.3.36's "
        f"{GGUF_ARCH[spec.arch].lower()} graph does not apply (only {', '.join(NVFP4_EXPERT_ARCHS)}'s does)")
    E = spec.num_experts
    if sorted(by_e) != list(range(E)):
        raise ExportError(f"layer {li} {role}: experts {sorted(by_e)[:8]}... present, config says {E}")
    encs = []
    for e in range(E):
        m, s = by_e[e]
        if isinstance(s, StoredWeight):
            encs.append((encoding_of(s, reader, ctx.options.fp8, nvfp4_why), tuple(s.shape)))
        else:
            info = reader.info(s)
            qt = _dense_type(gguf, "x.weight", info.dtype, 2)
            encs.append((Encoding(qt.name, info.shape[1], str(info.dtype).replace("torch.", "")),
                         tuple(info.shape)))
    kinds = {(en.qtype, en.k, shp[0]) for en, shp in encs}
    if len(kinds) != 1:
        raise NotRepresentable(f"layer {li} {role}: the experts differ in type or shape ({sorted(kinds)[:3]}): GGUF "
                               "stores a layer's experts as one tensor of one type")
    en0, (n0, _) = encs[0]
    qtype = getattr(Q, en0.qtype)
    per = n0 * _bytes_per_row(gguf, qtype, en0.k)
    name = f"blk.{li}.ffn_{role}_exps.weight"
    label = f"{en0.qtype} <- {en0.label}"
    plan.experts[label] = plan.experts.get(label, 0) + 1

    def one(e):
        m, s = by_e[e]
        if isinstance(s, StoredWeight):
            return module_bytes(reader, s, encs[e][0], counts)
        if _same_type(reader.info(s).dtype, qtype, gguf):
            return Copy(s)
        return _cast(reader.get(s), qtype, gguf)

    def chunks():
        yield from _ahead(one, len(by_e))

    plan.items.append(Item(name, qtype, (E, n0, en0.k), E * per, chunks, label))
    if en0.qtype == "NVFP4":  # each expert's global scale: llama.cpp multiplies the expert's output by it
        def scales():
            g = [reader.get(dict(by_e[e][1].tensors)[Tensor.GLOBAL_SCALE]).float().reshape(-1) for e in range(E)]
            inv = 1.0 / torch.cat(g)  # compressed-tensors divides by the global scale; llama.cpp multiplies
            if not bool(torch.isfinite(inv).all()) or not bool((inv > 0).all()):
                raise NotRepresentable(f"layer {li} {role}: an NVFP4 global scale that is not finite and positive")
            yield inv.numpy()

        plan.items.append(Item(f"blk.{li}.ffn_{role}_exps.scale", Q.F32, (E,), 4 * E, scales,
                               "F32 <- 1 / weight_global_scale"))


def _single_items(ctx: _Planning, tmap, m: str, s) -> None:
    """One module or tensor outside the routed experts under its llama.cpp name: Mixtral's q/k rows permuted as
    llama.cpp's RoPE reads them, MLA's kv_b split (`_kv_b_items`), a stored module encoded (`_stored_item`), a
    dense tensor copied or cast (`_dense_item`)."""
    reader, spec = ctx.reader, ctx.spec
    is_stored = isinstance(s, StoredWeight)
    tname = f"{m}.weight" if is_stored else m
    if tname.endswith("." + ROUTER_BIAS):
        gname = f"blk.{layer_index(tname)}.exp_probs_b.bias"
    else:
        gname = tmap.get_name(tname, try_suffixes=(".weight", ".bias"))
    if gname is None:
        raise NotRepresentable(f"{spec.prefix}{tname}: no llama.cpp tensor for it in {GGUF_ARCH[spec.arch].lower()}")
    rows = None
    proj = tname.rsplit(".", 2)[-2:-1] if tname.count(".") >= 2 else []
    if spec.arch == "mixtral" and proj and proj[0] in (Q_PROJ, K_PROJ) and f".{ATTN}." in tname:
        n_out = s.shape[0] if is_stored else reader.info(s).shape[0]
        rows = mixtral_permute(n_out, spec.num_heads if proj[0] == Q_PROJ else spec.num_kv_heads)
    if proj == [KV_B] and tname.endswith(Tensor.WEIGHT.dotted):
        ctx.plan.items.extend(_kv_b_items(ctx, gname, s))
    elif is_stored:
        ctx.plan.items.append(_stored_item(ctx, gname, s, rows))
    else:
        ctx.plan.items.append(_dense_item(ctx, gname, s, rows))


def _stored_item(ctx: _Planning, gname: str, s: StoredWeight, rows) -> Item:
    """A stored (quantized) module as its GGML type (`encoding_of`), or decoded to F32 where llama.cpp needs it."""
    reader, counts = ctx.reader, ctx.plan.counts
    enc = encoding_of(s, reader, ctx.options.fp8, "llama.cpp 0.3.36 applies NVFP4's global scale to routed experts "
                                                  "only")
    if gname.endswith("norm.weight") or any(f in gname for f in F32_NAMES):
        enc = Encoding("F32", enc.k, f"{enc.label}, decoded to F32")
    qtype = getattr(ctx.gguf.GGMLQuantizationType, enc.qtype)
    n = s.shape[0]
    if enc.qtype == "F32" and s.encoding not in ("fp8", "fp8-block"):
        def chunks():
            w = reader.decode(s, torch.float32)
            yield (w if rows is None else w[rows]).numpy()
    else:
        def chunks():
            yield module_bytes(reader, s, enc, counts, rows)
    return Item(gname, qtype, (n, enc.k), n * _bytes_per_row(ctx.gguf, qtype, enc.k), chunks,
                f"{enc.qtype} <- {enc.label}")


def _dense_item(ctx: _Planning, gname: str, s: str, rows) -> Item:
    """A checkpoint tensor copied as it is (same type, rows in order) or cast to its GGML type."""
    reader, gguf = ctx.reader, ctx.gguf
    info = reader.info(s)
    qtype = _dense_type(gguf, gname, info.dtype, len(info.shape))
    shape = tuple(info.shape)
    nel = int(np.prod(shape)) if shape else 1

    def chunks():
        if rows is None and _same_type(info.dtype, qtype, gguf):
            yield Copy(s)
            return
        t = reader.get(s)
        yield _cast(t if rows is None else t[rows], qtype, gguf)

    return Item(gname, qtype, shape, nel * _bytes_per_row(gguf, qtype, 1), chunks,
                f"{qtype.name} <- {str(info.dtype).replace('torch.', '')}")


AHEAD = 2  # experts read and converted ahead of the one being written


def _ahead(make: Callable[[int], object], n: int) -> Iterator[object]:
    """make(0), ..., make(n - 1), each computed on a helper thread while the caller writes the ones before (reads,
    the kernel and writes all release the GIL): a stack's reading and converting overlap its writing."""
    if n <= 1:
        yield from (make(i) for i in range(n))
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="quantkit-export") as pool:
        pending = deque(pool.submit(make, i) for i in range(min(AHEAD, n)))
        nxt = len(pending)
        try:
            while pending:
                out = pending.popleft().result()
                if nxt < n:
                    pending.append(pool.submit(make, nxt))
                    nxt += 1
                yield out
        finally:
            for f in pending:
                f.cancel()


def _expert(module: str) -> tuple[int, str, int] | None:
    """(layer, "gate" | "up" | "down", expert) of a routed expert's projection, else None."""
    m = EXPERT_PROJ.match(module)
    li = layer_index(module + ".")
    if not m or li is None:
        return None
    return li, expert_role(m["proj"]), int(m["e"])


def _order(name: str) -> tuple:
    li = layer_index(name)
    return (-1 if li is None and "embed" in name else (li if li is not None else 1 << 30), name)


def _kv_b_items(ctx: _Planning, gname: str, s) -> list[Item]:
    """MLA's kv_b [H (nope + v), kv_lora] as llama.cpp's attn_k_b [H, kv_lora, nope] (transposed) and attn_v_b
    [H, v, kv_lora] (conversion/deepseek.py). A stored (quantized) kv_b is decoded to F32: a transpose does not
    keep GGML blocks."""
    reader, spec, gguf = ctx.reader, ctx.spec, ctx.gguf
    Q = gguf.GGMLQuantizationType
    H, nope, v, r = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    if isinstance(s, StoredWeight):
        qtype = Q.F32
        load = lambda: reader.decode(s, torch.float32)  # noqa: E731
        src = f"F32 <- {s.encoding} decoded"
    else:
        info = reader.info(s)
        qtype = _dense_type(gguf, "x.weight", info.dtype, 2)
        load = lambda: reader.get(s)  # noqa: E731
        src = f"{qtype.name} <- {str(info.dtype).replace('torch.', '')}"
    base = gname[: -len("attn_kv_b.weight")]

    def part(which):
        w = load().reshape(H, nope + v, r)
        k_b, v_b = w[:, :nope], w[:, nope:]
        yield _cast((k_b.transpose(1, 2) if which == "k" else v_b).contiguous(), qtype, gguf)

    es = _bytes_per_row(gguf, qtype, 1)
    return [Item(base + "attn_k_b.weight", qtype, (H, r, nope), H * r * nope * es, lambda: part("k"), src),
            Item(base + "attn_v_b.weight", qtype, (H, v, r), H * v * r * es, lambda: part("v"), src)]


# ---- writing ---------------------------------------------------------------------------------------------
WRITEBACK_BYTES = 32 << 20


def _copy_range(reader: TensorReader, name: str, fout) -> int:
    """Tensor `name`'s bytes from its shard to `fout` at its position, in the kernel (as cat copies)."""
    shard = reader.location[name]
    h = reader.header(shard)
    info = h.tensors[name]
    fout.flush()
    pos, done = fout.tell(), 0
    fd = reader._fd(shard)
    while done < info.nbytes:
        try:
            n = os.copy_file_range(fd, fout.fileno(), info.nbytes - done, h.data_start + info.begin + done, pos + done)
        except OSError:  # a file system without it: read and write
            n = os.pwrite(fout.fileno(), os.pread(fd, min(64 << 20, info.nbytes - done),
                                                  h.data_start + info.begin + done), pos + done)
        if n <= 0:
            raise ExportError(f"{name}: short copy at byte {done}: the shard changed on disk")
        done += n
    fout.seek(pos + done)
    return done


def _write_item(w, item: Item, reader: TensorReader) -> int:
    """The next tensor of GGUFWriter `w`, from the item's chunks (gguf's write_tensor_data, a chunk at a time)."""
    from gguf.gguf_writer import WriterState

    fid = next(i for i, t in enumerate(w.tensors) if t)
    fout = w.fout[fid]
    name = next(iter(w.tensors[fid]))
    if name != item.name:  # pragma: no cover - the plan's order is the writer's
        raise ExportError(f"internal: writing {item.name} where {name} is next")
    ti = w.tensors[fid].pop(name)
    w.write_padding(fout, fout.tell())
    n = 0
    for c in item.chunks():
        if isinstance(c, Copy):
            n += _copy_range(reader, c.tensor, fout)
            continue
        c = np.ascontiguousarray(c)
        fout.write(memoryview(c).cast("B"))
        n += c.nbytes
    if n != ti.nbytes:
        raise ExportError(f"internal: {item.name} produced {n} bytes, planned {ti.nbytes}")
    w.write_padding(fout, n)
    w.state = WriterState.WEIGHTS
    if n >= WRITEBACK_BYTES:  # start writing this tensor back now (not waiting), so the final fsync has little left
        fout.flush()
        os.posix_fadvise(fout.fileno(), fout.tell() - n, n, os.POSIX_FADV_DONTNEED)
    return n


def manifest_sha256(root: Path) -> str | None:
    """sha256 of the checkpoint's quantkit manifest (`quantkit.manifest_sha256`), None when it has none (a release).
    Read as verify reads it (pack/manifest.py's size cap, a regular file, a JSON object) and hashed only when it is
    one verify accepts (a finished conversion listing its shards): ExportError otherwise."""
    import hashlib

    path = root / MANIFEST_NAME
    if not os.path.lexists(path):
        return None
    hint = "quantkit verify QMODEL checks the checkpoint; a checkpoint without a quantkit manifest exports as a release"
    check_regular(path, MANIFEST_NAME, ExportError, MAX_MANIFEST_BYTES, hint)  # no FIFO, device or oversize file
    with open(path, "rb") as f:  # a manifest is a JSON object: a file that does not open one is refused unread
        head = f.read(4096).lstrip(b" \t\r\n")
    if head[:1] != b"{":
        raise ExportError(f"{MANIFEST_NAME} does not hold a JSON object", hint=hint)
    data = read_bytes(path, MANIFEST_NAME, ExportError, MAX_MANIFEST_BYTES, hint)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ExportError(f"{MANIFEST_NAME} is not UTF-8 text ({e.reason} at byte {e.start})", hint=hint) from None
    doc = parse_json(text, MANIFEST_NAME, ExportError, hint)
    if not isinstance(doc, dict):
        raise ExportError(f"{MANIFEST_NAME} must hold a JSON object, got {type(doc).__name__}", hint=hint)
    if doc.get("status") != "complete":
        raise ExportError(f"{MANIFEST_NAME}: status is {str(doc.get('status'))[:40]!r}, not 'complete': the "
                          "conversion did not finish", hint=hint)
    if not isinstance(doc.get("shards"), list) or not doc["shards"]:
        raise ExportError(f"{MANIFEST_NAME} lists no shards", hint=hint)
    return hashlib.sha256(data).hexdigest()


def export(qmodel, out, options: ExportOptions = ExportOptions(), say: Callable[[str], None] = lambda s: None) -> dict:
    """Write `out` (a .gguf path; with a split size, `out`'s stem + -0000N-of-0000M.gguf). Returns the report."""
    gguf = _gguf()
    import psutil

    t0 = time.perf_counter()
    qmodel, out = Path(qmodel), Path(out)
    if out.suffix != ".gguf":
        raise ExportError(f"{out}: the output is a file name ending in .gguf", hint="e.g. quantkit export ./q ./model.gguf")
    if options.fp8 not in ("bf16", "f32"):
        raise ExportError(f"--fp8 {options.fp8!r}: bf16 or f32")
    if type(options.split_max_size) is not int or options.split_max_size < 0:
        raise ExportError(f"split_max_size must be a byte count >= 0, got {options.split_max_size!r}")
    ck = Checkpoint.open(qmodel)
    manifest_sha = manifest_sha256(qmodel)
    # positioned reads: each tensor read once into fresh memory (no mapping grows the resident set past a tensor)
    reader = TensorReader.of(ck, mapped=False)
    try:
        plan, spec, cfg = build_plan(ck, reader, options)
        arch_name = gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, GGUF_ARCH[spec.arch])]
        tmp = out.parent / f".{out.name}.partial"
        w = gguf.GGUFWriter(tmp / out.name, arch=arch_name, split_max_size=options.split_max_size)
        w.add_name(qmodel.resolve().name)
        w.add_type("model")
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        vocab_rows = next(i.shape[0] for i in plan.items if i.name == "token_embd.weight")
        hp = write_hparams(w, spec.arch, cfg, spec, vocab_rows)
        voc = write_vocab(w, qmodel, vocab_rows, cfg, options.pre_tokenizer)
        w.add_string("quantkit.source", qmodel.resolve().name)
        w.add_string("quantkit.expert_types", "; ".join(f"{k} x{v}" for k, v in sorted(plan.experts.items()))
                     or "none")
        if manifest_sha is not None:
            w.add_string("quantkit.manifest_sha256", manifest_sha)
        for it in plan.items:
            w.add_tensor_info(it.name, it.shape, np.dtype(np.float32), it.nbytes, raw_dtype=it.qtype)
        names = w.format_shard_names(tmp / out.name)
        if not options.overwrite:
            for p in names:
                if (out.parent / p.name).exists():
                    raise OutputExists(f"{out.parent / p.name} exists", hint="pass --overwrite to replace it")
        out.parent.mkdir(parents=True, exist_ok=True)  # nothing is written before the metadata is whole
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        w.write_header_to_file(path=tmp / out.name)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total, peak = 0, 0
        proc = psutil.Process()
        for i, it in enumerate(plan.items):
            total += _write_item(w, it, reader)
            if i % 16 == 0 or "_exps" in it.name:
                peak = max(peak, proc.memory_info().rss)
                say(f"{i + 1}/{len(plan.items)} {it.name} ({it.qtype.name})")
        w.close()
        for p in names:
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        files = []
        for p in names:
            os.replace(p, out.parent / p.name)
            files.append(str(out.parent / p.name))
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        tmp_dir = out.parent / f".{out.name}.partial"
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    finally:
        reader.release()
    peak = max(peak, proc.memory_info().rss)
    types: dict[str, int] = {}
    for it in plan.items:
        types[it.qtype.name] = types.get(it.qtype.name, 0) + it.nbytes
    notes = [W4A8_NOTE] if any(k in types for k in ("Q4_0", "Q4_1", "MXFP4", "Q8_0")) else []
    betas = yarn_betas(cfg)
    if betas:
        notes.append(f"YaRN beta_fast {betas[0]:g} / beta_slow {betas[1]:g}: llama.cpp reads no beta from the GGUF and "
                     "uses 32 / 1; run it with --yarn-beta-fast / --yarn-beta-slow (verify --engine llama.cpp does)")
    eps = float(getattr(cfg, "rms_norm_eps", 1e-6) or 1e-6)
    if spec.arch == "glm_moe_dsa" and eps != 1e-6:
        notes.append(f"GLM-5's q_a / kv_a latent norms use eps 1e-6 in transformers; llama.cpp's glm-dsa uses "
                     f"rms_norm_eps ({eps:g}) for them, and eps 0 for the indexer's key norm")
    if voc["tokenizer"].startswith("placeholder"):
        notes.append("no BPE tokenizer: placeholder tokens; feed token ids (text is not tokenized as transformers "
                     "would)")
    elif voc["pre_tokenizer"] == "default":
        notes.append("pre-tokenizer 'default': text splits as llama.cpp's default regex; name the model's with "
                     "--pre-tokenizer (e.g. qwen2, deepseek-v3, glm4, kimi-k2) for text prompts")
    return {"output": files, "architecture": arch_name, "seconds": round(time.perf_counter() - t0, 3),
            "bytes_written": sum(os.path.getsize(f) for f in files), "tensor_bytes": total,
            "tensors": len(plan.items), "bytes_by_type": types, "expert_types": plan.experts,
            "scales": plan.counts.to_json(), "dropped": dict(plan.dropped), "hparams": hp, "vocab": voc,
            "yarn_betas": list(betas) if betas else None, "notes": notes, "peak_rss_bytes": peak}
