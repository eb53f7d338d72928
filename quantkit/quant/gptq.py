"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"), batched over experts: every tensor carries a leading expert dim E, so one call quantizes
all routed experts of a layer with batched Cholesky factorizations and batched updates — no Python loop
over modules.

Legend: E = experts (batch), N = out_features, K = in_features, B = block (lazy-update width), g = group.

Algorithm (per matrix, all of them at once):
- dead inputs (H_ii == 0) get H_ii = 1 and their weight columns zeroed;
- damping `damp * mean(diag H)` on the diagonal; if the Cholesky factorization fails the damping is
  multiplied by 10 (up to `max_retries` times) for the failing matrices only, then as a last resort H is
  replaced by its diagonal (which makes GPTQ reduce to RTN with error feedback off) — recorded per matrix;
- columns are swept in blocks of B: quantize column i, error e = (w - q) / U_ii with U the upper Cholesky
  factor of H^-1, push e onto the remaining columns of the block, and apply the block's accumulated error
  to all later columns at the end of the block (lazy batch update);
- group parameters are chosen when the sweep reaches a group's first column, from the already-updated
  weights (groups align with blocks: B is a multiple of g);
- act-order with static groups: columns are visited by descending diag(H), but every group's parameters
  are computed up front from the original weights in natural order, so the stored layout needs no g_idx;
- other grids (FP4): the caller fixes every group's scale up front (`static_scale`, e.g. NVFP4's two-level
  scales, whose global scale spans the whole matrix) and quantizes a column onto its grid
  (`quantize_column(w_col, scale) -> (codes, dequantized)`); the sweep and the error feedback are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .int4 import QParams, choose_qparams, qrange


@dataclass(frozen=True)
class GPTQResult:
    q: torch.Tensor  # [E, N, K] int8, natural column order
    qparams: QParams  # scale [E, N, G] float32 (rounded to the storage dtype), zero_point [E, N, G] | None
    damping: torch.Tensor  # [E] relative damping finally used
    fallback: list[str | None]  # per matrix: None, or why H was replaced by its diagonal
    dead_columns: torch.Tensor  # [E] number of inputs never seen (H_ii == 0)


def _cholesky_inverse_upper(h: torch.Tensor, damp: float, max_retries: int):
    """Upper Cholesky factor of (H + d*I)^-1 for a batch [E, K, K], retrying with more damping where the
    factorization fails. Returns (U, damping used [E], fallback reasons)."""
    e, k, _ = h.shape
    diag_mean = torch.diagonal(h, dim1=-2, dim2=-1).mean(-1)  # [E]
    rel = torch.full((e,), float(damp), dtype=h.dtype, device=h.device)
    u = torch.empty_like(h)
    todo = torch.arange(e, device=h.device)
    fallback: list[str | None] = [None] * e
    for attempt in range(max_retries + 1):
        hd = h[todo] if todo.numel() < e else h.clone()
        hd.diagonal(dim1=-2, dim2=-1).add_((rel[todo] * diag_mean[todo])[:, None])
        l, info = torch.linalg.cholesky_ex(hd)
        del hd  # each [E, K, K] float64 temporary is dropped as soon as it is used
        ok = info == 0
        if ok.any():
            hinv = torch.cholesky_inverse(l if bool(ok.all()) else l[ok])
            del l
            uu, info2 = torch.linalg.cholesky_ex(hinv, upper=True)
            del hinv
            ok_idx = ok.nonzero().flatten()
            good = info2 == 0
            u[todo[ok_idx[good]]] = uu[good]
            del uu
            ok[ok_idx[~good]] = False
        else:
            del l
        todo = todo[~ok]
        if todo.numel() == 0:
            break
        if attempt < max_retries:
            rel[todo] *= 10
    for i in todo.tolist():  # last resort: a diagonal Hessian (always positive definite)
        d = torch.diagonal(h[i]).clamp(min=torch.finfo(h.dtype).tiny) * (1 + rel[i])
        u[i] = torch.diag(d.rsqrt())
        fallback[i] = f"cholesky failed at damping {rel[i].item():.3g}; used diag(H)"
    return u, rel, fallback


def gptq(w: torch.Tensor, h: torch.Tensor, num_bits: int = 4, group_size: int | None = 32, symmetric: bool = True,
         *, damp: float = 0.01, block_size: int = 128, actorder: bool = False, max_retries: int = 4,
         scale_dtype: torch.dtype = torch.bfloat16, static_scale: torch.Tensor | None = None,
         quantize_column: Callable | None = None, solve_dtype: torch.dtype = torch.float64) -> GPTQResult:
    """Quantize weights w [E, N, K] (or [N, K]) given Hessians h [E, K, K] (or [K, K]) = 2/n * sum x x^T.
    `static_scale` [E, N, G] float32 + `quantize_column`: another grid with scales fixed up front (FP4);
    the result's q then holds that grid's codes and its qparams the given scales. `solve_dtype`: what the
    Hessian is factorized in (float64 on the CPU; float32 on a GPU, where float64 is slow). Every tensor
    lives on w's device."""
    squeeze = w.ndim == 2
    if squeeze:
        w, h = w[None], h[None]
    e, n, k = w.shape
    gs = k if group_size is None else group_size
    if k % gs:
        raise ValueError(f"in_features {k} is not a multiple of group_size {gs}")
    if group_size is not None and block_size % gs:
        block_size = max(gs, block_size - block_size % gs)  # keep group boundaries on block boundaries
    qmin, qmax = qrange(num_bits)
    W = w.float().clone()
    dev = W.device
    H = h.to(device=dev, dtype=solve_dtype)  # float64 on the CPU: tiny models and fp32 Hessians of real ones benefit
    if H.data_ptr() == h.data_ptr():
        H = H.clone()  # modified below (dead columns); the caller's Hessian stays as it was

    diag = torch.diagonal(H, dim1=-2, dim2=-1)
    dead = diag == 0  # [E, K]
    diag[dead] = 1.0
    W.masked_fill_(dead[:, None, :], 0.0)

    static = None
    if static_scale is not None:
        static = QParams(static_scale.reshape(e, n, -1).float(), None)
        group_of = (torch.arange(k, device=dev) // gs).expand(e, k)  # natural order, unless act-order permutes below
    if actorder:
        perm = torch.argsort(torch.diagonal(H, dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)  # [E, K]
        if static is None:
            static = choose_qparams(W, num_bits, group_size, symmetric, scale_dtype)  # natural-order groups
        W = torch.gather(W, 2, perm[:, None, :].expand(e, n, k))
        H = torch.gather(torch.gather(H, 1, perm[:, :, None].expand(e, k, k)), 2, perm[:, None, :].expand(e, k, k))
        group_of = torch.div(perm, gs, rounding_mode="floor")  # [E, K] natural group of each visited column

    U, rel, fallback = _cholesky_inverse_upper(H, damp, max_retries)
    del H, diag
    U = U.float()

    groups = k // gs
    scale = torch.empty(e, n, groups, device=dev)
    zp = None if symmetric else torch.empty(e, n, groups, dtype=torch.int32, device=dev)
    Q = torch.empty(e, n, k, device=dev)
    cur_s = cur_z = None
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, :, i1:i2].clone()
        Err1 = torch.empty_like(W1)
        Hinv1 = U[:, i1:i2, i1:i2]  # [E, B, B]
        for i in range(i2 - i1):
            col = i1 + i
            if static is None and col % gs == 0:  # group params from the already-updated weights
                qp = choose_qparams(W1[:, :, i:i + gs], num_bits, None, symmetric, scale_dtype)
                cur_s, cur_z = qp.scale[..., 0], None if qp.zero_point is None else qp.zero_point[..., 0]
                scale[:, :, col // gs] = cur_s
                if zp is not None:
                    zp[:, :, col // gs] = cur_z
            if static is not None:
                gidx = group_of[:, col]  # [E]
                cur_s = torch.gather(static.scale, 2, gidx[:, None, None].expand(e, n, 1))[..., 0]
                cur_z = (None if static.zero_point is None else
                         torch.gather(static.zero_point, 2, gidx[:, None, None].expand(e, n, 1))[..., 0])
            wcol = W1[:, :, i]  # [E, N]
            if quantize_column is not None:
                q, deq = quantize_column(wcol, cur_s)
                Q[:, :, col] = q.float()
            else:
                q = torch.round(wcol / cur_s)
                if cur_z is not None:
                    q = q + cur_z
                q = q.clamp_(qmin, qmax)
                Q[:, :, col] = q
                deq = (q - cur_z) * cur_s if cur_z is not None else q * cur_s
            err = (wcol - deq) / Hinv1[:, i, i][:, None]  # [E, N]
            W1[:, :, i:] -= err[:, :, None] * Hinv1[:, None, i, i:]
            Err1[:, :, i] = err
        if i2 < k:
            W[:, :, i2:] -= torch.bmm(Err1, U[:, i1:i2, i2:])  # lazy batch update of all later columns

    if actorder:
        inv = torch.argsort(perm, dim=-1)
        Q = torch.gather(Q, 2, inv[:, None, :].expand(e, n, k))
    if static is not None:
        scale, zp = static.scale, static.zero_point
    q8 = Q.to(torch.int8 if quantize_column is None else torch.uint8)
    qp = QParams(scale, zp)
    if squeeze:
        q8, qp = q8[0], QParams(scale[0], None if zp is None else zp[0])
    return GPTQResult(q8, qp, rel.float(), fallback, dead.sum(-1))


def hessian_update(h: torch.Tensor | None, count: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Running mean H = 2/n * sum x x^T over tokens, x [T, K] (float32 accumulation)."""
    x = x.reshape(-1, x.shape[-1]).float()
    t = x.shape[0]
    if h is None:
        h = torch.zeros(x.shape[-1], x.shape[-1])
    if t == 0:
        return h, count
    h *= count / (count + t)
    count += t
    x = x * (2.0 / count) ** 0.5
    h += x.T @ x
    return h, count
