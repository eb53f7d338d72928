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

from dataclasses import dataclass, replace
from typing import Callable

import torch

from .int4 import (QParams, choose_qparams, choose_qparams_mse, native_available, optional_native, qrange,
                   run_rows)


@dataclass(frozen=True)
class GPTQResult:
    q: torch.Tensor  # [E, N, K] int8, natural column order
    qparams: QParams  # scale [E, N, G] float32 (rounded to the storage dtype), zero_point [E, N, G] | None
    damping: torch.Tensor  # [E] relative damping finally used
    fallback: list[str | None]  # per matrix: None, or why H was replaced by its diagonal
    dead_columns: torch.Tensor  # [E] number of inputs never seen (H_ii == 0)
    target: torch.Tensor | None = None  # with `fit`: the weights quantized [E, N, K] float32 (see gptq)


# Blocks of at most this order are factorized and inverted by LAPACK; larger ones recursively, from two
# half-size blocks and matrix products (LAPACK's batched Cholesky and triangular solve run at ~1/5 of the
# float64 GEMM rate on a CPU core for K <= 512; the recursion puts nearly all of the work into GEMMs).
CHOLESKY_BLOCK = 64


def _inverse_cholesky(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L^-1, ok) for a batch [E, K, K] of symmetric matrices, L L^T = H lower triangular: L^-1 is lower
    triangular, ok [E] bool says where the factorization succeeded (elsewhere L^-1 is meaningless).

    With H = [[A, B^T], [B, C]], A = L1 L1^T: L = [[L1, 0], [B L1^-T, L2]] where L2 L2^T = C - (B L1^-T)(B L1^-T)^T,
    and L^-1 = [[L1^-1, 0], [-L2^-1 (B L1^-T) L1^-1, L2^-1]]. A matrix that fails leaves the others' results as
    they are."""
    k = h.shape[-1]
    if k <= CHOLESKY_BLOCK:
        l, info = torch.linalg.cholesky_ex(h)
        eye = torch.eye(k, dtype=h.dtype, device=h.device)
        return torch.linalg.solve_triangular(l, eye.expand(h.shape[0], k, k), upper=False), info == 0
    m = k // 2
    a_inv, ok_a = _inverse_cholesky(h[:, :m, :m])
    l21 = h[:, m:, :m] @ a_inv.mT  # B L1^-T
    d_inv, ok_d = _inverse_cholesky(torch.baddbmm(h[:, m:, m:], l21, l21.mT, alpha=-1))
    out = torch.zeros_like(h)
    out[:, :m, :m] = a_inv
    out[:, m:, m:] = d_inv
    torch.matmul(d_inv, l21 @ a_inv, out=out[:, m:, :m])
    out[:, m:, :m].neg_()
    return out, ok_a & ok_d


def _permute_rows(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x[i][order[i]] for a batch x [E, K, N] and orders [E, K], written straight into the result."""
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        torch.index_select(x[i], 0, order[i], out=out[i])
    return out


def _reversed_symmetric(h: torch.Tensor, order: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """J P H P^T J in `dtype` for a batch h [E, K, K]: P the permutation `order` [E, K] (None: identity), J
    the reversal. One copy per matrix through two reused [K, K] buffers (no batch-sized temporaries)."""
    if order is None:
        return h.flip(-2, -1).to(dtype)
    e, k, _ = h.shape
    rev = order.flip(-1)
    out = torch.empty(e, k, k, dtype=dtype, device=h.device)
    rows, both = h.new_empty(k, k), h.new_empty(k, k)
    for i in range(e):
        torch.index_select(h[i], 0, rev[i], out=rows)
        out[i].copy_(torch.index_select(rows, 1, rev[i], out=both))
    return out


def cholesky_inverse_upper(h: torch.Tensor, damp: float, max_retries: int, out_dtype: torch.dtype | None = None,
                            *, order: torch.Tensor | None = None, dead: torch.Tensor | None = None,
                            solve_dtype: torch.dtype | None = None):
    """Upper Cholesky factor U of (H + d*I)^-1 (U^T U = (H + d*I)^-1) for a batch [E, K, K], retrying with
    more damping where the factorization fails. Returns (U in `out_dtype` (default: H's), damping used [E],
    fallback reasons). H is not modified. `order` [E, K]: factorize P H P^T instead (P that permutation; U is
    then in that order); `dead` [E, K] bool: diagonal entries (natural order) taken as 1; `solve_dtype`:
    what H is factorized in (default: its own dtype).

    With J the reversal permutation, J H J = L L^T gives H^-1 = (J L^-1 J)^T (J L^-1 J), and J L^-1 J is
    upper triangular: one Cholesky factorization with its triangular inverse (_inverse_cholesky, recursive
    in GEMMs), instead of a factorization, an explicit inverse and a second factorization of it."""
    e, k, _ = h.shape
    solve = h.dtype if solve_dtype is None else solve_dtype
    out_dtype = solve if out_dtype is None else out_dtype
    diag = torch.diagonal(h, dim1=-2, dim2=-1).to(solve)  # [E, K], natural order
    if dead is not None:
        diag = diag.masked_fill(dead, 1.0)
    if order is not None:
        diag = torch.gather(diag, 1, order)
    diag_mean = diag.mean(-1)  # [E]
    diag_rev = diag.flip(-1)
    rel = torch.full((e,), float(damp), dtype=solve, device=h.device)
    u = None
    todo = torch.arange(e, device=h.device)
    fallback: list[str | None] = [None] * e
    for attempt in range(max_retries + 1):
        every = todo.numel() == e
        hd = _reversed_symmetric(h if every else h[todo], order if every or order is None else order[todo], solve)
        hd.diagonal(dim1=-2, dim2=-1).copy_(diag_rev if every else diag_rev[todo])
        hd.diagonal(dim1=-2, dim2=-1).add_((rel[todo] * diag_mean[todo])[:, None])
        li, ok = _inverse_cholesky(hd)
        del hd  # each [E, K, K] float64 temporary is dropped as soon as it is used
        if ok.any():
            ok_idx = ok.nonzero().flatten()
            if not bool(ok.all()):
                li = li[ok_idx]
            good = torch.isfinite(li.sum((-2, -1)))  # an overflow anywhere makes the sum inf or nan
            if bool(good.all()) and len(ok_idx) == e:  # the usual case: every matrix at the first attempt
                u = li.to(out_dtype).flip(-2, -1)
            else:
                if u is None:
                    u = torch.empty(h.shape, dtype=out_dtype, device=h.device)
                u[todo[ok_idx[good]]] = li[good].to(out_dtype).flip(-2, -1)
                ok[ok_idx[~good]] = False
        del li
        todo = todo[~ok]
        if todo.numel() == 0:
            break
        if attempt < max_retries:
            rel[todo] *= 10
    if todo.numel() and u is None:
        u = torch.empty(h.shape, dtype=out_dtype, device=h.device)
    for i in todo.tolist():  # last resort: a diagonal Hessian (always positive definite)
        d = diag[i].clamp(min=torch.finfo(solve).tiny) * (1 + rel[i])
        u[i] = torch.diag(d.rsqrt()).to(out_dtype)
        fallback[i] = f"cholesky failed at damping {rel[i].item():.3g}; used diag(H)"
    return u, rel, fallback


@dataclass(frozen=True)
class GPTQArgs:
    """How `gptq` quantizes, in QuantizationArgs terms: the grid (`num_bits`, `group_size` (None: one group per
    row), `symmetric`, `observer` "minmax" or "mse", `scale_dtype` the scales are rounded to) and the solve
    (`damp`, `block_size` the lazy-update width, `actorder`, `max_retries`, `solve_dtype` what the Hessian is
    factorized in, `factor_chunk` matrices factorized at a time; None: all). The recipe's GPTQOptions give
    damp, actorder, block_size and observer (calib/gptq_pass.py solve_args)."""

    num_bits: int = 4
    group_size: int | None = 32
    symmetric: bool = True
    damp: float = 0.01
    block_size: int = 128
    actorder: bool = False
    max_retries: int = 4
    observer: str = "minmax"
    scale_dtype: torch.dtype = torch.bfloat16
    solve_dtype: torch.dtype = torch.float64
    factor_chunk: int | None = None


@dataclass(frozen=True)
class FixedGrid:
    """Another grid with every group's scale fixed before the solve (FP4): `scale` [E, N, G] float32 and
    `quantize_column(w_col, scale) -> (codes, dequantized)` onto that grid."""

    scale: torch.Tensor
    quantize_column: Callable


def _factorize(h: torch.Tensor, args: GPTQArgs, perm: torch.Tensor | None, dead: torch.Tensor):
    """(U [E, K, K] float32, damping [E], fallback reasons) of `cholesky_inverse_upper` for every matrix of h,
    `args.factor_chunk` matrices at a time."""
    e, k, _ = h.shape
    fc = e if args.factor_chunk is None else max(1, int(args.factor_chunk))
    kw = dict(solve_dtype=args.solve_dtype)
    if fc >= e:
        return cholesky_inverse_upper(h, args.damp, args.max_retries, torch.float32, order=perm, dead=dead, **kw)
    U = torch.empty(e, k, k, device=h.device)
    rel = torch.empty(e, dtype=args.solve_dtype, device=h.device)
    fallback = []
    for c0 in range(0, e, fc):
        sl = slice(c0, c0 + fc)
        u_c, rel[sl], fb_c = cholesky_inverse_upper(h[sl], args.damp, args.max_retries, torch.float32,
                                                      order=None if perm is None else perm[sl], dead=dead[sl], **kw)
        U[sl] = u_c
        fallback += fb_c
        del u_c
    return U, rel, fallback


def _fit_weights(Wt: torch.Tensor, h: torch.Tensor, U: torch.Tensor, perm: torch.Tensor | None, dead: torch.Tensor,
                 fit: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`gptq`'s `fit`: Wt [E, K, N] (natural order) += alpha H_d^-1 (A - H)^T W^T in place, H_d^-1 = P^T U^T U P.
    Returns the weights to quantize, [E, N, K]."""
    dev = Wt.device
    a, alpha = fit
    m = torch.bmm((a.to(device=dev, dtype=torch.float32) - h.float()).transpose(1, 2), Wt)  # [E, K, N]
    if perm is not None:
        m = _permute_rows(m, perm)
    m = torch.bmm(U.transpose(1, 2), torch.bmm(U, m))
    if perm is not None:
        m = _permute_rows(m, torch.argsort(perm, dim=-1))
    m[~torch.isfinite(m).flatten(1).all(-1)] = 0.0  # a correction that overflowed: that matrix keeps W
    Wt.add_(m.mul_(alpha.to(device=dev, dtype=torch.float32)[:, None, None])).masked_fill_(dead[:, :, None], 0.0)
    del m
    return Wt.transpose(1, 2).clone()


def _group_picker(args: GPTQArgs, hdiag: torch.Tensor | None) -> Callable:
    """pick(wrows, cols): group parameters of w rows [E, N, g or K] whose columns are `cols` (None: every group
    of whole rows), by `args.observer` (mse: weighted by the Hessians' diagonals `hdiag` [E, K])."""

    def pick(wrows, cols):
        gs = args.group_size if cols is None else None
        if hdiag is not None:
            return choose_qparams_mse(wrows, args.num_bits, gs, args.symmetric, args.scale_dtype,
                                      weight=hdiag if cols is None else hdiag[:, cols])
        return choose_qparams(wrows, args.num_bits, gs, args.symmetric, args.scale_dtype)

    return pick


def _sweep(Wt: torch.Tensor, U: torch.Tensor, args: GPTQArgs, static: QParams | None, group_of: torch.Tensor | None,
           pick: Callable, quantize_column: Callable | None):
    """GPTQ's column sweep over Wt [E, K, N] (in visiting order, updated in place) with the upper inverse
    factors U [E, K, K] in the same order: (codes [E, K, N] float32, in visiting order, scale [E, N, G],
    zero point [E, N, G] or None). `static` (act-order or a fixed grid): every group's parameters, known up front,
    `group_of` [E, K] the natural group of each visited column; else each group's are picked (`pick`) when the
    sweep reaches its first column. `args.block_size` is a multiple of the group size."""
    e, k, n = Wt.shape
    dev = Wt.device
    gs = k if args.group_size is None else args.group_size
    qmin, qmax = qrange(args.num_bits)
    Ud = torch.diagonal(U, dim1=-2, dim2=-1)  # [E, K]
    groups = k // gs
    scale = torch.empty(e, n, groups, device=dev)
    zp = None if args.symmetric else torch.empty(e, n, groups, dtype=torch.int32, device=dev)
    # Qt holds each column's codes less its zero point during the sweep (asymmetric: clamped to [qmin - z,
    # qmax - z], the same integers as clamp(round(w / s) + z) - z), the zero points added block by block
    Qt = torch.empty(e, k, n, device=dev)
    cur_s = cur_lo = cur_hi = None
    if static is not None:  # [E, G, N]: a visited column's scales (and zero points) are one row per expert
        ar = torch.arange(e, device=dev)[:, None]
        s_rows = static.scale.transpose(1, 2).contiguous()
        z_rows = None if static.zero_point is None else static.zero_point.transpose(1, 2).float()
    for i1 in range(0, k, args.block_size):
        i2 = min(i1 + args.block_size, k)
        W1 = Wt[:, i1:i2]  # [E, B, N], a view: the sweep updates Wt in place
        Err1 = torch.empty_like(W1)
        Hinv1 = U[:, i1:i2, i1:i2]  # [E, B, B]
        z_blk = None
        if static is not None:  # the block's columns' scales (and code bounds), gathered once per block
            g_blk = group_of[:, i1:i2]  # [E, B]
            s_blk = s_rows[ar, g_blk]  # [E, B, N]
            if z_rows is not None:
                z_blk = z_rows[ar, g_blk]
                lo_blk, hi_blk = qmin - z_blk, qmax - z_blk
        for i in range(i2 - i1):
            col = i1 + i
            if static is None and col % gs == 0:  # group params from the already-updated weights
                qp = pick(Wt[:, col:col + gs].transpose(1, 2).contiguous(), slice(col, col + gs))
                cur_s = qp.scale[..., 0]
                scale[:, :, col // gs] = cur_s
                if zp is not None:
                    zp[:, :, col // gs] = qp.zero_point[..., 0]
                    z = qp.zero_point[..., 0].float()
                    cur_lo, cur_hi = qmin - z, qmax - z
            if static is not None:
                cur_s = s_blk[:, i]
                if z_blk is not None:
                    cur_lo, cur_hi = lo_blk[:, i], hi_blk[:, i]
            wcol = W1[:, i]  # [E, N]
            if quantize_column is not None:
                q, deq = quantize_column(wcol, cur_s)
                Qt[:, col] = q.float()
            else:
                q = torch.div(wcol, cur_s, out=Qt[:, col]).round_()  # the codes, written in place
                q = q.clamp_(qmin, qmax) if cur_lo is None else q.clamp_(cur_lo, cur_hi)
                deq = q * cur_s
            err = torch.sub(wcol, deq, out=Err1[:, i]).div_(Ud[:, col, None])  # [E, N]
            if i + 1 < i2 - i1:  # push the error onto the block's later columns
                W1[:, i + 1:].addcmul_(Hinv1[:, i, i + 1:, None], err[:, None, :], value=-1)
        if z_blk is not None:
            Qt[:, i1:i2].add_(z_blk)
        elif zp is not None and static is None:  # groups picked in the sweep: the natural column order
            cols = torch.arange(i1, i2, device=dev) // gs
            Qt[:, i1:i2].add_(zp.index_select(-1, cols).transpose(1, 2))
        if i2 < k:  # lazy batch update of all later columns
            Wt[:, i2:].baddbmm_(U[:, i1:i2, i2:].transpose(1, 2), Err1, alpha=-1)
    return Qt, scale, zp


def gptq(w: torch.Tensor, h: torch.Tensor, args: GPTQArgs = GPTQArgs(), *, grid: FixedGrid | None = None,
         fit: tuple[torch.Tensor, torch.Tensor] | None = None) -> GPTQResult:
    """Quantize weights w [E, N, K] (or [N, K]) given Hessians h [E, K, K] (or [K, K]) = 2/n * sum x x^T, as
    `args` says. `grid` (FP4): another grid with scales fixed up front (its `scale` [E, N, G] float32); the
    result's q then holds that grid's codes and its qparams the given scales. `args.solve_dtype`: what the
    Hessian is factorized in (float64 on the CPU; float32 on a GPU, where float64 is slow). `args.factor_chunk`:
    factorize that many matrices at a time (bounds the solve-dtype temporaries; the column sweep then runs
    over all of them at once). `args.observer` "mse" (INT4): each group's scale (and zero point) is the clipping
    of its min/max range with the least error weighted by the Hessian's diagonal (quant/int4.py
    choose_qparams_mse). Every tensor lives on w's device.

    `fit` (a [E, K, K], alpha [E]): the solve fits each matrix to another model's outputs (calib/gptq_pass.py,
    options.fit_unquantized): with a = X_ref^T X the cross-Gram of that model's inputs X_ref with X (scaled
    like h), the weights quantized are W + alpha W (A - H) H_d^-1 instead of W (H_d the damped Hessian this
    solve factorizes): at alpha 1 the least-squares W' of ||X W'^T - X_ref W^T||, at 0 W itself. The
    correction takes two products with the solve's own inverse factor (H_d^-1 = U^T U); the result's
    `target` holds those weights.

    The sweep works on the transposed weights [E, K, N], so that a column of w is a contiguous row: the
    per-column quantization and the in-block error push read and write contiguous memory."""
    squeeze = w.ndim == 2
    if squeeze:
        w, h = w[None], h[None]
    e, n, k = w.shape
    gs = k if args.group_size is None else args.group_size
    if k % gs:
        raise ValueError(f"in_features {k} is not a multiple of group_size {gs}")
    if args.group_size is not None and args.block_size % gs:  # keep group boundaries on block boundaries
        args = replace(args, block_size=max(gs, args.block_size - args.block_size % gs))
    dev = w.device
    H = h.to(device=dev)  # factorized in solve_dtype (float64 on the CPU: tiny models and fp32 Hessians of
    # real ones benefit), chunk by chunk, from permuted copies; H itself is not modified
    dead = torch.diagonal(H, dim1=-2, dim2=-1) == 0  # [E, K]: inputs never seen (their diagonal taken as 1)
    Wt = w.float().transpose(1, 2).contiguous()  # [E, K, N]: our own copy, updated in place
    Wt.masked_fill_(dead[:, :, None], 0.0)
    mse = args.observer == "mse" and grid is None
    pick = _group_picker(args, torch.diagonal(H, dim1=-2, dim2=-1).float().masked_fill(dead, 0.0) if mse else None)
    static = group_of = None
    if grid is not None:
        static = QParams(grid.scale.reshape(e, n, -1).float(), None)
        group_of = (torch.arange(k, device=dev) // gs).expand(e, k)  # natural order, unless act-order permutes below
    perm = None
    if args.actorder:
        diag = torch.diagonal(H, dim1=-2, dim2=-1).masked_fill(dead, 1.0)
        perm = torch.argsort(diag, dim=-1, descending=True, stable=True)  # [E, K]
    U, rel, fallback = _factorize(H, args, perm, dead)
    target = None if fit is None else _fit_weights(Wt, H, U, perm, dead, fit)
    del H
    if args.actorder:
        if static is None:
            static = pick(Wt.transpose(1, 2).contiguous(), None)  # natural order (contiguous: ~2.5x faster)
        Wt = _permute_rows(Wt, perm)
        group_of = torch.div(perm, gs, rounding_mode="floor")  # [E, K] natural group of each visited column
    Qt, scale, zp = _sweep(Wt, U, args, static, group_of, pick, None if grid is None else grid.quantize_column)
    if args.actorder:
        Qt = _permute_rows(Qt, torch.argsort(perm, dim=-1))
    if static is not None:
        scale, zp = static.scale, static.zero_point
    q8 = Qt.transpose(1, 2).to(torch.int8 if grid is None else torch.uint8).contiguous()
    qp = QParams(scale, zp)
    if squeeze:
        q8, qp = q8[0], QParams(scale[0], None if zp is None else zp[0])
    if squeeze and target is not None:
        target = target[0]
    return GPTQResult(q8, qp, rel.float(), fallback, dead.sum(-1), target)


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


# Bytes of the refit's per-chunk temporaries: per row one group's products with Hd (K float32) and its
# G x G system (float32, then the solve's float64): rows of a matrix are refitted this many at a time
# (Kimi K2's gate/up at g32: ~100 rows of 7168 columns per 64 MiB), or as many whole matrices as fit (the
# bench MoE: a solve batch's 8 experts of [512, 512] at once, 16 batched GEMMs instead of 128).
REFIT_CHUNK_BYTES = 64 << 20


def refit_scales(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, h: torch.Tensor,
                 damp: torch.Tensor | float = 0.01, *, scale_dtype: torch.dtype = torch.bfloat16,
                 solve_dtype: torch.dtype = torch.float64,
                 zero_point: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group scales refitted to fixed codes. For each row w_n [K] of w [E, N, K], with its codes z_n (q [E, N, K],
    integers, less their group's `zero_point` [E, N, G] when the scheme is asymmetric: the zero points stay as
    they are) and G group scales (scale [E, N, G]): the scales s minimizing the Hessian-weighted
    error (w_n - Z_n s)^T Hd (w_n - Z_n s), Z_n [K, G] holding each group's codes in its own column and
    Hd = H + damp * mean(diag H) I (h [E, K, K]; `damp` per matrix [E] or one float, as the solve used it):
    the G x G normal equations A s = b, A = Z_n^T Hd Z_n, b = Z_n^T Hd w_n, formed in float32 and solved in
    `solve_dtype`. The new scales are rounded to `scale_dtype`, as stored; a row keeps its old ones unless
    every new one is positive and finite and the rounded new ones have a smaller error (compared through A
    and b: the error's constant w^T Hd w cancels). Returns (scales [E, N, G] float32, rows changed [E, N]
    bool). Work per matrix: about N x K^2 / 2 multiply-adds for A (A is symmetric: its upper triangle of
    G x G blocks, one batched GEMM per group over the columns from that group on, in chunks of rows of
    REFIT_CHUNK_BYTES, several whole matrices per chunk where they fit) and one GEMM for b (Z_n^T (Hd w_n))."""
    e, n, k = w.shape
    g = scale.shape[-1]
    gs = k // g
    dev = w.device
    damp = torch.as_tensor(damp, dtype=torch.float64, device=dev).expand(e)
    out = scale.float().clone()
    changed = torch.zeros(e, n, dtype=torch.bool, device=dev)
    per = (k + 3 * g * g) * 4  # bytes per row of a chunk
    rows = max(1, REFIT_CHUNK_BYTES // per)  # rows of one matrix at a time, or of several whole matrices
    ec = max(1, min(e, rows // n)) if rows >= n else 1
    rows = min(rows, n)
    eye = torch.eye(g, dtype=solve_dtype, device=dev)
    ybuf = torch.empty(ec * rows * k, device=dev)  # one group's products with Hd, reused
    for e0 in range(0, e, ec):
        e1 = min(e, e0 + ec)
        c_n = e1 - e0
        hd = h[e0:e1].float().clone()
        d64 = h[e0:e1].diagonal(dim1=-2, dim2=-1).to(torch.float64)  # the damping in float64, on the diagonal only
        hd.diagonal(dim1=-2, dim2=-1).copy_(d64 + (damp[e0:e1] * d64.mean(-1))[:, None])
        hw = torch.bmm(w[e0:e1].float(), hd)  # [c, N, K]: Hd w_n per row (Hd symmetric), one GEMM per matrix
        for r0 in range(0, n, rows):
            z = q[e0:e1, r0:r0 + rows].float()  # [c, m, K]
            m = z.shape[1]
            zg = z.view(c_n, m, g, gs)
            if zero_point is not None:
                zg.sub_(zero_point[e0:e1, r0:r0 + rows, :, None].float())
            # A's upper triangle of blocks, group by group (A is symmetric: half the products), mirrored:
            # A[:, c, j] = sum over group j's columns t of (sum over group c's columns s of z_s Hd[s, t]) z_t
            a = z.new_empty(c_n, m, g, g)
            for c in range(g):
                y = torch.bmm(zg[:, :, c], hd[:, c * gs:(c + 1) * gs, c * gs:],
                              out=ybuf[:c_n * m * (k - c * gs)].view(c_n, m, -1))
                blk = y.view(c_n, m, g - c, gs).mul_(zg[:, :, c:]).sum(-1)  # [c, m, G - c]
                a[:, :, c, c:] = blk
                a[:, :, c + 1:, c] = blk[..., 1:]
            a = a.to(solve_dtype)  # [c, m, G, G]
            b = (hw[:, r0:r0 + m] * z).view(c_n, m, g, gs).sum(-1).to(solve_dtype)  # [c, m, G]: Z_n^T (Hd w_n)

            def err(s):  # (w - Z s)^T Hd (w - Z s) - w^T Hd w
                return torch.einsum("cmg,cmgj,cmj->cm", s, a, s) - 2 * (s * b).sum(-1)

            # a group whose codes are all 0 leaves its column of A empty: a vanishing ridge keeps A invertible
            ridge = a.diagonal(dim1=-2, dim2=-1).mean(-1).clamp(min=1e-30) * 1e-9
            s_new = torch.linalg.solve(a + ridge[..., None, None] * eye, b).to(scale_dtype).to(solve_dtype)
            s_old = out[e0:e1, r0:r0 + m].to(solve_dtype)
            ok = torch.isfinite(s_new).all(-1) & (s_new > 0).all(-1) & (err(s_new) < err(s_old))
            out[e0:e1, r0:r0 + m] = torch.where(ok[..., None], s_new.float(), out[e0:e1, r0:r0 + m])
            changed[e0:e1, r0:r0 + m] = ok
    return out, changed


_CD_NATIVE = None  # quant/_cd_native.py once imported, False when unavailable


def _cd_native():
    """The compiled column loop of refine_codes, or None (no numba, QUANTKIT_NATIVE=0): the torch path."""
    global _CD_NATIVE
    if _CD_NATIVE is None:
        _CD_NATIVE = optional_native("_cd_native") or False
    return (_CD_NATIVE or None) if native_available() else None  # a kernel that failed turns them all off


def _cd_block_torch(qt, gb, step, s_t, hd, delta, i1: int, qmin: int, qmax: int) -> None:
    """One block of columns i1 .. i1 + B of a coordinate-descent sweep over every row and expert, in place: qt,
    step, s_t [E, K, N] (codes, Hd_jj s_j, scales, transposed), gb [E, B, N] the block's gradient rows (Hd E^T),
    kept current; delta [E, B, N] out: each column's change of the dequantized weights."""
    b = gb.shape[1]
    for i in range(b):
        j = i1 + i
        old = qt[:, j]
        # the grid point nearest the vertex of this weight's parabola
        new = torch.addcdiv(old, gb[:, i], step[:, j]).round_().clamp_(qmin, qmax)
        d = torch.sub(new, old, out=delta[:, i]).mul_(s_t[:, j])
        old.copy_(new)
        if i + 1 < b:
            gb[:, i + 1:].addcmul_(hd[:, j + 1:i1 + b, j, None], d[:, None, :], value=-1)


@dataclass(frozen=True)
class _Damped:
    """Hessians as refine_codes' sweeps read them: hd [E, K, K] float32 with the damping (and 1 for the
    never-seen inputs) on its diagonal, diag [E, K] that diagonal, dead [E, K] bool the never-seen inputs."""

    hd: torch.Tensor
    diag: torch.Tensor
    dead: torch.Tensor


def _refine_blocks(w, q, qp: QParams, hs: _Damped, sweeps: int, block_size: int, num_bits: int) -> torch.Tensor:
    """refine_codes' sweeps in torch ops, on the transposed layout [E, K, N] (a column of every row is a
    contiguous row), in blocks of columns: in-block rank-1 updates, one GEMM for the rest, G = Hd E^T kept
    current. q [E, N, K] float32 codes, qp.scale [E, N, G] (unusable rows' 0), qp.zero_point [E, N, G] or None.
    Returns the codes [E, N, K]."""
    e, n, k = w.shape
    scale, zp, hd, diag, dead = qp.scale, qp.zero_point, hs.hd, hs.diag, hs.dead
    qmin, qmax = qrange(num_bits)
    s_t = scale.transpose(1, 2).repeat_interleave(k // scale.shape[-1], dim=1)  # [E, K, N]: each weight's scale
    qt = q.transpose(1, 2).contiguous()  # [E, K, N]
    ct = qt if zp is None else qt - zp.transpose(1, 2).float().repeat_interleave(k // scale.shape[-1], dim=1)
    et = torch.empty_like(qt).copy_(w.transpose(1, 2)).masked_fill_(dead[:, :, None], 0.0).addcmul_(ct, s_t, value=-1)
    gt = torch.bmm(hd, et)  # [E, K, N] = Hd E^T
    del et, ct
    step = diag[:, :, None] * s_t  # [E, K, N]: Hd_jj s_j, the curvature of the error in code units
    step.masked_fill_(~(step > 0), float("inf"))  # a row without usable scales: its codes stay
    for sweep in range(sweeps):
        last = sweep == sweeps - 1
        for i1 in range(0, k, block_size):
            i2 = min(i1 + block_size, k)
            gb = gt[:, i1:i2].clone()  # [E, B, N], kept current inside the block
            delta = torch.empty_like(gb)  # change of the dequantized weights (the error moves by -delta)
            _cd_block_torch(qt, gb, step, s_t, hd, delta, i1, qmin, qmax)
            if not last:  # G of every column, for the next sweep
                gt.baddbmm_(hd[:, :, i1:i2], delta, alpha=-1)
            elif i2 < k:  # the last sweep: only the columns it has still to visit
                gt[:, i2:].baddbmm_(hd[:, i2:, i1:i2], delta, alpha=-1)
    return qt.transpose(1, 2)


def _refine_rows(native, w, q, qp: QParams, hs: _Damped, sweeps: int, num_bits: int) -> bool:
    """refine_codes' sweeps by the compiled row loop (quant/_cd_native.py cd_rows) on q [E, N, K] float32 (in
    place), the rows split over the native threads. False when the kernel failed."""
    e, n, k = q.shape
    scale, hd, diag = qp.scale, hs.hd, hs.diag
    qmin, qmax = qrange(num_bits)
    gs = k // scale.shape[-1]
    err = _row_errors(w, q, scale, qp.zero_point, hs.dead)
    g = torch.bmm(err, hd.transpose(1, 2))  # [E, N, K]: row n holds Hd e_n
    del err
    ex = torch.arange(e).repeat_interleave(n)
    hdt = hd.transpose(1, 2).contiguous()  # hdt[e, j] = column j of Hd, contiguous
    if not run_rows(native.cd_rows, q.view(e * n, k).numpy(),
                    (ex.numpy(), g.view(e * n, k).numpy(), scale.reshape(e * n, -1).contiguous().numpy(),
                     diag.contiguous().numpy(), hdt.numpy(), gs, int(sweeps), float(qmin), float(qmax)), (),
                    per_row=(0, 1, 2), min_rows=16):
        return False  # numba could not compile the kernel: nothing ran
    return True


def _row_errors(w, q, scale, zp, dead) -> torch.Tensor:
    """w - (q - zp) s [E, N, K] (float32), the never-seen inputs' weights taken as 0."""
    gs = w.shape[-1] // scale.shape[-1]
    s = scale.repeat_interleave(gs, dim=-1)
    c = q if zp is None else q - zp.float().repeat_interleave(gs, dim=-1)
    return torch.empty_like(q).copy_(w).masked_fill_(dead[:, None, :], 0.0).addcmul_(c, s, value=-1)


def refine_codes(w: torch.Tensor, q: torch.Tensor, qparams: QParams, h: torch.Tensor,
                 damp: torch.Tensor | float = 0.01, *, num_bits: int = 4, sweeps: int = 1,
                 block_size: int = 128, with_error: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cyclic coordinate descent on integer codes with fixed group scales (`qparams.scale` [E, N, G]) and, asymmetric,
    fixed zero points (`qparams.zero_point` [E, N, G]: q_n s below stands for (q_n - zp) s, and a code moves within
    [qmin, qmax] as stored): every weight,
    column by column, moves to the grid point that minimizes the Hessian-weighted error
    (w_n - q_n s)^T Hd (w_n - q_n s) of its row with all other weights held (Hd = H + damp * mean(diag H) I, as the
    solve used it). Along one coordinate the error is a parabola with its vertex at q_nj s_j + (Hd e_n)_j / Hd_jj
    (e_n = w_n - q_n s), so the nearest grid point to the vertex is the exact minimizer and no sweep can raise the
    error. GPTQ pushes each column's error onto later columns only; a sweep also corrects earlier columns against
    the final later ones. On the CPU each row runs its sweeps in one compiled loop (quant/_cd_native.py cd_rows);
    the torch path (GPUs, QUANTKIT_NATIVE=0) works on the transposed layout [E, K, N] with G = Hd E^T kept current
    (blocks of `block_size` columns: in-block rank-1 updates, one GEMM for the rest; the last sweep updates only the
    columns still ahead of it). Inputs never seen (H_jj == 0) are treated as GPTQ treats them: diagonal 1, weight 0;
    a row with a scale that is not positive and finite keeps its codes. Returns (codes [E, N, K] int8, with
    `with_error` the Hessian-weighted error [E] after the sweeps in float64, else None). Work per sweep: about
    N x K^2 multiply-adds in the torch form, like GPTQ's sweep; in the compiled form K multiply-adds per code that
    moves (after GPTQ a few percent per sweep), plus in both one GEMM for the starting gradients."""
    e, n, k = w.shape
    scale, zero_point = qparams.scale, qparams.zero_point
    damp = torch.as_tensor(damp, dtype=torch.float32, device=w.device).expand(e)
    dead = torch.diagonal(h, dim1=-2, dim2=-1) == 0
    hd = h.float().clone()
    diag = hd.diagonal(dim1=-2, dim2=-1)
    diag.masked_fill_(dead, 1.0)
    diag.add_((damp * diag.mean(-1))[:, None])
    usable = ((scale > 0) & scale.isfinite()).all(-1)  # [E, N]: rows whose every scale can be refined against
    sc = scale.float().masked_fill(~usable[..., None], 0.0)  # [E, N, G]
    codes = q.float()  # [E, N, K]
    qp, hs = QParams(sc, zero_point), _Damped(hd, diag, dead)
    native = _cd_native() if w.device.type == "cpu" else None
    if native is None or not _refine_rows(native, w, codes, qp, hs, sweeps, num_bits):
        codes = _refine_blocks(w, codes, qp, hs, sweeps, block_size, num_bits)
    err = None
    if with_error:
        et = _row_errors(w, codes, sc, zero_point, dead)
        err = (et * torch.bmm(et, hd.transpose(1, 2))).flatten(1).sum(-1, dtype=torch.float64)
    return codes.to(torch.int8).contiguous(), err
