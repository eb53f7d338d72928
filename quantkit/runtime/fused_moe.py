"""Fused Mixture-of-Experts MLP with INT4 expert weights (W4A16): a torch reference and a Triton path
with one kernel launch per GEMM for all experts of a layer.

    out[t] = sum_j  w[t, j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),   e = topk_ids[t, j]

The Triton path sorts (token, slot) pairs by expert and pads each expert's run to a multiple of
BLOCK_M (`moe_align_block_size`, the scheme vLLM's fused_moe uses); every program then owns one
block of one expert, so an expert that received no tokens owns no block and does no work.
Kernel 1 computes the gate and up tiles together and applies SiLU-gating in its epilogue;
kernel 2 (down) scales each row by its router weight; the k slots of a token are summed last in
fp32, so the result does not depend on launch order (no atomics).

Not here: routing itself (softmax / grouped top-k are the caller's), shared experts, expert
parallelism (all E experts are local), activation quantization.

Legend: T = tokens, D = hidden, I = moe intermediate, E = experts, k = experts per token,
S = T * k routed slots, BM = rows per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._triton import dot_f32, resolve_backend, tl, triton
from .int4 import PackedInt4, scale_mode

if triton is not None:
    from ._triton import cast_rne
    from .int4 import dequant_int4_tile

__all__ = ["Int4Experts", "moe_align_block_size", "fused_moe_int4", "fused_moe_int4_ref"]


@dataclass(frozen=True)
class Int4Experts:
    """The routed experts of one MoE layer, INT4 packed, experts batched on dim 0.

    down     [E, D, I]                       (PackedInt4 shape (D, I))
    gate_up  [E, 2I, D]: gate rows [0, I), up rows [I, 2I)  -- or --
    gate, up [E, I, D] each (the per-expert on-disk layout, stacked)
    All three are symmetric, or all asymmetric; group sizes may differ (each tensor carries its own).
    """

    down: PackedInt4
    gate_up: PackedInt4 | None = None
    gate: PackedInt4 | None = None
    up: PackedInt4 | None = None

    def __post_init__(self):
        fused = self.gate_up is not None
        if fused == (self.gate is not None or self.up is not None) or (not fused and None in (self.gate, self.up)):
            raise ValueError("give either gate_up, or both gate and up")
        parts = [self.down] + ([self.gate_up] if fused else [self.gate, self.up])
        if any(p.num_experts is None for p in parts):
            raise ValueError("expert weights must be 3-D [E, N, K/8]")
        if len({p.num_experts for p in parts}) != 1:
            raise ValueError("gate/up/down disagree on the number of experts")
        if len({p.symmetric for p in parts}) != 1:
            raise ValueError("gate/up/down must all be symmetric or all asymmetric")
        if not fused and self.gate.group_size != self.up.group_size:
            raise ValueError("gate and up must share a group size")
        d, i = self.down.shape
        want = [(2 * i, d)] if fused else [(i, d), (i, d)]
        got = [p.shape for p in parts[1:]]
        if got != want:
            raise ValueError(f"gate/up shapes {got} do not match down {self.down.shape} (want {want})")

    @property
    def num_experts(self) -> int:
        return self.down.num_experts

    @property
    def hidden_size(self) -> int:
        return self.down.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[1]


def _expert(w: PackedInt4, e: int) -> PackedInt4:
    """The 2-D weight of expert e."""
    zp = None if w.zero_point is None else w.zero_point[e]
    return PackedInt4(w.packed[e], w.scale[e], zp, w.shape, w.group_size)


# --------------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------------
def fused_moe_int4_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       experts: Int4Experts) -> torch.Tensor:
    """Plain torch, fp32 math, one dequantized expert at a time. hidden [T, D] -> [T, D] in hidden.dtype."""
    t, d = hidden.shape
    i = experts.intermediate_size
    x = hidden.to(torch.float32)
    out = torch.zeros((t, d), dtype=torch.float32, device=hidden.device)  # [T, D]
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)  # [n_e] each
        if experts.gate_up is not None:
            gu = _expert(experts.gate_up, e).dequantize()  # [2I, D]
            wg, wu = gu[:i], gu[i:]
        else:
            wg, wu = _expert(experts.gate, e).dequantize(), _expert(experts.up, e).dequantize()
        wd = _expert(experts.down, e).dequantize()  # [D, I]
        xe = x[tok]  # [n_e, D]
        a = torch.nn.functional.silu(xe @ wg.T) * (xe @ wu.T)  # [n_e, I]
        y = (a @ wd.T) * topk_weights[tok, slot].to(torch.float32)[:, None]  # [n_e, D]
        out.index_add_(0, tok, y)
    return out.to(hidden.dtype)


# --------------------------------------------------------------------------------------------------
# sort / align (torch, on the tokens' device, no host sync)
# --------------------------------------------------------------------------------------------------
def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Group routed slots by expert, each expert's run padded to a multiple of block_m.

    topk_ids [T, k] -> (sorted_slots int32 [B*block_m], block_expert int32 [B], num_padded int32 [1])
    where B bounds the block count without reading device values: min(S + E*(block_m-1), S*block_m)
    slots. Slot s = t*k + j; padding entries hold S. Blocks past num_padded have expert -1.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)  # [S]
    s = flat.numel()
    dev = flat.device
    max_padded = min(s + num_experts * (block_m - 1), s * block_m)
    n_blocks = max(1, math.ceil(max_padded / block_m))
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    pad_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [S] slots sorted by expert
    e_sorted = flat[order]  # [S]
    rank = torch.arange(s, device=dev) - (torch.cumsum(counts, 0) - counts)[e_sorted]  # position inside its run
    pos = (pad_end - padded)[e_sorted] + rank  # [S]
    sorted_slots = torch.full((n_blocks * block_m,), s, dtype=torch.int32, device=dev)
    sorted_slots[pos] = order.to(torch.int32)
    blk = torch.arange(n_blocks, device=dev)
    block_expert = torch.searchsorted(pad_end // block_m, blk, right=True)  # [B]
    block_expert = torch.where(blk < pad_end[-1] // block_m, block_expert, -1).to(torch.int32)
    return sorted_slots, block_expert, pad_end[-1:].to(torch.int32)


# --------------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _moe_gate_up_kernel(x_ptr, wg_ptr, sg_ptr, zg_ptr, wu_ptr, su_ptr, zu_ptr, a_ptr,
                            sorted_ptr, expert_ptr, npad_ptr, num_slots, top_k, I, K, up_row0,
                            stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sg,
                            stride_ze, stride_zn, stride_zg, stride_am,
                            GROUP_SIZE: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_MODE: tl.constexpr,
                            DOT_F32: tl.constexpr):
        # grid: (row blocks, I tiles). a[slot, n] = silu(x[tok] . gate[e, n]) * (x[tok] . up[e, n])
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M < tl.load(npad_ptr):  # blocks past the padded total (and empty experts) skip
            e = tl.load(expert_ptr + pid_m).to(tl.int64)
            slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
            row_ok = slots < num_slots
            tok = slots // top_k
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            wg, sg, zg = wg_ptr + e * stride_we, sg_ptr + e * stride_se, zg_ptr + e * stride_ze
            wu, su, zu = wu_ptr + e * stride_we, su_ptr + e * stride_se, zu_ptr + e * stride_ze
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + tok[:, None] * stride_xm + offs_k[None, :],
                            mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0)  # [BM, BK]
                g = dequant_int4_tile(wg, sg, zg, offs_n, k0, I, K, stride_wn, stride_sn, stride_sg, stride_zn,
                                      stride_zg, GROUP_SIZE, HAS_ZP, BLOCK_N, BLOCK_K, SCALE_MODE)  # [BK, BN]
                u = dequant_int4_tile(wu, su, zu, offs_n + up_row0, k0, I + up_row0, K, stride_wn, stride_sn,
                                      stride_sg, stride_zn, stride_zg, GROUP_SIZE, HAS_ZP, BLOCK_N, BLOCK_K,
                                      SCALE_MODE)
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
    def _moe_down_kernel(a_ptr, w_ptr, s_ptr, z_ptr, rw_ptr, o_ptr,
                         sorted_ptr, expert_ptr, npad_ptr, num_slots, N, K,
                         stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sg,
                         stride_ze, stride_zn, stride_zg, stride_om,
                         GROUP_SIZE: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_MODE: tl.constexpr,
                         DOT_F32: tl.constexpr):
        # grid: (row blocks, D tiles). o[slot, n] = router_w[slot] * (a[slot] . down[e, n])
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M < tl.load(npad_ptr):
            e = tl.load(expert_ptr + pid_m).to(tl.int64)
            slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
            row_ok = slots < num_slots
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            w, s, z = w_ptr + e * stride_we, s_ptr + e * stride_se, z_ptr + e * stride_ze
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(a_ptr + slots[:, None] * stride_am + offs_k[None, :],
                            mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0)  # [BM, BK]
                wt = dequant_int4_tile(w, s, z, offs_n, k0, N, K, stride_wn, stride_sn, stride_sg, stride_zn,
                                       stride_zg, GROUP_SIZE, HAS_ZP, BLOCK_N, BLOCK_K, SCALE_MODE)  # [BK, BN]
                if DOT_F32:
                    acc = tl.dot(a.to(tl.float32), wt, acc)
                else:
                    acc = tl.dot(a, wt.to(a_ptr.dtype.element_ty), acc)
            rw = tl.load(rw_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)  # [BM]
            mask = row_ok[:, None] & (offs_n[None, :] < N)
            tl.store(o_ptr + slots[:, None] * stride_om + offs_n[None, :], acc * rw[:, None], mask=mask)


def _moe_config(num_slots: int, num_experts: int, device: torch.device):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): BLOCK_M follows the mean rows per expert."""
    per_expert = num_slots / max(1, num_experts)
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    return bm, 64, (128 if device.type != "cuda" else 64), 4


def fused_moe_int4(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   experts: Int4Experts, *, backend: str = "auto", block_m: int | None = None) -> torch.Tensor:
    """SiLU-gated MoE MLP over INT4 experts. hidden bf16/fp16 [T, D], topk_ids int [T, k] in [0, E),
    topk_weights [T, k] -> [T, D] in hidden.dtype.

    backend: "torch" (fused_moe_int4_ref), "triton", or "auto". block_m overrides BLOCK_M."""
    t, d = hidden.shape
    if d != experts.hidden_size:
        raise ValueError(f"hidden has D={d}, experts expect {experts.hidden_size}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError("topk_ids and topk_weights must both be [T, k]")
    if resolve_backend(backend, hidden.device) == "torch":
        return fused_moe_int4_ref(hidden, topk_ids, topk_weights, experts)
    if t == 0:
        return hidden.new_empty((0, d))
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the fused MoE kernel takes bf16/fp16 activations, got {hidden.dtype}")
    top_k = topk_ids.shape[1]
    n_slots = t * top_k
    e, i = experts.num_experts, experts.intermediate_size
    bm, bn, bk, warps = _moe_config(n_slots, e, hidden.device)
    bm = block_m or bm
    stages = 2 if hidden.device.type == "cuda" else 1
    sorted_slots, block_expert, n_padded = moe_align_block_size(topk_ids, e, bm)
    n_blocks = block_expert.numel()
    x = hidden.contiguous()

    if experts.gate_up is not None:
        wg = wu = experts.gate_up
        up_row0 = i
    else:
        wg, wu, up_row0 = experts.gate, experts.up, 0
    pg, sg = wg.packed.contiguous(), wg.scale.contiguous()
    pu, su = wu.packed.contiguous(), wu.scale.contiguous()
    zg = wg.zero_point.contiguous() if wg.zero_point is not None else pg  # dummy pointer when symmetric
    zu = wu.zero_point.contiguous() if wu.zero_point is not None else pu
    if zg.stride() != zu.stride() or pg.stride() != pu.stride() or sg.stride() != su.stride():
        raise ValueError("gate and up must have identical layouts")
    a = torch.empty((n_slots, i), device=x.device, dtype=x.dtype)  # [S, I] SiLU(gate) * up
    _moe_gate_up_kernel[(n_blocks, triton.cdiv(i, bn))](
        x, pg, sg, zg, pu, su, zu, a, sorted_slots, block_expert, n_padded, n_slots, top_k, i, d, up_row0,
        x.stride(0), pg.stride(0), pg.stride(1), sg.stride(0), sg.stride(1), sg.stride(2),
        zg.stride(0), zg.stride(1), zg.stride(2), a.stride(0),
        GROUP_SIZE=wg.group_size, HAS_ZP=not wg.symmetric, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        SCALE_MODE=scale_mode(wg.group_size, d, bk), DOT_F32=dot_f32(), num_warps=warps, num_stages=stages,
    )

    wd = experts.down
    pd, sd = wd.packed.contiguous(), wd.scale.contiguous()
    zd = wd.zero_point.contiguous() if wd.zero_point is not None else pd
    rw = topk_weights.reshape(-1).contiguous()  # [S]
    o = torch.empty((n_slots, d), device=x.device, dtype=torch.float32)  # [S, D] weighted expert outputs
    _moe_down_kernel[(n_blocks, triton.cdiv(d, bn))](
        a, pd, sd, zd, rw, o, sorted_slots, block_expert, n_padded, n_slots, d, i,
        a.stride(0), pd.stride(0), pd.stride(1), sd.stride(0), sd.stride(1), sd.stride(2),
        zd.stride(0), zd.stride(1), zd.stride(2), o.stride(0),
        GROUP_SIZE=wd.group_size, HAS_ZP=not wd.symmetric, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        SCALE_MODE=scale_mode(wd.group_size, i, bk), DOT_F32=dot_f32(), num_warps=warps, num_stages=stages,
    )
    return o.view(t, top_k, d).sum(1).to(hidden.dtype)  # [T, D]
