"""One decoder layer's weights, as transformers 5 holds them in memory, read from the checkpoint's shards:
per-expert on-disk modules fused into the 3-D expert tensors, Mixtral's names mapped, and quantized
sources (block-FP8, pack-quantized INT4) decoded to floats through the one tensor reader. Also the heap
settings that keep a layer-by-layer pass's memory bounded."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re

import torch

from ..arch import arch_for, text_config
from ..arch.layout import EXPERTS, FUSED_DOWN, FUSED_GATE_UP, HF_BLOCK, LayerNames
from ..errors import UnsupportedWeights
from ..read.checkpoint import Checkpoint
from ..read.sources import detect_format, scan
from ..read.tensors import TensorReader
from ..pack.names import Tensor


def _expert_parts(names) -> dict[str, tuple[str, int]]:
    """Per-expert on-disk projection names -> (fused in-memory tensor, part). transformers 5 keeps
    experts.gate_up_proj [E, 2I, D] = cat(gate, up) and experts.down_proj [E, D, I] (conversion_mapping.py)."""
    return {names.gate: (FUSED_GATE_UP, 0), names.up: (FUSED_GATE_UP, 1), names.down: (FUSED_DOWN, 0)}


# Tensors a layer may carry on disk that are not module state (old rotary caches, static activation scales).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".input_scale", ".output_scale", ".k_scale", ".v_scale")


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
HEAP_MMAP_THRESHOLD = 1 << 20


def bound_heap() -> None:
    """Serve every allocation of 1 MiB or more with its own mapping, returned to the OS when freed.
    glibc otherwise raises its mmap threshold after each large free (up to 32 MiB), and the many
    1-32 MiB temporaries of a layer (weights, Gram products, factorizations) then fragment a heap
    that is never given back: measured on bench/gptq_rss.py, the peak RSS drops by ~200 MB."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)


# A search loop (AWQ's candidates) allocates and frees the same 1-32 MiB temporaries hundreds of times per
# layer: served as fresh mappings, each one faults its pages in again (on the bench MoE of bench/calib_cost.py,
# 2.5 million faults and ~19 s of system time in a 70 s AWQ conversion). glibc's largest mmap threshold.
SEARCH_MMAP_THRESHOLD = 32 << 20


@contextlib.contextmanager
def reuse_heap():
    """Within the block, serve allocations below 32 MiB from the heap, where freed blocks are reused
    instead of mapped and faulted in again; on exit back to `bound_heap`'s threshold. The freed memory stays
    in the heap until `release_memory` (called between layers) trims it."""
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, SEARCH_MMAP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)


def _libc():
    """glibc, for mallopt and malloc_trim; None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc's own functions)
        return libc
    except (OSError, AttributeError):  # not glibc
        return None


def release_memory() -> None:
    """Give freed memory back to the OS between layers (glibc keeps freed heap pages otherwise)."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def stored_modules(ckpt: Checkpoint) -> dict:
    """The modules the checkpoint stores quantized (read/sources.py), to be decoded to floats on load."""
    return scan(ckpt, detect_format(ckpt.config))


def _read_weight(r: TensorReader, stored: dict, base: str, device: torch.device | None = None) -> torch.Tensor:
    """The float weight of module `base`: as stored, or decoded from block-FP8 / pack-quantized INT4 / FP4
    (on `device` when given: the packed tensors are moved there and decoded there)."""
    sw = stored.get(base)
    if sw is not None:
        if any(suffix == Tensor.G_IDX for suffix, _ in sw.tensors):
            raise UnsupportedWeights(f"{base}: act-order (weight_g_idx) INT4 sources are not supported")
        return r.decode(sw, torch.float32, device=device)
    w = r.get(base + ".weight")
    if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise UnsupportedWeights(f"{base}.weight is {w.dtype} but has no weight_scale_inv / weight_scale")
    if not w.dtype.is_floating_point:
        raise UnsupportedWeights(f"{base}.weight has dtype {w.dtype}")
    return w


_COMPANIONS = (Tensor.RELEASE_SCALE.dotted, Tensor.SCALE.dotted, Tensor.SHAPE.dotted, Tensor.ZERO_POINT.dotted, Tensor.G_IDX.dotted,
               Tensor.PACKED.dotted, Tensor.GLOBAL_SCALE.dotted, Tensor.INPUT_GLOBAL_SCALE.dotted)  # the last two: NVFP4 (W4A4)


def load_layer_weights(ckpt: Checkpoint, layer_idx: int, *, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu", stored: dict | None = None) -> dict[str, torch.Tensor]:
    """The state dict of decoder layer `layer_idx` as transformers 5 holds it in memory, keyed relative to
    the layer (`self_attn.q_proj.weight`, `mlp.experts.gate_up_proj`, ...), in `dtype` on `device`.

    Maps the on-disk layout: per-expert `mlp.experts.E.{gate,up,down}_proj.weight` (Mixtral:
    `block_sparse_moe.experts.E.w1/w3/w2`) -> fused `mlp.experts.gate_up_proj` [E, 2I, D] (gate rows first)
    and `mlp.experts.down_proj` [E, D, I]; fused on-disk experts pass through. Quantized sources are
    dequantized here: block-FP8 (`weight` float8 + `weight_scale_inv`/`weight_scale`) and compressed-tensors
    pack-quantized INT4 (`weight_packed`, `weight_scale`, `weight_shape`[, `weight_zero_point`]).
    Reads only this layer's tensors; each expert is copied straight into its slice of the fused tensor.
    On an accelerator (`device` not the CPU) quantized sources are decoded there, from their packed tensors.
    A multimodal wrapper's text layers are read under its prefix (Kimi K2.5: `language_model.model.layers.L.`)."""
    names = arch_for(ckpt.config, "calibrate").experts
    stored = stored_modules(ckpt) if stored is None else stored
    prefix = LayerNames(text_config(ckpt.config)[1], layer_idx).layer + "."  # wrappers: language_model.model.layers.L.
    disk = {n for n in ckpt.location if n.startswith(prefix)}
    if not disk:
        raise UnsupportedWeights(f"the checkpoint holds no tensors for layer {layer_idx} ({prefix}*)")
    renames = ((f".{names.block}.", f".{HF_BLOCK}."),) if names is not None and names.block != HF_BLOCK else ()
    parts = _expert_parts(names) if names is not None else {}
    expert_rx = re.compile(rf"^{HF_BLOCK}\.{EXPERTS}\.(\d{{1,9}})\.(" + "|".join(parts or ["-"]) + r")$")

    # logical modules: relative in-memory module name -> on-disk base name
    modules: dict[str, str] = {}
    direct: dict[str, str] = {}  # relative tensor name -> on-disk tensor name (non-`.weight` tensors)
    for name in sorted(disk):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        rel = name[len(prefix):]
        for a, b in renames:
            rel = ("." + rel).replace(a, b)[1:]
        if name.endswith(".weight") or name.endswith(Tensor.PACKED.dotted):
            base = name.rsplit(".", 1)[0]
            modules[rel.rsplit(".", 1)[0]] = base
        elif not name.endswith(_COMPANIONS):  # companions (scales, shapes) are read with their weight
            direct[rel] = name
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, int], dict[int, str]] = {}  # (fused name, part) -> {expert: disk base}
    dev = torch.device(device)
    decode_on = dev if dev.type != "cpu" else None  # the CPU decodes as it always has
    r = TensorReader.of(ckpt, mapped=False)
    try:
        for rel, base in modules.items():
            m = expert_rx.match(rel)
            if m:
                experts.setdefault(parts[m.group(2)], {})[int(m.group(1))] = base
                continue
            out[rel + ".weight"] = _read_weight(r, stored, base, decode_on).to(device=device, dtype=dtype)
        for rel, name in direct.items():
            t = r.get(name)
            out[rel] = t.to(device=device, dtype=dtype if t.dtype.is_floating_point else t.dtype)
        for fused in sorted({f for f, _ in experts}):
            want_parts = (0, 1) if fused == FUSED_GATE_UP else (0,)
            part_maps = [experts.get((fused, p), {}) for p in want_parts]  # gate, up (or down)
            n_exp = max(len(pm) for pm in part_maps)
            for pm in part_maps:
                if sorted(pm) != list(range(n_exp)):
                    raise UnsupportedWeights(f"layer {layer_idx}: routed experts for {fused} are incomplete on disk "
                                             f"(found {len(pm)} of {n_exp} experts for one of its parts)")
            dst = None
            for e in range(n_exp):
                ws = [_read_weight(r, stored, pm[e], decode_on) for pm in part_maps]  # [I, D] each (down: [D, I])
                if dst is None:
                    dst = torch.empty((n_exp, sum(w.shape[0] for w in ws), ws[0].shape[1]), dtype=dtype,
                                      device=device)  # [E, 2I, D] = cat(gate, up) / [E, D, I]
                r0 = 0
                for w in ws:
                    dst[e, r0:r0 + w.shape[0]].copy_(w)
                    r0 += w.shape[0]
            out[f"{HF_BLOCK}.{EXPERTS}.{fused}"] = dst
    finally:
        r.close()
    return out
