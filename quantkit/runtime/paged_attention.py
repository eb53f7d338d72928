"""Paged decode attention over a BF16 or FP8 (e4m3) KV cache, with an in-kernel KV-cache integrity
check, plus the cache-append (write) kernel; each Triton kernel has its torch reference beside it.

Two attention forms share one kernel:
- GQA / MHA: k_cache, v_cache [P, S, Hkv, D]; q [B, Hq, D]; Hq % Hkv == 0.
- MLA latent (DeepSeek-V3 / Kimi K2 / GLM-5), absorbed form: the cache holds one latent per token,
  [P, S, L + R] = normalized kv_a output (L = kv_lora_rank) ++ rotated k_pe (R = rope dim), one scale
  for all of it. scores = q_nope_absorbed . c[:L] + q_pe . c[L:]; output = softmax @ c[:L] in latent
  space [B, H, L]; the caller applies the V up-projection.

FP8 (docs/format.md, "KV-cache FP8 scales"): stored = clamp(x / scale, -448, 448) cast to
float8_e4m3fn, round-to-nearest-even; scale fp32 [1] (per tensor) or [Hkv, 1, 1] (per head);
read back as stored * scale. BF16/FP16 caches take no scale (1.0).

Integrity (the "KV-cache integrity check" of docs/models.md): `owner` int32 [P] holds the request id
that owns each page, or -1 for free. With check=True every block-table entry a request reads
(entries 0 .. ceil(ctx/S)-1) or writes (the entry of the written position) must lie in [0, P) and be
owned by that request; a context longer than the table or a negative one is also a violation. A
violating entry is never dereferenced (the kernel masks it), the request's flag is set, and its
output is zeros (reference) or unspecified (kernel): callers must drop it (see runtime/decode.py).
With check=False the tables are trusted and an out-of-range entry is an out-of-bounds access.

The kernels take a batch's view of one layer's cache as one `PagedKV`: the caches, their FP8 scales,
each request's block table, the owner table and the request ids it is checked against. A decode step's
write and read share it; what differs is the token count (`positions` written, `context_lens` read).

Not here: prefill attention, sliding windows, ALiBi, split-KV (flash-decoding) partitioning; the
GLM-5 sparse-attention indexer; FP8 queries.

Legend: B = requests in the batch, P = pages in the pool, S = tokens per page, Hq / Hkv = query / KV
heads, G = Hq / Hkv, D = head dim, L = kv_lora_rank, R = rope dim, T = context tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..quant.fp8 import FP8_MAX
from ._triton import dot_f32, next_pow2, resolve_backend, tl, triton

__all__ = [
    "FP8_DTYPE",
    "PagedKV",
    "quantize_kv",
    "dequantize_kv",
    "block_table_violations_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_mla_decode_attention",
    "paged_mla_decode_attention_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]

FP8_DTYPE = torch.float8_e4m3fn
CACHE_DTYPES = (torch.bfloat16, torch.float16, FP8_DTYPE)


@dataclass(frozen=True)
class PagedKV:
    """A batch's view of one layer's paged KV cache, as the attention and cache-write kernels take it.

    k_cache, v_cache  [P, S, Hkv, D] bf16/fp16/fp8_e4m3fn; an MLA latent cache is k_cache [P, S, L+R]
                      (or [P, S, 1, L+R]) with v_cache None
    block_tables      int32 [B, max_pages]: the pages of request b, in order
    k_scale, v_scale  fp32 [1] or [Hkv, 1, 1] (FP8; None = 1.0); the MLA latent's one scale is k_scale
    owner             int32 [P]: the request id owning each page, -1 free (None: entries checked for range only)
    request_ids       int [B], held against owner (None: 0 .. B-1)
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor | None
    block_tables: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    owner: torch.Tensor | None = None
    request_ids: torch.Tensor | Sequence[int] | None = None


# --------------------------------------------------------------------------------------------------
# scales and FP8 conversion (pure torch)
# --------------------------------------------------------------------------------------------------
def _scale_vector(scale: torch.Tensor | None, num_heads: int, device) -> torch.Tensor:
    """fp32 [1] or [Hkv, 1, 1] (or None = 1.0) -> fp32 [1] or [Hkv], contiguous on `device`."""
    if scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    s = scale.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    if s.numel() not in (1, num_heads):
        raise ValueError(f"KV scale must have shape [1] or [{num_heads}, 1, 1], got {list(scale.shape)}")
    return s


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x [..., H, D] -> cache dtype. FP8: clamp(x / scale) to +-448, RNE cast; scale [1] or [H, 1, 1]."""
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    s = _scale_vector(scale, x.shape[-2], x.device).view(-1, 1)  # [1 or H, 1]
    return (x.to(torch.float32) / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(c: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """cache values [..., H, D] -> fp32 (stored * scale)."""
    s = _scale_vector(scale, c.shape[-2], c.device).view(-1, 1)  # [1 or H, 1]
    return c.to(torch.float32) * s


def _check_cache(cache: torch.Tensor, name: str):
    if cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"{name} dtype must be one of {CACHE_DTYPES}, got {cache.dtype}")


# --------------------------------------------------------------------------------------------------
# integrity check: reference
# --------------------------------------------------------------------------------------------------
def _rid_tensor(request_ids, b: int, device) -> torch.Tensor:
    if request_ids is None:
        return torch.arange(b, dtype=torch.int32, device=device)
    r = torch.as_tensor(request_ids, dtype=torch.int32, device=device).reshape(-1)
    if r.numel() != b:
        raise ValueError(f"request_ids has {r.numel()} entries for a batch of {b}")
    return r


def _entry_bad(entries: torch.Tensor, num_pages: int, owner: torch.Tensor | None, rid: torch.Tensor) -> torch.Tensor:
    """entries int [B, n] -> bool [B, n]: out of [0, P) or not owned by rid[b]."""
    e = entries.to(torch.int64)
    bad = (e < 0) | (e >= num_pages)
    if owner is not None:
        own = owner.to(torch.int64)[e.clamp(0, num_pages - 1)]  # [B, n]
        bad |= own != rid.to(torch.int64)[:, None]
    return bad


def block_table_violations_ref(block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int,
                               num_pages: int, owner: torch.Tensor | None = None,
                               request_ids=None) -> torch.Tensor:
    """Which requests' reads would violate the page ownership rules. -> bool [B]."""
    b, max_pages = block_tables.shape
    rid = _rid_tensor(request_ids, b, block_tables.device)
    ctx = context_lens.to(torch.int64)
    need = (ctx + page_size - 1).div(page_size, rounding_mode="floor")  # [B] pages read
    used = torch.arange(max_pages, device=ctx.device)[None, :] < need[:, None]  # [B, max_pages]
    bad = _entry_bad(block_tables, num_pages, owner, rid) & used
    return bad.any(1) | (need > max_pages) | (ctx < 0)


def _write_violations_ref(block_tables, positions, page_size, num_pages, owner, rid):
    """(bad bool [B], page int64 [B] safe to index where not bad) for one written position per request."""
    b, max_pages = block_tables.shape
    pos = positions.to(torch.int64)
    pidx = pos.div(page_size, rounding_mode="floor")
    in_tab = (pos >= 0) & (pidx < max_pages)
    entry = block_tables.to(torch.int64).gather(1, pidx.clamp(0, max_pages - 1)[:, None])  # [B, 1]
    bad = ~in_tab | _entry_bad(entry, num_pages, owner, rid)[:, 0]
    return bad, torch.where(bad, 0, entry[:, 0])


# --------------------------------------------------------------------------------------------------
# attention: reference
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Operands:
    """One attention form as the shared kernel takes it: query parts [B, Hq, Di], the cache parts they
    score against [P, S, Hkv, Di] (scores sum over parts), the value cache [P, S, Hkv, Dv], and the
    scales of K and V. v_is_k: V is the first K part (the MLA latent), so the kernel reuses its tile."""

    q: tuple[torch.Tensor, ...]
    k: tuple[torch.Tensor, ...]
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    v_is_k: bool


def _gqa_operands(q: torch.Tensor, kv: PagedKV) -> _Operands:
    return _Operands((q,), (kv.k_cache,), kv.v_cache, kv.k_scale, kv.v_scale, False)


def _mla_operands(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: PagedKV) -> _Operands:
    """scores = q_nope . c[:L] + q_pe . c[L:], values c[:L], one scale for the whole latent."""
    c = _latent4(kv.k_cache)
    lr = q_nope.shape[-1]
    return _Operands((q_nope, q_pe), (c[..., :lr], c[..., lr:]), c[..., :lr], kv.k_scale, kv.k_scale, True)


def _attend_ref(ops: _Operands, kv: PagedKV, context_lens: torch.Tensor, *, sm_scale: float, check: bool):
    """Generic paged decode attention in fp32 over kv's block tables and owner table.

    Returns (out [B, Hq, Dv] in the queries' dtype, violated bool [B])."""
    q0, k0 = ops.q[0], ops.k[0]
    b, hq = q0.shape[:2]
    num_pages, page_size, hkv = k0.shape[:3]
    g = hq // hkv
    dev = q0.device
    block_tables = kv.block_tables
    rid = _rid_tensor(kv.request_ids, b, dev)
    if check:
        violated = block_table_violations_ref(block_tables, context_lens, page_size, num_pages, kv.owner, rid)
    else:
        violated = torch.zeros(b, dtype=torch.bool, device=dev)
    ks = _scale_vector(ops.k_scale, hkv, dev).view(1, -1, 1)  # [1, 1 or Hkv, 1]
    vs = _scale_vector(ops.v_scale, hkv, dev).view(1, -1, 1)
    out = torch.zeros((b, hq, ops.v.shape[-1]), dtype=torch.float32, device=dev)
    for i in range(b):
        t = int(context_lens[i])
        if violated[i] or t <= 0:
            continue
        pages = block_tables[i, : math.ceil(t / page_size)].to(torch.int64)
        scores = 0.0
        for qp, kp in zip(ops.q, ops.k):
            k = (kp[pages].flatten(0, 1)[:t].to(torch.float32) * ks)  # [T, Hkv, Di]
            qg = qp[i].to(torch.float32).view(hkv, g, -1)  # [Hkv, G, Di]
            scores = scores + torch.einsum("hgd,thd->hgt", qg, k)  # [Hkv, G, T]
        p = torch.softmax(scores * sm_scale, dim=-1)
        v = ops.v[pages].flatten(0, 1)[:t].to(torch.float32) * vs  # [T, Hkv, Dv]
        out[i] = torch.einsum("hgt,thd->hgd", p, v).reshape(hq, -1)
    return out.to(q0.dtype), violated


def paged_decode_attention_ref(q: torch.Tensor, kv: PagedKV, context_lens: torch.Tensor, *,
                               sm_scale: float | None = None, check: bool = True):
    """Torch reference of paged_decode_attention (same arguments, no backend)."""
    _validate_gqa(q, kv, context_lens)
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _attend_ref(_gqa_operands(q, kv), kv, context_lens, sm_scale=sm, check=check)


def _latent4(latent_cache: torch.Tensor) -> torch.Tensor:
    """[P, S, L+R] or [P, S, 1, L+R] -> [P, S, 1, L+R] view."""
    if latent_cache.ndim == 3:
        return latent_cache.unsqueeze(2)
    if latent_cache.ndim == 4 and latent_cache.shape[2] == 1:
        return latent_cache
    raise ValueError(f"latent cache must be [P, S, L+R] (or [P, S, 1, L+R]), got {list(latent_cache.shape)}")


def paged_mla_decode_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: PagedKV,
                                   context_lens: torch.Tensor, *, sm_scale: float, check: bool = True):
    """Torch reference of paged_mla_decode_attention (same arguments, no backend)."""
    _validate_mla(q_nope, q_pe, kv, context_lens)
    return _attend_ref(_mla_operands(q_nope, q_pe, kv), kv, context_lens, sm_scale=sm_scale, check=check)


def _validate_tables(b, block_tables, context_lens):
    if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [{b}, max_pages], got {block_tables.dtype} "
                         f"{list(block_tables.shape)}")
    if context_lens.shape != (b,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32 [{b}], got {context_lens.dtype} {list(context_lens.shape)}")


def _validate_gqa(q, kv: PagedKV, context_lens):
    k_cache, v_cache = kv.k_cache, kv.v_cache
    _check_cache(k_cache, "k_cache")
    if v_cache is None:
        raise ValueError("a GQA cache needs v_cache (an MLA latent cache goes to paged_mla_decode_attention)")
    _check_cache(v_cache, "v_cache")
    b, hq, d = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[-1] != d:
        raise ValueError(f"k_cache/v_cache must both be [P, S, Hkv, {d}], got {list(k_cache.shape)} / "
                         f"{list(v_cache.shape)}")
    if hq % k_cache.shape[2]:
        raise ValueError(f"{hq} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    _validate_tables(b, kv.block_tables, context_lens)


def _validate_mla(q_nope, q_pe, kv: PagedKV, context_lens):
    if kv.v_cache is not None or kv.v_scale is not None:
        raise ValueError("an MLA latent cache has no v_cache or v_scale: the latent is k_cache, its scale k_scale")
    c = _latent4(kv.k_cache)
    _check_cache(c, "latent_cache")
    b, h, lr = q_nope.shape
    if q_pe.shape[:2] != (b, h) or lr + q_pe.shape[-1] != c.shape[-1]:
        raise ValueError(f"q_nope [B, H, L] + q_pe [B, H, R] must match the latent width {c.shape[-1]}")
    _validate_tables(b, kv.block_tables, context_lens)


# --------------------------------------------------------------------------------------------------
# attention: Triton
# --------------------------------------------------------------------------------------------------
if triton is not None:
    from ._triton import cast_rne

    @triton.jit
    def _paged_attn_kernel(q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, o_ptr, bt_ptr, ctx_ptr, owner_ptr, rid_ptr,
                           flag_ptr, ks_ptr, vs_ptr, sm_scale, num_pages, max_pages, G,
                           stride_q1b, stride_q1h, stride_q2b, stride_q2h, stride_kp, stride_ks, stride_kh,
                           stride_vp, stride_vs, stride_vh, stride_ob, stride_oh, stride_bt, scale_stride,
                           PAGE_SIZE: tl.constexpr, PAGE_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                           D1: tl.constexpr, D1_PAD: tl.constexpr, D2: tl.constexpr, D2_PAD: tl.constexpr,
                           DV: tl.constexpr, DV_PAD: tl.constexpr, HAS_Q2: tl.constexpr, V_IS_K1: tl.constexpr,
                           CHECK: tl.constexpr, HAS_OWNER: tl.constexpr, DOT_F32: tl.constexpr):
        # grid: (B, Hkv, head blocks of the G query heads sharing KV head kvh); one page per step,
        # online softmax (Milakov & Gimelshein 2018) in fp32.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        hl = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH] head within the group
        h_ok = hl < G
        h = kvh * G + hl  # [BH] query head
        d1 = tl.arange(0, D1_PAD)
        q1 = tl.load(q1_ptr + b * stride_q1b + h[:, None] * stride_q1h + d1[None, :],
                     mask=h_ok[:, None] & (d1[None, :] < D1), other=0.0).to(tl.float32)  # [BH, D1P]
        if HAS_Q2:
            d2 = tl.arange(0, D2_PAD)
            q2 = tl.load(q2_ptr + b * stride_q2b + h[:, None] * stride_q2h + d2[None, :],
                         mask=h_ok[:, None] & (d2[None, :] < D2), other=0.0).to(tl.float32)  # [BH, D2P]
        if not DOT_F32:  # tensor-core operands; held in bf16 across the loop (fewer registers)
            q1 = q1.to(tl.bfloat16)
            if HAS_Q2:
                q2 = q2.to(tl.bfloat16)
        dv = tl.arange(0, DV_PAD)

        ctx = tl.load(ctx_ptr + b)
        n_pages = (ctx + PAGE_SIZE - 1) // PAGE_SIZE
        bad = (ctx < 0).to(tl.int32)
        if CHECK:
            bad = tl.maximum(bad, (n_pages > max_pages).to(tl.int32))
            n_pages = tl.minimum(n_pages, max_pages)
        if HAS_OWNER:
            rid = tl.load(rid_ptr + b)
        qk_scale = sm_scale * tl.load(ks_ptr + kvh * scale_stride)
        v_scale = tl.load(vs_ptr + kvh * scale_stride)

        slot = tl.arange(0, PAGE_PAD)
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, DV_PAD), dtype=tl.float32)
        for p in range(0, n_pages):
            page = tl.load(bt_ptr + b * stride_bt + p)
            tok_ok = (slot < PAGE_SIZE) & (p * PAGE_SIZE + slot < ctx)  # [PP]
            if CHECK:
                ok = (page >= 0) & (page < num_pages)
                if HAS_OWNER:
                    ok = ok & (tl.load(owner_ptr + tl.where(ok, page, 0)) == rid)
                bad = tl.maximum(bad, 1 - ok.to(tl.int32))
                page = tl.where(ok, page, 0)  # never dereference a bad entry
                tok_ok = tl.where(ok, tok_ok, False)  # (vector & scalar is mistyped by the interpreter)
            kbase = page.to(tl.int64) * stride_kp + kvh * stride_kh
            k1 = tl.load(k1_ptr + kbase + slot[:, None] * stride_ks + d1[None, :],
                         mask=tok_ok[:, None] & (d1[None, :] < D1), other=0.0).to(tl.float32)  # [PP, D1P]
            if DOT_F32:
                s = tl.dot(q1, tl.trans(k1))  # [BH, PP]
            else:
                s = tl.dot(q1, tl.trans(k1.to(tl.bfloat16)))
            if HAS_Q2:
                k2 = tl.load(k2_ptr + kbase + slot[:, None] * stride_ks + d2[None, :],
                             mask=tok_ok[:, None] & (d2[None, :] < D2), other=0.0).to(tl.float32)  # [PP, D2P]
                if DOT_F32:
                    s += tl.dot(q2, tl.trans(k2))
                else:
                    s += tl.dot(q2, tl.trans(k2.to(tl.bfloat16)))
            s = tl.where(tok_ok[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked page adds nothing
            alpha = tl.exp(m_i - m_safe)
            pr = tl.exp(s - m_safe[:, None])  # [BH, PP]
            l_i = l_i * alpha + tl.sum(pr, 1)
            if V_IS_K1:
                v = k1
            else:
                vbase = page.to(tl.int64) * stride_vp + kvh * stride_vh
                v = tl.load(v_ptr + vbase + slot[:, None] * stride_vs + dv[None, :],
                            mask=tok_ok[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)  # [PP, DVP]
            if DOT_F32:
                acc = acc * alpha[:, None] + tl.dot(pr, v)
            else:
                acc = acc * alpha[:, None] + tl.dot(pr.to(tl.bfloat16), v.to(tl.bfloat16))
            m_i = m_new
        denom = tl.where(l_i > 0, l_i, 1.0)
        out = acc * (v_scale / denom)[:, None]  # [BH, DVP]
        o_mask = h_ok[:, None] & (dv[None, :] < DV)
        tl.store(o_ptr + b * stride_ob + h[:, None] * stride_oh + dv[None, :],
                 cast_rne(out, o_ptr.dtype.element_ty), mask=o_mask)
        if CHECK:
            tl.store(flag_ptr + b, bad, mask=bad > 0)

    @triton.jit
    def _kv_write_kernel(x_ptr, c_ptr, bt_ptr, pos_ptr, owner_ptr, rid_ptr, flag_ptr, s_ptr,
                         num_pages, max_pages, H, stride_xb, stride_xh, stride_cp, stride_cs, stride_ch,
                         stride_bt, scale_stride, D: tl.constexpr, D_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         BLOCK_H: tl.constexpr, QUANT: tl.constexpr, CHECK: tl.constexpr,
                         HAS_OWNER: tl.constexpr):
        # grid: (B,). Writes the token at positions[b] of request b: all heads, one slot.
        b = tl.program_id(0)
        pos = tl.load(pos_ptr + b)
        pidx = pos // PAGE_SIZE
        slot = pos % PAGE_SIZE
        ok = (pos >= 0) & (pidx < max_pages)
        page = tl.load(bt_ptr + b * stride_bt + tl.where(ok, pidx, 0))
        if CHECK:
            ok = ok & (page >= 0) & (page < num_pages)
            if HAS_OWNER:
                ok = ok & (tl.load(owner_ptr + tl.where(ok, page, 0)) == tl.load(rid_ptr + b))
            tl.store(flag_ptr + b, 1 - ok.to(tl.int32), mask=ok == 0)
            page = tl.where(ok, page, 0)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D_PAD)
        mask = (h[:, None] < H) & (d[None, :] < D)
        x = tl.load(x_ptr + b * stride_xb + h[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)  # [BH, DP]
        if QUANT:
            sc = tl.load(s_ptr + h * scale_stride, mask=h < H, other=1.0)  # [BH]
            x = tl.math.div_rn(x, sc[:, None])  # IEEE division, as torch does
        dst = c_ptr + page.to(tl.int64) * stride_cp + slot * stride_cs + h[:, None] * stride_ch + d[None, :]
        tl.store(dst, cast_rne(x, c_ptr.dtype.element_ty), mask=tl.where(ok, mask, False))


def _attn_launch(ops: _Operands, kv: PagedKV, context_lens: torch.Tensor, *, sm_scale: float, check: bool):
    """The Triton kernel over the operands of one attention form. -> (out [B, Hq, Dv], violated bool [B])."""
    q1, k1, v = ops.q[0], ops.k[0], ops.v
    q2, k2 = (ops.q[1], ops.k[1]) if len(ops.k) > 1 else (None, None)
    b, hq, d1 = q1.shape
    num_pages, page_size, hkv = k1.shape[:3]
    g = hq // hkv
    dvd = v.shape[-1]
    dev = q1.device
    rid = _rid_tensor(kv.request_ids, b, dev)
    ks = _scale_vector(ops.k_scale, hkv, dev)
    vs = _scale_vector(ops.v_scale, hkv, dev)
    if ks.numel() != vs.numel():  # one per-tensor, one per-head: give both one entry per head
        ks, vs = ks.expand(hkv).contiguous(), vs.expand(hkv).contiguous()
    scale_stride = 1 if ks.numel() > 1 else 0
    for t in (k1, v) + ((k2,) if k2 is not None else ()):
        if t.stride(-1) != 1:
            raise ValueError("KV caches must be contiguous in the head dim")
    if k2 is not None and k2.stride()[:3] != k1.stride()[:3]:
        raise ValueError("the two K parts must share strides")
    q1 = q1.contiguous()
    q2 = q2.contiguous() if q2 is not None else q1
    out = torch.empty((b, hq, dvd), dtype=q1.dtype, device=dev)
    flags = torch.zeros(b, dtype=torch.int32, device=dev)
    bt = kv.block_tables.contiguous()
    ctx = context_lens.contiguous()
    own = kv.owner.to(torch.int32).contiguous() if kv.owner is not None else flags
    interp = dev.type != "cuda"
    block_h = max(16, next_pow2(g)) if interp else 16 if g <= 16 else 32
    page_pad = max(16, next_pow2(page_size))
    d2 = q2.shape[-1] if k2 is not None else 1
    grid = (b, hkv, triton.cdiv(g, block_h))
    _paged_attn_kernel[grid](
        q1, q2, k1, k2 if k2 is not None else k1, v, out, bt, ctx, own, rid, flags, ks, vs,
        float(sm_scale), num_pages, bt.shape[1], g,
        q1.stride(0), q1.stride(1), q2.stride(0), q2.stride(1), k1.stride(0), k1.stride(1), k1.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), bt.stride(0), scale_stride,
        PAGE_SIZE=page_size, PAGE_PAD=page_pad, BLOCK_H=block_h,
        D1=d1, D1_PAD=max(16, next_pow2(d1)), D2=d2, D2_PAD=max(16, next_pow2(d2)),
        DV=dvd, DV_PAD=max(16, next_pow2(dvd)), HAS_Q2=k2 is not None, V_IS_K1=ops.v_is_k,
        CHECK=bool(check), HAS_OWNER=bool(check) and kv.owner is not None, DOT_F32=dot_f32(),
        num_warps=4 if d1 <= 128 else 8,
    )
    return out, flags.bool()


def paged_decode_attention(q: torch.Tensor, kv: PagedKV, context_lens: torch.Tensor, *,
                           sm_scale: float | None = None, check: bool = True,
                           backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per request against its paged context (GQA/MHA).

    q [B, Hq, D] bf16/fp16; kv: k_cache, v_cache [P, S, Hkv, D] bf16/fp16/fp8_e4m3fn, block_tables int32
    [B, max_pages], k_scale, v_scale fp32 [1] or [Hkv, 1, 1] (FP8), owner int32 [P], request_ids int [B]
    (default 0..B-1); context_lens int32 [B] (tokens to attend, including the one just written);
    sm_scale default 1/sqrt(D). -> (out [B, Hq, D] q.dtype, violated bool [B])."""
    _validate_gqa(q, kv, context_lens)
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if resolve_backend(backend, q.device) == "torch":
        return paged_decode_attention_ref(q, kv, context_lens, sm_scale=sm, check=check)
    return _attn_launch(_gqa_operands(q, kv), kv, context_lens, sm_scale=sm, check=check)


def paged_mla_decode_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: PagedKV, context_lens: torch.Tensor,
                               *, sm_scale: float, check: bool = True,
                               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode in the absorbed form over a paged latent cache.

    q_nope [B, H, L] (already multiplied by W_UK), q_pe [B, H, R] (rotated); kv: k_cache the latent
    [P, S, L+R] (or [P, S, 1, L+R]), v_cache None, k_scale fp32 [1] for the whole latent (FP8), v_scale
    None; sm_scale as the model defines it (DeepSeek: mscale^2 / sqrt(qk_nope + qk_rope)).
    -> (out [B, H, L], violated [B])."""
    _validate_mla(q_nope, q_pe, kv, context_lens)
    if kv.k_scale is not None and kv.k_scale.numel() != 1:
        raise ValueError("the MLA latent takes one scale ([1]) for the whole latent")
    if resolve_backend(backend, q_nope.device) == "torch":
        return paged_mla_decode_attention_ref(q_nope, q_pe, kv, context_lens, sm_scale=sm_scale, check=check)
    return _attn_launch(_mla_operands(q_nope, q_pe, kv), kv, context_lens, sm_scale=sm_scale, check=check)


# --------------------------------------------------------------------------------------------------
# cache append
# --------------------------------------------------------------------------------------------------
def _heads4(cache: torch.Tensor) -> torch.Tensor:
    """A cache as [P, S, H, D]: an MLA latent [P, S, L+R] gains its one 'head'."""
    return cache.unsqueeze(2) if cache.ndim == 3 else cache


def _write_pairs(k_new, v_new, kv: PagedKV, k_cache: torch.Tensor):
    """(new values, cache [P, S, H, D], scale) for K and, where the cache has one, V."""
    return [(k_new, k_cache, kv.k_scale)] + ([(v_new, kv.v_cache, kv.v_scale)] if kv.v_cache is not None else [])


def write_kv_cache_ref(k_new: torch.Tensor, v_new: torch.Tensor | None, kv: PagedKV, positions: torch.Tensor, *,
                       check: bool = True) -> torch.Tensor:
    """Torch reference of write_kv_cache: writes in place, returns violated bool [B]."""
    b = k_new.shape[0]
    k_cache = _heads4(kv.k_cache)
    rid = _rid_tensor(kv.request_ids, b, k_new.device)
    num_pages, page_size = k_cache.shape[:2]
    if check:
        bad, page = _write_violations_ref(kv.block_tables, positions, page_size, num_pages, kv.owner, rid)
    else:
        bad = torch.zeros(b, dtype=torch.bool, device=k_new.device)
        pos = positions.to(torch.int64)
        page = kv.block_tables.to(torch.int64).gather(1, pos.div(page_size, rounding_mode="floor")[:, None])[:, 0]
    slot = positions.to(torch.int64) % page_size
    keep = ~bad
    for x, cache, scale in _write_pairs(k_new, v_new, kv, k_cache):
        vals = quantize_kv(x.view(b, *cache.shape[2:]), scale, cache.dtype)  # [B, H, D]
        cache[page[keep], slot[keep]] = vals[keep]
    return bad


def write_kv_cache(k_new: torch.Tensor, v_new: torch.Tensor | None, kv: PagedKV, positions: torch.Tensor, *,
                   check: bool = True, backend: str = "auto") -> torch.Tensor:
    """Append one token per request: k_new/v_new [B, Hkv, D] go to slot positions[b] of request b
    (v_new and kv.v_cache None for an MLA latent cache [P, S, 1, L+R] with k_new [B, 1, L+R]).
    In place; FP8 caches quantize with kv.k_scale / kv.v_scale. With check=True a write whose table
    entry is out of range or not owned by the request is skipped and flagged. -> violated bool [B]."""
    _check_cache(kv.k_cache, "k_cache")
    b = k_new.shape[0]
    k_cache = _heads4(kv.k_cache)
    block_tables = kv.block_tables
    if positions.shape != (b,) or positions.dtype != torch.int32:
        raise ValueError(f"positions must be int32 [{b}]")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [{b}, max_pages]")
    if resolve_backend(backend, k_new.device) == "torch":
        return write_kv_cache_ref(k_new, v_new, kv, positions, check=check)
    dev = k_new.device
    rid = _rid_tensor(kv.request_ids, b, dev)
    flags = torch.zeros(b, dtype=torch.int32, device=dev)
    bt, pos = block_tables.contiguous(), positions.contiguous()
    own = kv.owner.to(torch.int32).contiguous() if kv.owner is not None else flags
    num_pages, page_size, h, d = k_cache.shape
    for x, cache, scale in _write_pairs(k_new, v_new, kv, k_cache):
        _check_cache(cache, "cache")
        if cache.stride(-1) != 1:
            raise ValueError("KV caches must be contiguous in the head dim")
        x = x.reshape(b, h, d).contiguous()
        s = _scale_vector(scale, h, dev)
        _kv_write_kernel[(b,)](
            x, cache, bt, pos, own, rid, flags, s, num_pages, bt.shape[1], h,
            x.stride(0), x.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), bt.stride(0),
            1 if s.numel() > 1 else 0, D=d, D_PAD=next_pow2(d), PAGE_SIZE=page_size,
            BLOCK_H=next_pow2(h), QUANT=cache.dtype == FP8_DTYPE, CHECK=bool(check),
            HAS_OWNER=bool(check) and kv.owner is not None,
        )
    return flags.bool()
