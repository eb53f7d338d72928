"""NVFP4 activations (W4A4): the static input global scale convert calibrates, and the dynamic per-16 block
quantization engines apply to a Linear's input when they run it (pure math, no packing).

compressed-tensors' NVFP4 preset quantizes input activations with strategy tensor_group, group 16, `dynamic:
local`: the FP8 block scales are computed on the fly from each 16-value block, under one static float32 global
scale per module, stored as `input_global_scale`:

    input_global_scale = 448 * 6 / amax          amax = the largest |x| the module's input reached in calibration
                                                 (compressed-tensors' generate_gparam: FP8_MAX * FP4_MAX / amax)

and at run time, per block b of 16 values of one row (vLLM 0.33.0 nvfp4_emulation_utils.ref_nvfp4_quant, the same
arithmetic as its CUDA `scaled_fp4_quant`):

    s_b   = e4m3(min(gs * (max|x_b| * (1/6)), 448))          the block's FP8 scale (round to nearest, saturated)
    q     = e2m1(clamp(x * (1 / (s_b * (1 / gs))), -6, 6))   round to nearest, ties to even
    x_hat = q * (s_b / gs)

An input larger than the calibrated amax saturates its block scale at 448 and its values at +-6: the global
scale bounds the range, the block scales the resolution. The global scale is float32 and must be finite and
positive: vLLM divides by it (1 / input_global_scale) and, on its FlashInfer backends, takes one maximum of
those reciprocals over all experts of a layer, so a single NaN, Inf or zero spoils every expert of the layer.
"""

from __future__ import annotations

import torch

from .fp4 import encode_e2m1, decode_e2m1
from .fp8 import FP8_MAX

FP4_MAX = 6.0
ACT_GROUP_SIZE = 16
_FP4_MAX_RECIPROCAL = 1.0 / FP4_MAX  # vLLM multiplies by this float32 constant rather than dividing by 6
# the smallest amax whose global scale 448 * 6 / amax is a finite float32
MIN_AMAX = FP8_MAX * FP4_MAX / float(torch.finfo(torch.float32).max) * 2

# where an expert's input scale came from (manifest: input_scale.source)
CALIBRATED = "calibrated"
LAYER_MAX = "layer_max"


def input_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax [...] float (finite, positive) -> float32 [...] = 448 * 6 / amax, computed in float32 as
    compressed-tensors' generate_gparam does. Raises ValueError on a NaN, Inf, zero or negative amax: the
    caller decides what an uncalibrated module gets (`expert_input_scales`), never this function."""
    a = amax.detach().float()
    if not bool(torch.isfinite(a).all()) or bool((a <= 0).any()):
        raise ValueError(f"an input amax must be finite and positive, got {a.reshape(-1)[:4].tolist()}")
    gs = (FP8_MAX * FP4_MAX) / a.clamp(min=MIN_AMAX)
    return gs


def expert_input_scales(amax: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Per-expert input global scales of one MoE layer's projection (gate/up share one input, down has its
    own). amax [E] (the largest |input| over the tokens routed to each expert), tokens [E] (how many).

    Returns (scales float32 [E], the amax each scale was computed from [E], source per expert): an expert that
    no calibration token reached (or whose inputs were all zero) gets the layer's largest amax, source
    LAYER_MAX: the coarsest scale any calibrated expert of the layer has, so none of its inputs the layer has
    seen would saturate, and on the backends that share one scale over the layer (the maximum of 1 / scale)
    nothing changes. Raises ValueError when an amax is NaN or Inf, or no expert of the layer saw a token."""
    a = amax.detach().float().reshape(-1)
    n = tokens.detach().reshape(-1).to(torch.int64)
    if a.shape != n.shape:
        raise ValueError(f"amax {list(a.shape)} and tokens {list(n.shape)} differ")
    if not bool(torch.isfinite(a).all()):
        raise ValueError("an expert's input amax is NaN or Inf: the calibration activations are not finite")
    seen = (n > 0) & (a > 0)
    if not bool(seen.any()):
        raise ValueError("no calibration token reached any expert of the layer (or every input was zero)")
    top = a[seen].max()
    used = torch.where(seen, a, top)
    sources = [CALIBRATED if s else LAYER_MAX for s in seen.tolist()]
    return input_global_scale(used), used, sources


def block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 16), global scale float32 (one element, or [..., 1]: one per row) ->
    the FP8 e4m3 block scales [..., K/16] as float32 values, as the engine computes them."""
    xb = x.float().unflatten(-1, (-1, ACT_GROUP_SIZE))  # [..., G, 16]
    vec_max = xb.abs().amax(-1)  # [..., G]
    s = global_scale.float() * (vec_max * _FP4_MAX_RECIPROCAL)  # a [..., 1] global scale broadcasts per row
    return s.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1 / x, with 1 / 0 = 1e-8 (vLLM's get_reciprocal: a zero block scale quantizes its block to zeros)."""
    return 1.0 / (x + (x == 0) * 1e8)


def quantize_act_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (E2M1 codes uint8 [..., K], FP8 block scales [..., K/16] as float32 values): the engine's
    dynamic NVFP4 quantization of an activation under its static `global_scale` (module docstring)."""
    if x.shape[-1] % ACT_GROUP_SIZE:
        raise ValueError(f"NVFP4 activations need a multiple of {ACT_GROUP_SIZE} features, got {x.shape[-1]}")
    if global_scale.dtype != torch.float32:
        raise TypeError(f"an input global scale is float32, got {global_scale.dtype}")
    s = block_scales(x, global_scale)  # [..., G]
    out_scale = _reciprocal(s * _reciprocal(global_scale))  # [..., G]
    scaled = x.float().unflatten(-1, (-1, ACT_GROUP_SIZE)) * out_scale.unsqueeze(-1)
    codes = encode_e2m1(scaled.clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return codes, s


def fake_quantize_act_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> x as the engine's FP4 tensor cores see it, [..., K] in x.dtype: codes * (s_b / gs),
    float32 products rounded once to x.dtype (vLLM's ref_nvfp4_quant_dequant). `global_scale`: one element, or
    [..., 1] (a scale per row, e.g. the expert each routed token goes to)."""
    codes, s = quantize_act_nvfp4(x, global_scale)
    v = decode_e2m1(codes).unflatten(-1, (-1, ACT_GROUP_SIZE)) * (s / global_scale).unsqueeze(-1)
    return v.flatten(-2).to(x.dtype)
