"""FP8 W8A8 as the engines run compressed-tensors `float-quantized` checkpoints, emulated in torch: the e4m3
weight times its scale (per tensor, channel or 128x128 block), and the input quantized to e4m3 on the fly
(dynamic: per token, or per 1 x 128 group for block weights, as the block-FP8 releases and vLLM's
W8A8 block kernel do). Also the routed experts the runner runs unpacked: FP8 (the prefill half of a
prefill/decode pair), BF16 (an unquantized source, the pair's reference), and W4AFP8 (runtime/w4afp8.py).

Numerics: sum_g (xq_g . wq_g) * a_g * s_g equals (xq * a) . (wq * s) exactly in real arithmetic, so the
emulation dequantizes both operands and multiplies in fp32; only the accumulation order differs from a
tensor-core kernel. Not here: an FP8 GEMM kernel (the runner uses this for quality, not speed).

Legend: T = tokens, D = hidden, E = experts, I = expert intermediate, k = experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..quant.fp8 import FP8_MAX
from .w4afp8 import MIN_SCALE, W4AFP8Weight, w4afp8_moe_ref

__all__ = ["quant_act", "FP8Weight", "fp8_linear", "DenseExperts", "W4AFP8Experts", "dense_moe"]


def quant_act(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x [..., K] -> fp32 [..., K]: x through dynamic FP8 e4m3, per token (group None) or per 1 x group
    (K a multiple of group), scale amax / 448 as vLLM computes it, then back to real values."""
    xf = x.float()
    k = xf.shape[-1]
    g = xf.reshape(*xf.shape[:-1], k // group, group) if group else xf.unsqueeze(-2)  # [..., G, g]
    a = (g.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (g / a).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * a).reshape(xf.shape)


@dataclass(frozen=True)
class FP8Weight:
    """One FP8 weight as the runner holds it: `w` fp32 [N, K] = e4m3 codes times their scales (exact), and
    how the engine quantizes the input: `act_group` None per token, or a group size (block weights: 128)."""

    w: torch.Tensor
    act_group: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)


def fp8_linear(x: torch.Tensor, w: FP8Weight) -> torch.Tensor:
    """y = FP8(x) @ W^T in fp32, cast to x.dtype. x [..., K] -> [..., N]."""
    return F.linear(quant_act(x, w.act_group), w.w).to(x.dtype)


@dataclass(frozen=True)
class DenseExperts:
    """Routed experts held unpacked, one [E, N, K] stack per projection (gate, up [E, I, D]; down [E, D, I]).
    `fp8`: the stacks are FP8 weights (codes x scales, fp32) and every expert GEMM quantizes its input
    dynamically (per token, or per `act_group` channels); otherwise plain weights in the compute dtype."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    fp8: bool = False
    act_group: int | None = None


@dataclass(frozen=True)
class W4AFP8Experts:
    """Routed experts as vLLM's W4A8 MoE kernel runs them: gate_up [E, 2I, D] and down [E, D, I]."""

    gate_up: W4AFP8Weight
    down: W4AFP8Weight


def dense_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              experts: DenseExperts | W4AFP8Experts) -> torch.Tensor:
    """x [T, D], topk_ids / topk_weights [T, k] -> [T, D] in x.dtype: SiLU(x gate^T) * (x up^T), then down,
    times the router weight, slots summed in fp32 (as fused_moe_int4)."""
    if isinstance(experts, W4AFP8Experts):
        return w4afp8_moe_ref(x, topk_ids, topk_weights, experts.gate_up, experts.down, out_dtype=x.dtype)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ex = experts

    def mm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if ex.fp8:
            return F.linear(quant_act(h, ex.act_group), w).to(x.dtype)
        return F.linear(h, w)

    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = x[tok]  # [n_e, D]
        act = F.silu(mm(h, ex.gate[e])) * mm(h, ex.up[e])  # [n_e, I]
        y = mm(act, ex.down[e]).float()  # [n_e, D]
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)
