"""W4AFP8 as vLLM 0.33.0 serves it on Hopper: INT4 group-128 weights (compressed-tensors pack-quantized, bf16
group scales) against dynamic per-token FP8 activations. A torch reference and a Triton GEMM beside it, and
the routed-expert MLP in torch (what `verify` measures). Reads what `convert` writes; never the converter.

What the engine does (vLLM 0.33.0: fused_moe/oracle/w4a8.py `convert_to_w4a8_moe_kernel_format`,
quantization/utils/quant_utils.py `convert_bf16_scales_to_fp8`, input_quant_fp8.py `QuantFP8` per token;
the CUTLASS W4A8 grouped GEMM):

    load time, per output row n of a weight [N, K] with bf16 group scales s[n, g] (G = K / 128):
        c[n]     = max(max_g |s[n, g]| / 448, 1 / (448 * 512))          fp32 (QuantFP8, per-token shape)
        s8[n, g] = e4m3(e4m3(s[n, g] * (1 / c[n])) / 8)                 FP8 group scale
        chan[n]  = 8 * c[n]                                              fp32 per-channel scale
    the GEMM's weight operand: w[n, k] = e4m3(q[n, k] * s8[n, k // 128])  (CUTLASS looks the products up
        in a table of e4m3 values built from s8 by `cutlass_pack_scale_fp8`; |q * s8| <= 8 * 56 = 448)
    run time, per token m: a[m] = max(max_k |x[m, k]| / 448, 1 / (448 * 512)); xq = e4m3(x * (1 / a[m]))
    y[m, n] = (sum_k xq[m, k] * w[n, k]) * a[m] * chan[n]        (FP8 x FP8 products, fp32 accumulation)

Every e4m3 value here is held in fp32 (exactly): the products of two e4m3 values are exact in fp32, so the
reference's fp32 matmul and the kernel's fp32 (TF32 on a GPU: e4m3 fits its 10-bit mantissa) dot differ only
in summation order. Hopper's FP8 tensor cores accumulate with fewer bits than fp32 between CUTLASS's
promotions; that is not modelled.

Legend: M = tokens, N = out features, K = in features, G = K / 128 groups, E = experts, I = moe intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..pack.int4 import unpack_int4
from ..quant.fp8 import FP8_MAX
from ._triton import resolve_backend, tl, triton
from .int4 import PackedInt4

__all__ = ["W4AFP8Weight", "convert_scales", "quant_tokens", "fp8_round", "w4afp8_gemm", "w4afp8_gemm_ref",
           "w4afp8_moe_ref"]

MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's _FP8_MIN_SCALING_FACTOR
GROUP = 128


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp32 holding the nearest float8_e4m3fn value (ties to even), saturating at +-448."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def convert_scales(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 group scales [..., N, G] -> (s8 [..., N, G] e4m3 values in fp32, chan [..., N] fp32), as
    vLLM's convert_bf16_scales_to_fp8 (module docstring)."""
    s = scale.float()
    c = (s.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)  # [..., N, 1]
    s1 = fp8_round(s * c.reciprocal())
    return fp8_round(s1 / 8.0), (c * 8.0).squeeze(-1)


def quant_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (xq [..., K] e4m3 values in fp32, a [..., 1] fp32): dynamic per-token FP8."""
    xf = x.float()
    a = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return fp8_round(xf * a.reciprocal()), a


@dataclass(frozen=True)
class W4AFP8Weight:
    """One INT4 weight (2-D [N, K] or an expert stack [E, N, K]) in the form the W4A8 kernel runs it:
    the packed nibbles as written, FP8 group scales `s8` [E?, N, G] (fp32 holding e4m3) and `chan` [E?, N]."""

    packed: torch.Tensor  # int32 [E?, N, K/8], compressed-tensors' offset-8 nibbles
    s8: torch.Tensor
    chan: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_int4(cls, w: PackedInt4) -> "W4AFP8Weight":
        if w.zero_point is not None or w.group_size != GROUP:
            raise ValueError(f"W4AFP8 takes symmetric INT4 with group size {GROUP}, got group size {w.group_size}"
                             f"{', asymmetric' if w.zero_point is not None else ''}")
        s8, chan = convert_scales(w.scale)
        return cls(w.packed, s8, chan, w.shape)

    def effective(self) -> torch.Tensor:
        """fp32 [E?, N, K]: the e4m3 weight operand, e4m3(q * s8)."""
        n, k = self.shape
        q = unpack_int4(self.packed, k).float() if self.packed.ndim == 2 else torch.stack(
            [unpack_int4(p, k).float() for p in self.packed])
        s = self.s8.repeat_interleave(GROUP, dim=-1)[..., :k]
        return fp8_round(q * s)


def w4afp8_gemm_ref(x: torch.Tensor, w: W4AFP8Weight) -> torch.Tensor:
    """y = W4AFP8(x @ W^T) in fp32 math, cast to x.dtype. x [..., K], W 2-D [N, K] -> y [..., N]."""
    xq, a = quant_tokens(x)
    return ((xq @ w.effective().T) * a * w.chan).to(x.dtype)


def w4afp8_moe_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   gate_up: W4AFP8Weight, down: W4AFP8Weight, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The routed-expert MLP as vLLM's W4A8 MoE runs it: hidden [T, D] quantized per token once, GEMM 1
    (gate_up [E, 2I, D]) to `out_dtype`, SiLU(gate) * up in `out_dtype`, re-quantized per row, GEMM 2
    (down [E, D, I]), times the router weight, slots summed in fp32. -> [T, D] in hidden.dtype."""
    t, d = hidden.shape
    xq, a = quant_tokens(hidden)
    out = torch.zeros((t, d), dtype=torch.float32, device=hidden.device)
    wgu, wd = gate_up.effective(), down.effective()
    i = wgu.shape[-2] // 2
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = ((xq[tok] @ wgu[e].T) * a[tok] * gate_up.chan[e]).to(out_dtype)  # [n_e, 2I]
        act = (torch.nn.functional.silu(h[:, :i].float()) * h[:, i:].float()).to(out_dtype)
        aq, aa = quant_tokens(act)
        y = ((aq @ wd[e].T) * aa * down.chan[e]).to(out_dtype).float()  # [n_e, D]
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(hidden.dtype)


# --------------------------------------------------------------------------------------------------
# Triton: x (bf16/fp16/fp32) quantized per token in the prologue, INT4 tile -> e4m3(q * s8), fp32 dot,
# per-token x per-channel scales in the epilogue
# --------------------------------------------------------------------------------------------------
if triton is not None:
    from ._triton import cast_rne, round_to_e4m3
    from .int4 import dequant_int4_tile

    @triton.jit
    def _w4afp8_gemm_kernel(x_ptr, a_ptr, w_ptr, s_ptr, c_ptr, y_ptr, M, N, K,
                            stride_xm, stride_wn, stride_sn, stride_sg, stride_ym,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a = tl.load(a_ptr + offs_m, mask=offs_m < M, other=1.0)  # [BM] per-token scales
        inv_a = 1.0 / a
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
            xq = round_to_e4m3(x.to(tl.float32) * inv_a[:, None])  # [BM, BK] e4m3 values
            w = dequant_int4_tile(w_ptr, s_ptr, w_ptr, offs_n, k0, N, K, stride_wn, stride_sn, stride_sg,
                                  0, 0, 128, False, BLOCK_N, BLOCK_K, 1)  # [BK, BN] q * s8
            w = round_to_e4m3(w)
            w = tl.where(offs_k[:, None] < K, w, 0.0)
            acc = tl.dot(xq, w, acc)  # fp32 operands holding e4m3 values: exact in tf32 too
        c = tl.load(c_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc * a[:, None] * c[None, :]
        y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], cast_rne(acc, y_ptr.dtype.element_ty),
                 mask=y_mask)


def w4afp8_gemm(x: torch.Tensor, w: W4AFP8Weight, *, backend: str = "auto") -> torch.Tensor:
    """y = x @ W^T as W4AFP8 (module docstring). x [..., K] bf16/fp16/fp32, W 2-D [N, K] -> [..., N] in x.dtype.
    backend: "torch" (w4afp8_gemm_ref), "triton", or "auto"."""
    if w.packed.ndim != 2:
        raise ValueError("w4afp8_gemm takes a 2-D weight")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]}, weight has K={k}")
    if resolve_backend(backend, x.device) == "torch":
        return w4afp8_gemm_ref(x, w)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*lead, n))
    _, a = quant_tokens(x2)  # the per-token scales (a row reduction; the kernel quantizes with them)
    a = a.reshape(-1).contiguous()
    s8, chan = w.s8.contiguous(), w.chan.float().contiguous()
    bm, bn, bk = (min(32, max(16, 1 << (m - 1).bit_length())), 32, 128)
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _w4afp8_gemm_kernel[grid](x2, a, w.packed.contiguous(), s8, chan, y, m, n, k,
                              x2.stride(0), w.packed.stride(0), s8.stride(0), s8.stride(1), y.stride(0),
                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
                              num_stages=2 if x.device.type == "cuda" else 1)
    return y.reshape(*lead, n)

