"""FP4 weights (NVFP4 and MXFP4) in the compressed-tensors `nvfp4-pack-quantized` / `mxfp4-pack-quantized`
layouts: dequantization in torch, and W4A16 dequant-GEMM and fused-MoE Triton kernels beside their torch
references.

This is the runtime's reader of FP4 checkpoints, not the quantizer: the nibble packing is pack/fp4.py's
and the scale math quant/fp4.py's (bit-exact to compressed-tensors); every torch path here decodes
through them. Activations stay bf16/fp16: Hopper (sm_90) has no FP4 tensor cores, so what runs
there is a dequantize-then-dot kernel, as for INT4 (Blackwell's native FP4 MMA is out of scope).

Layout, for a Linear with weight [N, K] (N = out, K = in; K a multiple of the group size):
    weight_packed        uint8 [N, K/2]   two E2M1 codes per byte, column 2j in the low nibble of byte j
    weight_scale         NVFP4: float8_e4m3fn [N, K/16]    MXFP4: uint8 E8M0 [N, K/32]
    weight_global_scale  NVFP4 only: float32 [1]
    E2M1 code c: sign c >> 3, magnitude index c & 7 -> 0, .5, 1, 1.5, 2, 3, 4, 6 (code 8 is -0.0)
    dequant (float32, compressed-tensors' `decompress`):
        NVFP4  w = e2m1 * (scale.float() / global_scale)     (one IEEE float32 division per group)
        MXFP4  w = e2m1 * 2^(scale - 127)                     (scale 0 -> 2^-127, a float32 subnormal)
MoE experts carry a leading expert dim E on every tensor (packed [E, N, K/2], global scale [E, 1]).

Legend: M = rows of x (tokens), N = out features, K = in features, G = groups per row, g = group size
(16 NVFP4, 32 MXFP4), E = experts, T = tokens, D = hidden, I = moe intermediate, k = experts per token,
S = T * k routed slots, BM = rows per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..pack.fp4 import unpack_fp4
from ..quant.fp4 import MXFP4_GROUP_SIZE, NVFP4_GROUP_SIZE, dequantize_mxfp4, dequantize_nvfp4
from ._triton import dot_f32, resolve_backend, tl, triton
from .fused_moe import _moe_config, moe_align_block_size
from .int4 import _gemm_config

__all__ = [
    "FP4_KINDS",
    "PackedFP4",
    "FP4Experts",
    "fuse_gate_up_fp4",
    "fp4_gemm",
    "fp4_gemm_ref",
    "fused_moe_fp4",
    "fused_moe_fp4_ref",
]

FP4_KINDS = {"nvfp4": (NVFP4_GROUP_SIZE, torch.float8_e4m3fn), "mxfp4": (MXFP4_GROUP_SIZE, torch.uint8)}
_KIND_ID = {"nvfp4": 0, "mxfp4": 1}  # the kernels' KIND constexpr


@dataclass(frozen=True)
class PackedFP4:
    """One FP4 weight (2-D Linear or 3-D expert stack) in compressed-tensors form.

    packed        uint8 [E?, N, K/2]
    scale         NVFP4: float8_e4m3fn [E?, N, K/16];  MXFP4: uint8 (E8M0) [E?, N, K/32]
    global_scale  NVFP4: float32 [E?, 1] ([1] for a Linear); MXFP4: None
    shape         (N, K) of one matrix
    kind          "nvfp4" | "mxfp4"
    """

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    shape: tuple[int, int]
    kind: str

    def __post_init__(self):
        if self.kind not in FP4_KINDS:
            raise ValueError(f"kind must be one of {tuple(FP4_KINDS)}, got {self.kind!r}")
        g, scale_dtype = FP4_KINDS[self.kind]
        n, k = self.shape
        if k % g:
            raise ValueError(f"{self.kind} needs K divisible by its group size {g}, got K={k}")
        if self.packed.ndim not in (2, 3):
            raise ValueError(f"packed must be 2-D [N, K/2] or 3-D [E, N, K/2], got {list(self.packed.shape)}")
        lead = tuple(self.packed.shape[:-2])
        if self.packed.dtype != torch.uint8 or tuple(self.packed.shape[-2:]) != (n, k // 2):
            raise ValueError(f"packed must be uint8 [..., {n}, {k // 2}], got {self.packed.dtype} "
                             f"{list(self.packed.shape)}")
        if self.scale.dtype != scale_dtype or tuple(self.scale.shape) != (*lead, n, k // g):
            raise ValueError(f"{self.kind} scale must be {scale_dtype} {list((*lead, n, k // g))}, got "
                             f"{self.scale.dtype} {list(self.scale.shape)}")
        gs = self.global_scale
        if self.kind == "mxfp4":
            if gs is not None:
                raise ValueError("mxfp4 has no global scale")
        elif gs is None or gs.dtype != torch.float32 or tuple(gs.shape) != (*lead, 1):
            got = "None" if gs is None else f"{gs.dtype} {list(gs.shape)}"
            raise ValueError(f"nvfp4 global_scale must be float32 {list((*lead, 1))}, got {got}")

    @classmethod
    def from_tensors(cls, weight_packed, weight_scale, weight_global_scale=None, *, kind: str | None = None,
                     weight_shape=None) -> "PackedFP4":
        """Build from the tensors of one checkpoint module (names as compressed-tensors writes them).
        kind defaults from the scale dtype (float8_e4m3fn -> nvfp4, uint8 -> mxfp4); (N, K) defaults
        to (packed rows, 2 * packed columns). A one-element global scale of an expert stack is
        broadcast to [E, 1]; a 0-d one of a Linear becomes [1]."""
        if kind is None:
            kind = {torch.float8_e4m3fn: "nvfp4", torch.uint8: "mxfp4"}.get(weight_scale.dtype)
            if kind is None:
                raise ValueError(f"cannot tell the FP4 kind from a {weight_scale.dtype} scale "
                                 "(float8_e4m3fn = nvfp4, uint8 = mxfp4)")
        if weight_shape is None:
            shape = (int(weight_packed.shape[-2]), 2 * int(weight_packed.shape[-1]))
        else:
            shape = tuple(int(v) for v in torch.as_tensor(weight_shape).reshape(-1)[-2:])
        gs = weight_global_scale
        if gs is not None:
            lead = tuple(weight_packed.shape[:-2])
            if gs.numel() == 1 and tuple(gs.shape) != (*lead, 1):
                gs = gs.reshape(1).expand(*lead, 1)  # [E?, 1]
        return cls(weight_packed, weight_scale, gs, shape, kind)

    @property
    def num_experts(self) -> int | None:
        return self.packed.shape[0] if self.packed.ndim == 3 else None

    @property
    def group_size(self) -> int:
        return FP4_KINDS[self.kind][0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E?, N, K] in `dtype`: the float32 product, rounded once (compressed-tensors' decompression)."""
        codes = unpack_fp4(self.packed)  # [E?, N, K] uint8
        if self.kind == "nvfp4":
            return dequantize_nvfp4(codes, self.scale, self.global_scale, dtype)
        return dequantize_mxfp4(codes, self.scale, dtype)

    def expert(self, e: int) -> "PackedFP4":
        """The 2-D weight of expert e (global scale [1])."""
        gs = None if self.global_scale is None else self.global_scale[e]
        return PackedFP4(self.packed[e], self.scale[e], gs, self.shape, self.kind)

    def to(self, device) -> "PackedFP4":
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return PackedFP4(self.packed.to(device), self.scale.to(device), gs, self.shape, self.kind)


# --------------------------------------------------------------------------------------------------
# W4A16 GEMM: reference
# --------------------------------------------------------------------------------------------------
def fp4_gemm_ref(x: torch.Tensor, w: PackedFP4) -> torch.Tensor:
    """y = x @ dequant(W)^T in fp32, cast to x.dtype. x [..., K], W 2-D [N, K] -> y [..., N]."""
    if w.num_experts is not None:
        raise ValueError("fp4_gemm takes a 2-D weight; use fused_moe_fp4 for expert stacks")
    wd = w.dequantize(torch.float32)  # [N, K]
    return (x.to(torch.float32) @ wd.T).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Triton: tile dequantization, GEMM, fused MoE
# --------------------------------------------------------------------------------------------------
if triton is not None:
    from ._triton import cast_rne

    @triton.jit
    def e2m1_to_f32(c):
        """int32 E2M1 codes (0..15) -> fp32, exactly, from the bits. A normal code (magnitude index
        x = c & 7 >= 2: exponent x >> 1 with bias 1, mantissa x & 1) lands in fp32 as x << 22 (its
        exponent and mantissa bits moved up) plus 126 << 23 (the bias change); x = 1 is 0.5 (fp32
        0x3F000000), x = 0 is 0; the sign bit moves from bit 3 to bit 31 (code 8 -> -0.0)."""
        x = c & 7
        mag = tl.where(x >= 2, (x << 22) + 0x3F000000, tl.where(x == 1, 0x3F000000, 0))
        return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def e4m3_to_f32(b):
        """int32 float8_e4m3fn bytes (0..255) -> fp32, exactly. Normal (exponent field > 0): exponent
        and mantissa move up by 20 bits, the bias goes from 7 to 127 (+120 << 23); subnormal: m * 2^-9;
        0x7F / 0xFF: NaN (e4m3fn has no infinities)."""
        a = b & 0x7F
        normal = ((a << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        sub = (a & 7).to(tl.float32) * 0.001953125  # 2^-9, exact
        v = tl.where(a >= 8, normal, sub)
        v = tl.where(a == 0x7F, float("nan"), v)
        return tl.where(b >= 128, -v, v)

    @triton.jit
    def e8m0_to_f32(e):
        """int32 E8M0 bytes -> fp32 2^(e - 127) from the bits, as quant/fp4.effective_scale_mxfp4:
        e = 0 is the subnormal 2^-127 (bit 22), e = 255 gives +inf like the reference."""
        return tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def dequant_fp4_tile(w_ptr, s_ptr, gs_ptr, offs_n, k0, N, K, stride_wn, stride_sn,
                         KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        """fp32 tile [BLOCK_K, BLOCK_N] of W^T: rows `offs_n` of W, input columns k0 .. k0+BLOCK_K-1.
        BLOCK_K is a multiple of the group size and k0 of BLOCK_K, so the tile holds BLOCK_K // g
        whole groups. Columns >= K come out as 0 (masked codes are 0). s_ptr points at the scales as
        uint8 bytes (an fp8 tensor viewed as uint8); gs_ptr at the matrix's float32 global scale
        (NVFP4; unused for MXFP4). Each byte is loaded once and split into its two nibbles."""
        n = offs_n[None, :]  # [1, BN]
        n_ok = n < N
        bi = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK/2] byte index along the row
        b = tl.load(w_ptr + n * stride_wn + bi[:, None], mask=n_ok & (bi[:, None] < K // 2),
                    other=0).to(tl.int32)  # [BK/2, BN]
        shifts = tl.arange(0, 2) * 4  # low nibble = even column
        c = (b[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK/2, 2, BN]: code of column 2j + h
        q = e2m1_to_f32(tl.reshape(c, (BLOCK_K, BLOCK_N)))  # [BK, BN]
        NGT: tl.constexpr = BLOCK_K // GROUP_SIZE
        g = (k0 // GROUP_SIZE + tl.arange(0, NGT))[:, None]  # [NGT, 1]
        sb = tl.load(s_ptr + n * stride_sn + g, mask=n_ok & (g < K // GROUP_SIZE), other=0).to(tl.int32)
        if KIND == 0:  # NVFP4: scale.float() / global_scale, IEEE division as torch does it
            s = tl.math.div_rn(e4m3_to_f32(sb), tl.load(gs_ptr))  # [NGT, BN]
        else:  # MXFP4
            s = e8m0_to_f32(sb)
        s = tl.reshape(tl.broadcast_to(s[:, None, :], (NGT, GROUP_SIZE, BLOCK_N)), (BLOCK_K, BLOCK_N))
        return q * s

    @triton.jit
    def _fp4_gemm_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, N, K, k_per_split,
                         stride_xm, stride_wn, stride_sn, stride_ys, stride_ym,
                         KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
        # grid: (M tiles, N tiles, K slices); slice s covers K range [s*k_per_split, ...)
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
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_hi), other=0.0)  # [BM, BK]
            w = dequant_fp4_tile(w_ptr, s_ptr, gs_ptr, offs_n, k0, N, K, stride_wn, stride_sn, KIND,
                                 GROUP_SIZE, BLOCK_N, BLOCK_K)  # [BK, BN] fp32
            if DOT_F32:
                acc = tl.dot(x.to(tl.float32), w, acc)
            else:
                acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
        y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, cast_rne(acc, y_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _moe_fp4_gate_up_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, sorted_ptr, expert_ptr, npad_ptr,
                                num_slots, top_k, I, K,
                                stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_am,
                                KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
        # grid: (row blocks, I tiles). a[slot, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n])
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M < tl.load(npad_ptr):  # blocks past the padded total (and empty experts) skip
            e = tl.load(expert_ptr + pid_m).to(tl.int64)
            slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
            row_ok = slots < num_slots
            tok = slots // top_k
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            w, s, gs = w_ptr + e * stride_we, s_ptr + e * stride_se, gs_ptr + e * stride_ge
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + tok[:, None] * stride_xm + offs_k[None, :],
                            mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0)  # [BM, BK]
                g = dequant_fp4_tile(w, s, gs, offs_n, k0, I, K, stride_wn, stride_sn, KIND, GROUP_SIZE,
                                     BLOCK_N, BLOCK_K)  # [BK, BN] gate rows [0, I)
                u = dequant_fp4_tile(w, s, gs, offs_n + I, k0, 2 * I, K, stride_wn, stride_sn, KIND,
                                     GROUP_SIZE, BLOCK_N, BLOCK_K)  # up rows [I, 2I), same global scale
                if DOT_F32:
                    xf = x.to(tl.float32)
                    acc_g = tl.dot(xf, g, acc_g)
                    acc_u = tl.dot(xf, u, acc_u)
                else:
                    acc_g = tl.dot(x, g.to(x_ptr.dtype.element_ty), acc_g)
                    acc_u = tl.dot(x, u.to(x_ptr.dtype.element_ty), acc_u)
            a = acc_g * tl.sigmoid(acc_g) * acc_u  # SiLU(gate) * up, fp32
            mask = row_ok[:, None] & (offs_n[None, :] < I)
            tl.store(a_ptr + slots[:, None] * stride_am + offs_n[None, :], cast_rne(a, a_ptr.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def _moe_fp4_down_kernel(a_ptr, w_ptr, s_ptr, gs_ptr, rw_ptr, o_ptr, sorted_ptr, expert_ptr, npad_ptr,
                             num_slots, N, K,
                             stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_om,
                             KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
        # grid: (row blocks, D tiles). o[slot, n] = router_w[slot] * (a[slot] . w2[e, n])
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M < tl.load(npad_ptr):
            e = tl.load(expert_ptr + pid_m).to(tl.int64)
            slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
            row_ok = slots < num_slots
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            w, s, gs = w_ptr + e * stride_we, s_ptr + e * stride_se, gs_ptr + e * stride_ge
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(a_ptr + slots[:, None] * stride_am + offs_k[None, :],
                            mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0)  # [BM, BK]
                wt = dequant_fp4_tile(w, s, gs, offs_n, k0, N, K, stride_wn, stride_sn, KIND, GROUP_SIZE,
                                      BLOCK_N, BLOCK_K)  # [BK, BN]
                if DOT_F32:
                    acc = tl.dot(a.to(tl.float32), wt, acc)
                else:
                    acc = tl.dot(a, wt.to(a_ptr.dtype.element_ty), acc)
            rw = tl.load(rw_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)  # [BM]
            mask = row_ok[:, None] & (offs_n[None, :] < N)
            tl.store(o_ptr + slots[:, None] * stride_om + offs_n[None, :], acc * rw[:, None], mask=mask)


def _kernel_operands(w: PackedFP4):
    """(packed, scale bytes, global scale) as the kernels read them: contiguous, the fp8 scale viewed
    as uint8 (decoded in-kernel from its bits), and for MXFP4 a dummy global-scale pointer."""
    packed = w.packed.contiguous()
    scale = w.scale.contiguous().view(torch.uint8)
    gs = w.global_scale.contiguous() if w.global_scale is not None else packed
    return packed, scale, gs


def fp4_gemm(x: torch.Tensor, w: PackedFP4, *, backend: str = "auto", split_k: int | None = None) -> torch.Tensor:
    """y = x @ W^T with W NVFP4 or MXFP4 (W4A16). x bf16/fp16 [..., K], W 2-D [N, K] -> y [..., N] in x.dtype.

    backend: "torch" (fp4_gemm_ref), "triton", or "auto" (triton when it can run on x's device).
    split_k: force the number of K slices (default: int4_gemm's heuristic, 1 off-GPU)."""
    if w.num_experts is not None:
        raise ValueError("fp4_gemm takes a 2-D weight; use fused_moe_fp4 for expert stacks")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]}, weight has K={k}")
    if resolve_backend(backend, x.device) == "torch":
        return fp4_gemm_ref(x, w)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the FP4 GEMM kernel takes bf16/fp16 activations, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*lead, n))
    bm, bn, bk, split, warps = _gemm_config(m, n, k, x.device, split_k)  # bk = 128: whole groups per tile
    k_per_split = math.ceil(math.ceil(k / split) / bk) * bk  # a multiple of BLOCK_K
    split = math.ceil(k / k_per_split)
    packed, scale, gs = _kernel_operands(w)
    if split == 1:
        y = torch.empty((1, m, n), device=x.device, dtype=x.dtype)
    else:
        y = torch.empty((split, m, n), device=x.device, dtype=torch.float32)  # partial sums, reduced below
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _fp4_gemm_kernel[grid](
        x2, packed, scale, gs, y, m, n, k, k_per_split,
        x2.stride(0), packed.stride(0), scale.stride(0), y.stride(0), y.stride(1),
        KIND=_KIND_ID[w.kind], GROUP_SIZE=w.group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=dot_f32(),
        num_warps=warps, num_stages=2 if x.device.type == "cuda" else 1,
    )
    y = y[0] if split == 1 else y.sum(0).to(x.dtype)  # deterministic split-K reduction
    return y.reshape(*lead, n)


# --------------------------------------------------------------------------------------------------
# Fused MoE
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FP4Experts:
    """The routed experts of one MoE layer, FP4 packed, experts batched on dim 0 (vLLM's w13 / w2).

    w13  [E, 2I, D]: gate rows [0, I), up rows [I, 2I); NVFP4: one global scale per expert [E, 1],
         shared by its gate and up (what vLLM's fused w13 assumes; `fuse_gate_up_fp4` builds it)
    w2   [E, D, I] (down)
    Both of one kind.
    """

    w13: PackedFP4
    w2: PackedFP4

    def __post_init__(self):
        if self.w13.num_experts is None or self.w2.num_experts is None:
            raise ValueError("expert weights must be 3-D [E, N, K/2]")
        if self.w13.num_experts != self.w2.num_experts:
            raise ValueError(f"w13 has {self.w13.num_experts} experts, w2 {self.w2.num_experts}")
        if self.w13.kind != self.w2.kind:
            raise ValueError(f"w13 is {self.w13.kind}, w2 is {self.w2.kind}: one FP4 kind per layer")
        d, i = self.w2.shape
        if self.w13.shape != (2 * i, d):
            raise ValueError(f"w13 shape {self.w13.shape} does not match w2 {self.w2.shape} (want {(2 * i, d)})")

    @property
    def kind(self) -> str:
        return self.w2.kind

    @property
    def num_experts(self) -> int:
        return self.w2.num_experts

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[1]

    def to(self, device) -> "FP4Experts":
        return FP4Experts(self.w13.to(device), self.w2.to(device))


def fuse_gate_up_fp4(gate: PackedFP4, up: PackedFP4) -> PackedFP4:
    """Stack per-expert gate and up ([E, I, D] each, the on-disk layout) into w13 [E, 2I, D].

    NVFP4: the fused weight has one global scale per expert, so gate and up must carry the same one
    (quantize them with quant.fp4.choose_global_scale(gate, up)). vLLM keeps the gate's and only
    warns when they differ, which silently mis-scales up; here that is an error, since no exact
    re-expression of up's fp8 group scales under another global scale exists in general."""
    if gate.kind != up.kind or gate.shape != up.shape or gate.num_experts != up.num_experts:
        raise ValueError(f"gate ({gate.kind} {gate.shape}) and up ({up.kind} {up.shape}) must match")
    if gate.num_experts is None:
        raise ValueError("fuse_gate_up_fp4 takes expert stacks [E, I, D]")
    gs = None
    if gate.kind == "nvfp4":
        differ = gate.global_scale.view(torch.int32) != up.global_scale.view(torch.int32)  # [E, 1], bitwise
        if differ.any():
            bad = torch.nonzero(differ.reshape(-1)).reshape(-1).tolist()
            raise ValueError(f"gate and up global scales differ for experts {bad[:8]}: a fused w13 needs one "
                             "per expert (quantize with quant.fp4.choose_global_scale(gate, up))")
        gs = gate.global_scale
    i, d = gate.shape
    return PackedFP4(torch.cat((gate.packed, up.packed), -2), torch.cat((gate.scale, up.scale), -2), gs,
                     (2 * i, d), gate.kind)


def fused_moe_fp4_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      experts: FP4Experts) -> torch.Tensor:
    """Plain torch, fp32 math, one dequantized expert at a time. hidden [T, D] -> [T, D] in hidden.dtype."""
    t, d = hidden.shape
    i = experts.intermediate_size
    x = hidden.to(torch.float32)
    out = torch.zeros((t, d), dtype=torch.float32, device=hidden.device)  # [T, D]
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)  # [n_e] each
        w13 = experts.w13.expert(e).dequantize()  # [2I, D]
        wd = experts.w2.expert(e).dequantize()  # [D, I]
        xe = x[tok]  # [n_e, D]
        a = torch.nn.functional.silu(xe @ w13[:i].T) * (xe @ w13[i:].T)  # [n_e, I]
        y = (a @ wd.T) * topk_weights[tok, slot].to(torch.float32)[:, None]  # [n_e, D]
        out.index_add_(0, tok, y)
    return out.to(hidden.dtype)


def fused_moe_fp4(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  experts: FP4Experts, *, backend: str = "auto", block_m: int | None = None) -> torch.Tensor:
    """SiLU-gated MoE MLP over FP4 experts, the scheme of fused_moe_int4 (sort/align by expert, one
    launch for gate+up, one for down, k slots summed last). hidden bf16/fp16 [T, D], topk_ids int
    [T, k] in [0, E), topk_weights [T, k] -> [T, D] in hidden.dtype.

    backend: "torch" (fused_moe_fp4_ref), "triton", or "auto". block_m overrides BLOCK_M."""
    t, d = hidden.shape
    if d != experts.hidden_size:
        raise ValueError(f"hidden has D={d}, experts expect {experts.hidden_size}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError("topk_ids and topk_weights must both be [T, k]")
    if resolve_backend(backend, hidden.device) == "torch":
        return fused_moe_fp4_ref(hidden, topk_ids, topk_weights, experts)
    if t == 0:
        return hidden.new_empty((0, d))
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the fused MoE kernel takes bf16/fp16 activations, got {hidden.dtype}")
    top_k = topk_ids.shape[1]
    n_slots = t * top_k
    e, i = experts.num_experts, experts.intermediate_size
    bm, bn, bk, warps = _moe_config(n_slots, e, hidden.device)  # bk 64/128: whole groups per tile
    bm = block_m or bm
    stages = 2 if hidden.device.type == "cuda" else 1
    sorted_slots, block_expert, n_padded = moe_align_block_size(topk_ids, e, bm)
    n_blocks = block_expert.numel()
    x = hidden.contiguous()
    kind, g = _KIND_ID[experts.kind], experts.w2.group_size

    p13, s13, gs13 = _kernel_operands(experts.w13)
    a = torch.empty((n_slots, i), device=x.device, dtype=x.dtype)  # [S, I] SiLU(gate) * up
    _moe_fp4_gate_up_kernel[(n_blocks, triton.cdiv(i, bn))](
        x, p13, s13, gs13, a, sorted_slots, block_expert, n_padded, n_slots, top_k, i, d,
        x.stride(0), p13.stride(0), p13.stride(1), s13.stride(0), s13.stride(1), gs13.stride(0), a.stride(0),
        KIND=kind, GROUP_SIZE=g, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=dot_f32(),
        num_warps=warps, num_stages=stages,
    )

    p2, s2, gs2 = _kernel_operands(experts.w2)
    rw = topk_weights.reshape(-1).contiguous()  # [S]
    o = torch.empty((n_slots, d), device=x.device, dtype=torch.float32)  # [S, D] weighted expert outputs
    _moe_fp4_down_kernel[(n_blocks, triton.cdiv(d, bn))](
        a, p2, s2, gs2, rw, o, sorted_slots, block_expert, n_padded, n_slots, d, i,
        a.stride(0), p2.stride(0), p2.stride(1), s2.stride(0), s2.stride(1), gs2.stride(0), o.stride(0),
        KIND=kind, GROUP_SIZE=g, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=dot_f32(),
        num_warps=warps, num_stages=stages,
    )
    return o.view(t, top_k, d).sum(1).to(hidden.dtype)  # [T, D]
