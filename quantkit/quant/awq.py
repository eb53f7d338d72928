"""AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization") as pure, batched tensor math.

Two searches, both over a fixed grid and both batched over experts (leading dim E):
- `search_scales`: per input channel s = mean|x|^a / mean|w|^(1-a) for a in {0, 1/n, ..., (n-1)/n},
  normalized by sqrt(max*min), choosing per batch entry the a whose scaled-and-quantized weights give the
  lowest loss, coarse to fine (every `stride`-th a, then the neighbours of the best one). The loss is
  supplied by the caller (the block output error), since what "output" means depends on the block (a whole
  MoE MLP for the post-attention norm scale, one expert for up->down).
- `search_clip`: per output row and group, a ratio r of the group's range (`clip_ratios`: from the range
  that puts a symmetric group's absmax exactly on the top code down to max_shrink of it, plus r = 1, plain
  RTN), minimizing the group's contribution to the Linear's output error on its own inputs (computed from
  the inputs' Gram matrix, so the cost does not grow with the number of tokens).

`fake_quant` is RTN quantize-dequantize with optional per-group clip ratios, in float32.
"""

from __future__ import annotations

from typing import Callable

import torch

from .int4 import QParams, qrange


def choose_qparams_clipped(w: torch.Tensor, num_bits: int, group_size: int | None, symmetric: bool,
                           ratio: torch.Tensor | float | None = None,
                           scale_dtype: torch.dtype = torch.bfloat16) -> QParams:
    """Like int4.choose_qparams, with the group range shrunk by `ratio` [..., N, G] (or one ratio for every
    group; 1 = no clipping). The group's max and min are two reductions (torch.aminmax over 32 elements is
    several times slower than both, and |w| would be one more pass)."""
    k = w.shape[-1]
    g = k if group_size is None else group_size
    wg = w.float().reshape(*w.shape[:-1], k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    qmin, qmax = qrange(num_bits)
    tiny = torch.finfo(torch.float32).tiny
    r = 1.0 if ratio is None else ratio
    if symmetric:  # max |w| = max(max w, -min w)
        scale = (torch.maximum(hi, lo.neg_()).mul_(r) / ((qmax - qmin) / 2)).to(scale_dtype).float()
        return QParams(torch.where(scale > tiny, scale, torch.ones_like(scale)), None)
    lo = (lo * r).clamp_(max=0.0)
    hi = (hi * r).clamp_(min=0.0)
    scale = ((hi - lo) / (qmax - qmin)).to(scale_dtype).float()
    scale = torch.where(scale > tiny, scale, torch.ones_like(scale))
    zp = (qmin - torch.round(lo / scale)).clamp(qmin, qmax).to(torch.int32)
    return QParams(scale, zp)


def fake_quant(w: torch.Tensor, num_bits: int = 4, group_size: int | None = 32, symmetric: bool = True,
               ratio: torch.Tensor | float | None = None, scale_dtype: torch.dtype = torch.bfloat16,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize w [..., N, K] (float32 result). The searches call it for every candidate on whole
    weight tensors, so it makes one result tensor (or writes `out`, float32 and contiguous, w's shape; it may
    be w itself) and works in place on it."""
    qp = choose_qparams_clipped(w, num_bits, group_size, symmetric, ratio, scale_dtype)
    qmin, qmax = qrange(num_bits)
    k = w.shape[-1]
    g = k if group_size is None else group_size
    wg = w.float().reshape(*w.shape[:-1], k // g, g)
    s = qp.scale.unsqueeze(-1)
    out = torch.div(wg, s, out=None if out is None else out.view(wg.shape)).round_()
    if qp.zero_point is None:
        return out.clamp_(qmin, qmax).mul_(s).reshape(w.shape)
    z = qp.zero_point.unsqueeze(-1).float()
    return out.add_(z).clamp_(qmin, qmax).sub_(z).mul_(s).reshape(w.shape)


def scale_candidates(x_mean: torch.Tensor, w_mean: torch.Tensor, n_grid: int = 20, power_of_two: bool = False):
    """Yield (a, s) with s = x^a / w^(1-a) normalized; x_mean, w_mean [..., K] (mean |x|, mean |w|).
    power_of_two rounds s to the nearest power of two (in log space), so that folding s into a tensor
    stored in a binary float format changes only exponents: the fold is exact."""
    x = x_mean.float().clamp(min=1e-8)
    w = w_mean.float().clamp(min=1e-8)
    for i in range(n_grid):
        a = i / n_grid
        s = (x.pow(a) / w.pow(1 - a)).clamp(min=1e-4)
        s = s / (s.amax(-1, keepdim=True) * s.amin(-1, keepdim=True)).sqrt()
        if power_of_two:
            s = torch.exp2(torch.round(torch.log2(s)))
        yield a, s


def grid_coarse(n_grid: int, stride: int = 1) -> list[int]:
    """Candidate indices of a scale search's first round: 0 is s = 1 (plain RTN), 1 + i is grid point i of
    scale_candidates; every stride-th grid point from 0 (stride 1: the whole grid, the only round)."""
    return [0] + [1 + i for i in range(0, n_grid, stride)]


def grid_refine(centre: int, n_grid: int, stride: int = 1) -> list[int]:
    """Candidate indices of the second round around the first round's best grid point (candidate index
    `centre` >= 1): the grid points within stride - 1 of it, none of which the first round tried."""
    c = centre - 1
    return [1 + j for j in range(max(0, c - stride + 1), min(n_grid, c + stride)) if j != c]


def search_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor],
                  n_grid: int = 20, power_of_two: bool = False,
                  stride: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grid search of AWQ scales. x_mean, w_mean: [..., K]; loss_fn(s [..., K]) -> loss [...] (one per batch
    entry, lower is better). Returns (best s [..., K], best a [...] (-1: no scaling won), loss with s = 1 [...]).

    s = 1 is always a candidate, so the result can only improve on plain RTN. Coarse to fine: s = 1 and every
    stride-th grid point first (grid_coarse), then, per batch entry, the grid points within stride - 1 of its
    best grid point (grid_refine, gathered per entry: one loss_fn call per offset); stride 1 tries the whole
    grid in one round. The least loss wins; a tie goes to the lower candidate index (s = 1 first)."""
    k = x_mean.shape[-1]
    cands = torch.stack([torch.ones_like(x_mean, dtype=torch.float32)]
                        + [s for _, s in scale_candidates(x_mean, w_mean, n_grid, power_of_two)])  # [1 + n_grid, ..., K]

    def pick(idx: torch.Tensor) -> torch.Tensor:  # each batch entry's candidate idx[...] -> [..., K]
        return cands.gather(0, idx[None, ..., None].expand(1, *idx.shape, k))[0]

    coarse = grid_coarse(n_grid, stride)
    losses = torch.stack([loss_fn(cands[i]).double() for i in coarse])  # [C, ...]
    first = losses[0]
    order = torch.tensor(coarse, device=losses.device)
    win = losses.argmin(0)  # the first least loss: the lower candidate index keeps a tie
    best_loss, best_i = losses.gather(0, win[None])[0], order[win]
    if stride > 1:
        centre = order[1:][losses[1:].argmin(0)] - 1  # each entry's best grid point (s = 1 aside)
        # grid_refine's offsets; beyond n_grid - 1 either way no entry has a grid point
        for off in [o for o in range(max(1 - stride, 1 - n_grid), min(stride, n_grid)) if o != 0]:
            j = centre + off
            valid = (j >= 0) & (j < n_grid)
            idx = j.clamp(0, n_grid - 1) + 1
            loss = loss_fn(pick(idx)).double()
            better = valid & ((loss < best_loss) | ((loss == best_loss) & (idx < best_i)))
            best_loss = torch.where(better, loss, best_loss)
            best_i = torch.where(better, idx, best_i)
    best_a = torch.where(best_i == 0, -1.0, (best_i - 1).double() / n_grid)
    return pick(best_i), best_a, first


def clip_ratios(num_bits: int, symmetric: bool, n_grid: int = 20, max_shrink: float = 0.5) -> list[float]:
    """Candidate group-range ratios for the clipping search, largest first.

    The grid shrinks the largest range that can matter by steps of 1/n_grid down to max_shrink of it. For a
    symmetric scheme the stored scale is absmax * r / ((qmax - qmin) / 2) (e.g. absmax / 7.5 at 4 bits, the
    compressed-tensors convention), which puts the group's absmax half a step outside the positive code
    range: r = (qmax - qmin) / (2 qmax) (= 15/14) maps it exactly onto qmax, and is where the grid starts.
    r = 1 (the format's default, i.e. plain RTN) is always a candidate."""
    qmin, qmax = qrange(num_bits)
    top = (qmax - qmin) / (2 * qmax) if symmetric else 1.0
    steps = max(1, int(round((1 - max_shrink) * n_grid)))
    rs = [top * (1 - i / n_grid) for i in range(steps + 1) if 1 - i / n_grid >= max_shrink - 1e-9]
    return sorted(set(rs) | {1.0}, reverse=True)


CLIP_GRAM_BYTES = 1 << 26  # float32 [E, K, K] Gram matrices `search_clip` holds at once (at least one expert's)
# float32 [E, rows, K] errors per candidate (at least one row): below glibc's largest mmap threshold, so that
# the per-candidate temporaries are reused from the heap instead of mapped and faulted in every time
CLIP_CHUNK_BYTES = 1 << 24


def search_clip(w: torch.Tensor, x: torch.Tensor, num_bits: int = 4, group_size: int | None = 32,
                symmetric: bool = True, n_grid: int = 20, max_shrink: float = 0.5,
                x_mask: torch.Tensor | None = None, row_chunk: int | None = None) -> torch.Tensor:
    """Per (row, group) range ratio (`clip_ratios`) minimizing sum_t (x[t, g] . (w[n, g] - q_r(w)[n, g]))^2,
    kept for a row only if it also lowers that row's whole output error (groups interact through cross
    terms); otherwise the row keeps r = 1 (RTN).

    w [E, N, K]; x [E, T, K] inputs of each matrix (padded), x_mask [E, T] marks real tokens (or weights
    them). Rows are searched `row_chunk` at a time (None: as many as CLIP_CHUNK_BYTES allows, at most 256).
    Returns ratio [E, N, G] in [max_shrink, (qmax - qmin) / (2 qmax)].

    The quadratic forms are float32 (the Gram matrix is a float32 product of float32 inputs either way). The
    row test is the difference of the two errors as one form, (d_c - d_1)^T G (d_c + d_1) < 0, d_c and d_1
    the row's weight errors with the chosen ratios and with r = 1: one [K, K] product per row, not two."""
    e, n, k = w.shape
    per = max(1, CLIP_GRAM_BYTES // (k * k * 4))
    if e > per:  # the Gram matrices of a few experts at a time
        return torch.cat([search_clip(w[i:i + per], x[i:i + per], num_bits, group_size, symmetric, n_grid, max_shrink,
                                      None if x_mask is None else x_mask[i:i + per], row_chunk)
                          for i in range(0, e, per)])
    if row_chunk is None:
        row_chunk = max(1, min(256, CLIP_CHUNK_BYTES // (e * k * 4)))
    g = k if group_size is None else group_size
    groups = k // g
    xs = x.float() if x_mask is None else x.float() * x_mask[..., None].float()
    # errors are quadratic forms in the weight error: sum_t (x_t . d)^2 = d^T (X^T X) d
    gram = torch.bmm(xs.transpose(1, 2), xs)  # [E, K, K]
    dev = w.device
    idx = torch.arange(groups, device=dev)
    # the diagonal blocks [E * G, g, g]: group j of expert i is batch entry i * G + j
    gram_g = gram.reshape(e, groups, g, groups, g)[:, idx, :, idx].transpose(0, 1).reshape(e * groups, g, g)
    best = torch.ones(e, n, groups, device=dev)
    ratios = clip_ratios(num_bits, symmetric, n_grid, max_shrink)
    for i0 in range(0, n, row_chunk):
        wc = w[:, i0:i0 + row_chunk].float()
        nb = wc.shape[1]
        # [E, G, n, g]: each group's rows are one batch entry of the quadratic forms, so that a candidate's
        # group errors are one batched product with the group's Gram block
        wp = wc.reshape(e, nb, groups, g).transpose(1, 2).contiguous()
        be = torch.full((e, groups, nb), float("inf"), device=dev)
        br = torch.ones(e, groups, nb, device=dev)
        rtn_dw = None
        for r in [1.0] + [r for r in ratios if r != 1.0]:  # r = 1 first: ties keep RTN
            dw = wp.sub(fake_quant(wp, num_bits, g, symmetric, r)).reshape(e * groups, nb, g)
            if rtn_dw is None:  # RTN's error [E, n, K], kept for the row test
                rtn_dw = dw.reshape(e, groups, nb, g).transpose(1, 2).reshape(e, nb, k)
            err = torch.bmm(dw, gram_g).mul_(dw).sum(-1).reshape(e, groups, nb)  # sum_kl dw_k G_kl dw_l
            better = err < be
            be = torch.where(better, err, be)
            br.masked_fill_(better, r)
        br = br.transpose(1, 2)  # [E, n, G]
        # Groups were chosen independently, but a row's output error also has cross-group terms: keep a
        # row's clip ratios only where they lower the row's whole output error on these inputs.
        keep = _row_gain(wc, rtn_dw, gram, br, num_bits, group_size, symmetric) < 0  # [E, n]
        del rtn_dw
        best[:, i0:i0 + nb] = br.masked_fill(~keep[..., None], 1.0)
    return best


def _row_gain(w, rtn_dw, gram, ratio, num_bits, group_size, symmetric) -> torch.Tensor:
    """Per row, the output error with clip ratios `ratio` minus that with r = 1 (`rtn_dw`: w - q_1(w)), from
    gram = X^T X [E, K, K]: (d_c - d_1)^T G (d_c + d_1), G symmetric. w [E, n, K] -> [E, n] (float32)."""
    d_c = w - fake_quant(w, num_bits, group_size, symmetric, ratio)
    return torch.bmm(d_c - rtn_dw, gram).mul_(d_c.add_(rtn_dw)).sum(-1)
