"""INT4 weights in the compressed-tensors `pack-quantized` layout: unpack / dequantize in torch, and a
W4A16 group-wise GEMM (y = x @ W^T) as a Triton kernel beside its torch reference.

This is the runtime's reader of what `quantkit convert` writes; it is not the quantizer (no scale
search, no GPTQ) and it never imports the converter; the encoding itself (pack/unpack) is pack/int4.py's.

Layout (docs/format.md, "pack-quantized"), for a Linear with weight [N, K] (N = out, K = in):
    weight_packed      int32 [N, ceil(K/8)]   element k of a row -> word k // 8, bits 4*(k % 8)..,
                                              least-significant nibble first, stored u = q + 8
    weight_scale       bf16  [N, ceil(K/g)]   ([N, 1] for channel strategy)
    weight_zero_point  int32 [ceil(N/8), G]   packed along dim 0, same nibble scheme; asymmetric only
    weight_shape       int64 [2] = [N, K]
    dequant: w = (q - zp) * scale.
MoE experts carry a leading expert dim E on every tensor (packed [E, N, K/8], ...).

Legend: M = rows of x (tokens), N = out features, K = in features, G = groups per row, E = experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..pack.int4 import dequantize_int4, infer_group_size, pack_int4, unpack_int4, unpack_zero_point
from ._triton import dot_f32, resolve_backend, tl, triton

__all__ = [
    "PackedInt4",
    "pack_int4",
    "unpack_int4",
    "unpack_zero_point",
    "dequantize_int4",
    "int4_gemm",
    "int4_gemm_ref",
]


@dataclass(frozen=True)
class PackedInt4:
    """One INT4 weight (2-D Linear or 3-D expert stack) in compressed-tensors pack-quantized form.

    packed      int32 [E?, N, ceil(K/8)]
    scale       bf16/fp16/fp32 [E?, N, ceil(K/group_size)]   ([E?, N, 1] for channel)
    zero_point  int32 [E?, ceil(N/8), ceil(K/group_size)] or None (symmetric)
    shape       (N, K) of one matrix (what `weight_shape` holds)
    group_size  K for channel strategy
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    shape: tuple[int, int]
    group_size: int

    def __post_init__(self):
        n, k = self.shape
        lead = self.packed.shape[:-2]
        if self.packed.dtype != torch.int32 or tuple(self.packed.shape[-2:]) != (n, math.ceil(k / 8)):
            raise ValueError(f"packed must be int32 [..., {n}, {math.ceil(k / 8)}], got {self.packed.dtype} "
                             f"{list(self.packed.shape)}")
        ng = math.ceil(k / self.group_size)
        if tuple(self.scale.shape) != (*lead, n, ng):
            raise ValueError(f"scale must be [{', '.join(map(str, (*lead, n, ng)))}], got {list(self.scale.shape)}")
        if self.zero_point is not None and tuple(self.zero_point.shape) != (*lead, math.ceil(n / 8), ng):
            raise ValueError(f"zero_point must be [..., {math.ceil(n / 8)}, {ng}], got {list(self.zero_point.shape)}")

    @classmethod
    def from_tensors(cls, weight_packed, weight_scale, weight_shape, weight_zero_point=None,
                     group_size: int | None = None) -> "PackedInt4":
        """Build from the tensors of one checkpoint module (names as compressed-tensors writes them)."""
        n, k = (int(v) for v in torch.as_tensor(weight_shape).reshape(-1)[-2:])
        g = group_size or infer_group_size(k, weight_scale.shape[-1])
        return cls(weight_packed, weight_scale, weight_zero_point, (n, k), g)

    @property
    def num_experts(self) -> int | None:
        return self.packed.shape[0] if self.packed.ndim == 3 else None

    @property
    def symmetric(self) -> bool:
        return self.zero_point is None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.packed, self.scale, self.zero_point, shape=self.shape,
                               group_size=self.group_size, dtype=dtype)

    def to(self, device) -> "PackedInt4":
        zp = None if self.zero_point is None else self.zero_point.to(device)
        return PackedInt4(self.packed.to(device), self.scale.to(device), zp, self.shape, self.group_size)


# --------------------------------------------------------------------------------------------------
# W4A16 GEMM: reference
# --------------------------------------------------------------------------------------------------
def int4_gemm_ref(x: torch.Tensor, w: PackedInt4) -> torch.Tensor:
    """y = x @ dequant(W)^T in fp32, cast to x.dtype. x [..., K], W 2-D [N, K] -> y [..., N]."""
    if w.num_experts is not None:
        raise ValueError("int4_gemm takes a 2-D weight; use fused_moe for expert stacks")
    wd = w.dequantize(torch.float32)  # [N, K]
    return (x.to(torch.float32) @ wd.T).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# W4A16 GEMM: Triton
# --------------------------------------------------------------------------------------------------
if triton is not None:
    from ._triton import cast_rne

    @triton.jit
    def dequant_int4_tile(w_ptr, s_ptr, z_ptr, offs_n, k0, N, K,
                          stride_wn, stride_sn, stride_sg, stride_zn, stride_zg,
                          GROUP_SIZE: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SCALE_MODE: tl.constexpr):
        """fp32 tile [BLOCK_K, BLOCK_N] of W^T: rows `offs_n` of W, input columns k0 .. k0+BLOCK_K-1
        (k0 % BLOCK_K == 0). Columns >= K come out as finite junk times a zero or real scale;
        callers zero the matching activations. Each packed word is loaded once and split in
        registers. SCALE_MODE (scale_mode()): 1 = the tile lies in one group, 2 = BLOCK_K //
        GROUP_SIZE whole groups, 0 = any group size (per-element gather)."""
        n = offs_n[None, :]  # [1, BN]
        n_ok = n < N
        wi = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK/8] word index along K
        words = tl.load(w_ptr + n * stride_wn + wi[:, None], mask=n_ok & (wi[:, None] < (K + 7) // 8),
                        other=0)  # [BK/8, BN] int32
        shifts = tl.arange(0, 8) * 4
        u = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK/8, 8, BN], nibble j of word w = k 8w+j
        u = tl.reshape(u, (BLOCK_K, BLOCK_N))  # [BK, BN] stored values 0..15
        if SCALE_MODE == 1:
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + n * stride_sn + g * stride_sg, mask=n_ok, other=0.0).to(tl.float32)  # [1, BN]
            if HAS_ZP:
                zw = tl.load(z_ptr + (n // 8) * stride_zn + g * stride_zg, mask=n_ok, other=0)
                z = (zw >> ((n % 8) * 4)) & 0xF  # [1, BN]
        elif SCALE_MODE == 2:
            NGT: tl.constexpr = BLOCK_K // GROUP_SIZE
            g = (k0 // GROUP_SIZE + tl.arange(0, NGT))[:, None]  # [NGT, 1]
            g_ok = n_ok & (g < (K + GROUP_SIZE - 1) // GROUP_SIZE)
            s = tl.load(s_ptr + n * stride_sn + g * stride_sg, mask=g_ok, other=0.0).to(tl.float32)  # [NGT, BN]
            s = tl.reshape(tl.broadcast_to(s[:, None, :], (NGT, GROUP_SIZE, BLOCK_N)), (BLOCK_K, BLOCK_N))
            if HAS_ZP:
                zw = tl.load(z_ptr + (n // 8) * stride_zn + g * stride_zg, mask=g_ok, other=0)
                z = (zw >> ((n % 8) * 4)) & 0xF  # [NGT, BN]
                z = tl.reshape(tl.broadcast_to(z[:, None, :], (NGT, GROUP_SIZE, BLOCK_N)), (BLOCK_K, BLOCK_N))
        else:
            k = (k0 + tl.arange(0, BLOCK_K))[:, None]  # [BK, 1]
            g = k // GROUP_SIZE
            mask = n_ok & (k < K)
            s = tl.load(s_ptr + n * stride_sn + g * stride_sg, mask=mask, other=0.0).to(tl.float32)  # [BK, BN]
            if HAS_ZP:
                zw = tl.load(z_ptr + (n // 8) * stride_zn + g * stride_zg, mask=mask, other=0)
                z = (zw >> ((n % 8) * 4)) & 0xF
        if HAS_ZP:
            q = u - z  # (u - 8) - (uz - 8)
        else:
            q = u - 8
        return q.to(tl.float32) * s

    @triton.jit
    def _int4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, k_per_split,
                          stride_xm, stride_wn, stride_sn, stride_sg, stride_zn, stride_zg,
                          stride_ys, stride_ym,
                          GROUP_SIZE: tl.constexpr, HAS_ZP: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SCALE_MODE: tl.constexpr, DOT_F32: tl.constexpr):
        # grid: (M tiles, N tiles, split-K slices); slice s covers K range [s*k_per_split, ...)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < k_hi)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)  # [BM, BK]
            w = dequant_int4_tile(w_ptr, s_ptr, z_ptr, offs_n, k0, N, K, stride_wn, stride_sn, stride_sg,
                                  stride_zn, stride_zg, GROUP_SIZE, HAS_ZP, BLOCK_N, BLOCK_K,
                                  SCALE_MODE)  # [BK, BN] fp32
            if DOT_F32:
                acc = tl.dot(x.to(tl.float32), w, acc)
            else:
                acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
        y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, cast_rne(acc, y_ptr.dtype.element_ty), mask=y_mask)


def scale_mode(group_size: int, k: int, block_k: int) -> int:
    """How dequant_int4_tile reads scales (and zero points) for one K tile; see its docstring."""
    if group_size >= k or group_size % block_k == 0:
        return 1
    if block_k % group_size == 0:
        return 2
    return 0


def _gemm_config(m: int, n: int, k: int, device: torch.device, split_k: int | None):
    """(BLOCK_M, BLOCK_N, BLOCK_K, split_k, num_warps). Decode (small M) splits K so that enough
    programs run to fill the GPU; the interpreter prefers few, large programs."""
    if device.type != "cuda":
        bm = min(64, max(16, 1 << (m - 1).bit_length()))
        return bm, 64, 128, split_k or 1, 4
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn, bk = 64, 128
    if split_k is None:
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        split_k = 1
        while tiles * split_k < 2 * sms and split_k < 16 and k // (split_k * 2) >= 4 * bk:
            split_k *= 2
    return bm, bn, bk, split_k, 4


def int4_gemm(x: torch.Tensor, w: PackedInt4, *, backend: str = "auto", split_k: int | None = None) -> torch.Tensor:
    """y = x @ W^T with W INT4 (W4A16). x bf16/fp16 [..., K], W 2-D [N, K] -> y [..., N] in x.dtype.

    backend: "torch" (int4_gemm_ref), "triton", or "auto" (triton when it can run on x's device).
    split_k: force the number of K slices (default: heuristic, 1 off-GPU)."""
    if w.num_experts is not None:
        raise ValueError("int4_gemm takes a 2-D weight; use fused_moe for expert stacks")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]}, weight has K={k}")
    if resolve_backend(backend, x.device) == "torch":
        return int4_gemm_ref(x, w)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the INT4 GEMM kernel takes bf16/fp16 activations, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*lead, n))
    bm, bn, bk, split, warps = _gemm_config(m, n, k, x.device, split_k)
    k_per_split = math.ceil(math.ceil(k / split) / bk) * bk  # a multiple of BLOCK_K
    split = math.ceil(k / k_per_split)
    packed, scale = w.packed.contiguous(), w.scale.contiguous()
    zp = w.zero_point.contiguous() if w.zero_point is not None else packed  # dummy pointer when symmetric
    if split == 1:
        y = torch.empty((1, m, n), device=x.device, dtype=x.dtype)
    else:
        y = torch.empty((split, m, n), device=x.device, dtype=torch.float32)  # partial sums, reduced below
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _int4_gemm_kernel[grid](
        x2, packed, scale, zp, y, m, n, k, k_per_split,
        x2.stride(0), packed.stride(0), scale.stride(0), scale.stride(1), zp.stride(0), zp.stride(1),
        y.stride(0), y.stride(1),
        GROUP_SIZE=w.group_size, HAS_ZP=w.zero_point is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SCALE_MODE=scale_mode(w.group_size, k, bk), DOT_F32=dot_f32(),
        num_warps=warps, num_stages=2 if x.device.type == "cuda" else 1,
    )
    y = y[0] if split == 1 else y.sum(0).to(x.dtype)  # deterministic split-K reduction
    return y.reshape(*lead, n)
