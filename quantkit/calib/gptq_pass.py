"""GPTQ for one decoder layer (quant/gptq.py does the math): dense Linears from their input Hessians, and
every routed expert from the Hessian of the tokens routed to it, a group of experts at a time. The quantized
weights are written back into the layer (true-sequential: the next layer sees quantized outputs).

Experts are solved in fixed groups (`expert_group_size`: a function of the layer's shapes only, never of the
number of ranks), which are also the unit of ownership in a distributed pass (calib/parallel.py), so that
every solve sees the same operands whatever the world size.

Where the layer lives (calib/device.py): on the CPU the Hessians are factorized in float64, a few experts
(at most GPTQ_CHUNK_BYTES of Hessians) at a time; on a GPU in float32 on the device, more experts at once
(at most GPTQ_CHUNK_BYTES_DEVICE). Results are moved to the host only to be emitted."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import CalibrationError
from ..match.recipe import WeightGroup
from ..pack.layout import fp4_module
from ..quant import fp4
from ..quant.gptq import gptq, refine_codes, refit_scales
from ..quant.int4 import QParams, dequantize, rtn, sqnr_db
from .emit import LayerResult, emit, emit_tensors, source_dtype
from .hessians import ExpertStats, LinearStats, coverage
from .weights import reuse_heap


def solve_dtype(device: torch.device) -> torch.dtype:
    """What Hessians are factorized in: float64 on the CPU (as always), float32 on a GPU."""
    return torch.float64 if device.type == "cpu" else torch.float32


class _FP4Grid:
    """GPTQ on an FP4 grid (quant/fp4.py): every group's scale is fixed before the solve from the weights
    as they are (NVFP4: the global scale spans the whole matrix, and a fused gate/up pair shares it)."""

    def __init__(self, s, w: torch.Tensor, weight: torch.Tensor | None = None):
        """`weight` [c, K] (observer mse: the Hessians' diagonals): each group's scale is then fitted, the
        candidate with the least squared error weighted per input column (quant.fp4.fit_scales)."""
        self.kind = s.fp4
        if self.kind == "nvfp4":
            qp = fp4.choose_qparams_nvfp4(w)  # [c, N, K] -> one global scale per matrix (gate+up fused: shared)
            self.scale, self.global_scale = qp.scale, qp.global_scale
            if weight is not None:
                self.scale = fp4.fit_scales(w, self.scale, self.global_scale, weight)
            self.eff = fp4.effective_scale_nvfp4(self.scale, self.global_scale)
        else:
            self.scale = fp4.choose_qparams_mxfp4(w)
            if weight is not None:
                self.scale = fp4.fit_scales(w, self.scale, None, weight)
            self.global_scale, self.eff = None, fp4.effective_scale_mxfp4(self.scale)

    def rtn(self, w: torch.Tensor, sel) -> torch.Tensor:
        return fp4.quantize_fp4(w, self.eff[sel])

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        return fp4.dequantize_fp4(codes, self.eff, torch.float32)

    def tensors(self, module: str, j: int, rows, codes: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Module `module`'s output tensors: its rows `rows` of expert `j`, quantized to `codes`."""
        return fp4_module(module, fp4.pack_fp4(codes).cpu(), self.scale[j, rows].cpu(),
                          None if self.global_scale is None else self.global_scale[j].cpu())


def _solve(w: torch.Tensor, h: torch.Tensor, s, refit: bool = False, refine: int = 0, **kw):
    """GPTQ of w [c, N, K]: (result, FP4 grid or None). INT4 chooses its group parameters in the sweep;
    `refit` (options.refit_scales, INT4): then its group scales are refitted to the codes and zero points
    (quant/gptq.py refit_scales); `refine` (options.refine_sweeps, INT4): then that many
    coordinate-descent sweeps move the codes under the final scales (quant/gptq.py refine_codes). With `fit`
    (quant/gptq.py gptq) both work on the fitted weights the solve quantized; an FP4 grid's scales are chosen
    from the weights as they are."""
    kw = {**kw, "solve_dtype": solve_dtype(w.device)}
    if not s.fp4:
        r = gptq(w, h, s.num_bits, s.group_size, s.symmetric, **kw)
        wt = w if r.target is None else r.target
        zp = r.qparams.zero_point
        if refit:
            r.qparams.scale.copy_(refit_scales(wt, r.q, r.qparams.scale, h, r.damping, solve_dtype=kw["solve_dtype"],
                                               zero_point=zp)[0])
        if refine:
            r.q.copy_(refine_codes(wt, r.q, r.qparams.scale, h, r.damping, num_bits=s.num_bits, sweeps=refine,
                                   zero_point=zp)[0])
        return r, None
    weight = torch.diagonal(h, dim1=-2, dim2=-1).float() if kw.get("observer") == "mse" else None
    grid = _FP4Grid(s, w, weight)
    return gptq(w, h, 4, s.group_size, True, static_scale=grid.eff, quantize_column=fp4.quantize_column, **kw), grid


def _rtn_into(q: torch.Tensor, qp: QParams, grid, w: torch.Tensor, s, sel: torch.Tensor) -> None:
    """Replace the solve's codes (and INT4 group parameters) of the matrices `sel` [c] (bool, on q's device)
    of a batch w [c, N, K] by RTN's: on the solve's FP4 grid, or INT4 RTN of the scheme `s`."""
    dev = q.device
    if grid is not None:
        q[sel] = grid.rtn(w[sel], sel).to(dev)
        return
    rr = rtn(w[sel], s.num_bits, s.group_size, s.symmetric)
    q[sel] = rr.q.to(dev)
    qp.scale[sel] = rr.qparams.scale.to(dev)
    if qp.zero_point is not None:
        qp.zero_point[sel] = rr.qparams.zero_point.to(dev)


def gptq_dense(res: LayerResult, ckpt, disk: str, mod: nn.Linear, g: WeightGroup, st: LinearStats):
    w = mod.weight.detach().float()
    s = g.scheme.for_in_features(w.shape[1])
    h = st.hessian()[None]
    r, grid = _solve(w[None], h, s, damp=g.options.damp, actorder=g.options.actorder,
                     block_size=g.options.block_size, refit=g.options.refit_scales, refine=g.options.refine_sweeps,
                     **({"observer": g.options.observer} if g.options.observer != "minmax" else {}))
    meta = {"method": "gptq", "tokens": st.count, "damping": round(float(r.damping[0]), 6), "fallback": r.fallback[0]}
    if bool(_unseen(h)[0]):  # as for the experts: GPTQ would zero every weight
        meta.update(method="rtn", fallback=UNSEEN)
        _rtn_into(r.q, r.qparams, grid, w[None], s, torch.ones(1, dtype=torch.bool, device=r.q.device))
    if grid is None:
        deq = dequantize(r.q[0], r.qparams.scale[0], None if r.qparams.zero_point is None else r.qparams.zero_point[0])
        emit(res, disk, r.q[0].cpu(), QParams(r.qparams.scale[0].cpu(), None if r.qparams.zero_point is None
                                              else r.qparams.zero_point[0].cpu()), s,
             source_dtype(ckpt, disk + ".weight"), {**meta, "sqnr_db": round(float(sqnr_db(w, deq)), 4)})
    else:
        deq = grid.dequantize(r.q)[0]
        emit_tensors(res, disk, grid.tensors(disk, 0, slice(None), r.q[0]), s,
                     {**meta, "sqnr_db": round(float(sqnr_db(w, deq)), 4)})
    mod.weight.data.copy_(deq.to(mod.weight.dtype))


UNSEEN = "no input seen (all-zero Hessian): RTN"


def _unseen(h: torch.Tensor) -> torch.Tensor:
    """[E] bool for Hessians h [E, K, K]: the matrices none of whose inputs was ever nonzero (diagonal all 0)."""
    return (torch.diagonal(h, dim1=-2, dim2=-1) == 0).all(-1)


def _all_token_down_hessians(stats: ExpertStats, ids: torch.Tensor) -> torch.Tensor:
    """Down-proj Hessians of experts `ids` from the sampled tokens of the layer sent through each of them
    (one expert at a time: each value depends only on that expert's weights and the samples)."""
    x, _ = stats.samples()  # [t, H]
    out = torch.empty(len(ids), stats.I, stats.I, device=x.device)
    for j, e in enumerate(ids.tolist()):
        hd = stats.down_inputs_one(e, x)
        out[j] = (hd.T @ hd) * (2.0 / x.shape[0])
    return out


# Experts solved at once by `_gptq_experts`: their float64 Hessians take at most this many bytes (the
# solve holds ~5 float64 copies of them). Small: batching more experts gains little (the factorizations
# are compute-bound) and a layer's peak memory is dominated by this buffer otherwise.
GPTQ_CHUNK_BYTES = 1 << 24
# On a GPU (float32 solves) each column step of the sweep is a few kernel launches whatever the batch:
# solving more experts at once is what makes it fast there.
GPTQ_CHUNK_BYTES_DEVICE = 1 << 30


def chunk_experts(k: int, device: torch.device) -> int:
    """Experts solved at once for in_features k on `device`."""
    if device.type == "cpu":
        return max(1, GPTQ_CHUNK_BYTES // (k * k * 8))
    return max(1, GPTQ_CHUNK_BYTES_DEVICE // (k * k * torch.empty((), dtype=solve_dtype(device)).element_size()))


# A layer's experts are solved in at least this many groups when it has that many experts: a group is the
# unit of work of one rank in a distributed pass (calib/parallel.py), and the groups are the same whatever
# the world size, so that every solve sees the same operands as in one process.
SOLVE_GROUPS = 8


# The column sweep runs over several of a rank's solve groups at once (each factorized on its own, so that
# every factorization sees the same operands whatever the world size): each column step is ~10 small ops
# whatever the batch, so fewer, larger batches cost less. Bytes of float32 working set per sweep: the
# inverse factors, the weights and their transposed working copy, the codes.
GPTQ_SWEEP_BYTES = 32 << 20
GPTQ_SWEEP_BYTES_DEVICE = 8 << 30


def sweep_experts(k: int, n: int, group: int, device: torch.device) -> int:
    """Experts swept at once (whole solve groups, at least one) for matrices [n, k] on `device`."""
    per = 4 * (k * k + 3 * n * k)
    budget = GPTQ_SWEEP_BYTES if device.type == "cpu" else GPTQ_SWEEP_BYTES_DEVICE
    return max(1, budget // per // group) * group


def expert_group_size(num_experts: int, hidden: int, inter: int, device: torch.device) -> int:
    """Experts per solve group (and per unit of expert ownership): at most `chunk_experts` for both of the
    experts' matrices, and small enough for SOLVE_GROUPS groups. Depends on the layer only."""
    cap = -(-int(num_experts) // SOLVE_GROUPS)
    return max(1, min(chunk_experts(hidden, device), chunk_experts(inter, device), cap))


def expert_owners(num_experts: int, group: int, par) -> list[int]:
    """The rank that accumulates and solves each expert: group g = e // group belongs to rank g % world."""
    size = par.size if par is not None else 1
    return [(e // group) % size for e in range(num_experts)]


def gptq_experts(res: LayerResult, ckpt, names, experts, g: WeightGroup, stats: ExpertStats, group: int | None = None,
                 par=None):
    """GPTQ for every expert of a layer, in solve groups of `group` experts (None: expert_group_size), several
    groups swept at once (`sweep_experts`, each group factorized on its own): weights are converted to
    float32, solved, dequantized and written back (true-sequential: the next layer sees quantized outputs)
    one sweep batch at a time, so besides the layer's Hessians only one batch's working set is ever in
    memory. With a distributed `par`, only the groups this rank owns are solved (their Hessians are the ones
    it accumulated); `share_expert_weights` then gives every rank the others' groups. Returns, in a
    distributed pass on an INT4 grid, each owned group's codes and group parameters by (param name, first
    expert): what `share_expert_weights` sends in place of the dequantized weights; else None."""
    E = stats.E
    dev = stats.device
    if group is None:
        group = expert_group_size(E, stats.H, stats.I, dev)
    rank = par.rank if par is not None else 0
    owner = expert_owners(E, group, par)
    owned = torch.tensor([o == rank for o in owner], dtype=torch.bool)
    low, min_tokens, fallback, mode = coverage(g.options, stats)
    held = (stats.slot >= 0).nonzero().flatten()  # the experts whose Hessians this rank holds, by slot
    if not torch.equal(held, owned.nonzero().flatten()):
        raise CalibrationError(f"the statistics hold the Hessians of experts {held.tolist()[:8]}..., "
                               f"this rank solves {owned.nonzero().flatten().tolist()[:8]}...")
    n_tok = stats.aff_counts if mode == "affinity" else stats.counts  # the tokens in each expert's Hessians
    counts = n_tok[held].clamp(min=1).float().to(dev)
    # the sums become 2/n-scaled Hessians in place: the statistics are not used after this
    h_gu = stats.h_gu.mul_((2.0 / counts)[:, None, None])
    h_down = stats.h_down.mul_((2.0 / counts)[:, None, None])
    slot = stats.slot.tolist()
    reasons = [None] * E
    use_rtn = torch.zeros(E, dtype=torch.bool)
    if low.any():
        ids = low.nonzero().flatten()
        if fallback == "rtn" and mode != "all":
            use_rtn[ids] = True
        else:
            mine = ids[owned[ids]]
            if stats.h_all_skipped:  # reduce() decided from the same counts and rule: cannot happen
                raise CalibrationError(f"experts {ids.tolist()[:8]} need the all-token Hessian, which was not summed")
            if mine.numel():
                rows = stats.slot[mine].to(dev)
                h_gu[rows] = stats.h_all * (2.0 / max(stats.total, 1))
                h_down[rows] = _all_token_down_hessians(stats, mine.to(dev))
        for e in ids.tolist():
            reasons[e] = ("stats: all tokens" if mode == "all" else
                          f"{int(n_tok[e])} {'affinity' if mode == 'affinity' else 'routed'} tokens "
                          f"< min_tokens {min_tokens}: "
                          + ("RTN" if use_rtn[e] else "Hessian from all tokens"))
    kw = dict(damp=g.options.damp, actorder=g.options.actorder,
              block_size=g.options.block_size, refit=g.options.refit_scales, refine=g.options.refine_sweeps)
    if g.options.observer != "minmax":
        kw["observer"] = g.options.observer
    half = stats.P // 2
    # fit_unquantized: the experts with routed (or affinity) statistics are fitted to the unquantized model's
    # outputs; fit_down: their down_proj alone, to the unquantized gate/up's outputs. Either way down_proj's
    # statistics are summed once gate/up are quantized (below). The weight of each kind's correction:
    alpha = {"gu": float(g.options.fit_unquantized) if stats.a_gu is not None else 0.0,
             "down": float(g.options.fit_unquantized or g.options.fit_down) if stats.defer_down else 0.0}
    packed = {} if par is not None and par.distributed and not g.scheme.for_in_features(stats.H).fp4 else None
    fitted = owned & ~low & ~use_rtn if alpha["down"] else torch.zeros(E, dtype=torch.bool)
    # held-out rows of every owned expert, the down inputs from the unquantized gate/up (computed before
    # the gate/up solves write their results back; a fitted expert's come from its quantized gate/up, below)
    heldout = ({e: stats.heldout_inputs(e, down=not bool(fitted[e])) for e in range(E) if owned[e]}
               if stats.holdout else None)
    a_gu = stats.a_gu.mul_((2.0 / counts)[:, None, None]) if alpha["gu"] else None
    # the fitted experts' held-out rows, per kind: (inputs, the unquantized model's inputs or None: the
    # same); down's are those of the quantized and of the unquantized gate/up, set once gate/up are quantized
    fit_ho: dict[int, dict] = {}
    if alpha["down"] and heldout is not None:
        fit_ho = {e: {"gu": (heldout[e][0], stats.heldout_reference(e) if alpha["gu"] else None)}
                  for e in range(E) if fitted[e]}
    src_dtype = source_dtype(ckpt, names.module(0, "gate") + ".weight")
    # each solve batch allocates and frees the same 1-32 MiB temporaries (factorizations, sweeps, refits):
    # served from the heap, not as fresh mappings faulted in again for every batch (weights.reuse_heap)
    with reuse_heap():
        for key, param, h in (("gu", experts.gate_up_proj, h_gu), ("down", experts.down_proj, h_down)):
            k = param.shape[-1]
            s = g.scheme.for_in_features(k)
            parts = (("gate", slice(0, half)), ("up", slice(half, stats.P))) if key == "gu" else (("down", slice(None)),)
            mine = [(i0, min(E, i0 + group)) for i0 in range(0, E, group) if owner[i0] == rank]
            per = max(1, sweep_experts(k, param.shape[1], group, dev) // group)  # groups per sweep
            for b0 in range(0, len(mine), per):
                ids = [e for i0, i1 in mine[b0:b0 + per] for e in range(i0, i1)]
                idx = torch.tensor(ids, device=param.device)
                w = param.data.index_select(0, idx).float()  # [c, N, K]
                hb = h[slot[ids[0]]:slot[ids[0]] + len(ids)]  # the owned experts' slots are consecutive, in expert order
                # fitted experts: GPTQ quantizes the weights that fit the unquantized model (quant/gptq.py `fit`)
                fit_rows = fitted[idx.cpu()]
                fit = None
                if fit_rows.any() and alpha[key]:
                    ab = (a_gu if key == "gu" else stats.a_down)[slot[ids[0]]:slot[ids[0]] + len(ids)]
                    fit = (ab, fit_rows.to(dev, torch.float32) * alpha[key])
                r, grid = _solve(w, hb, s, factor_chunk=group, fit=fit, **kw)
                q, qp = r.q, r.qparams
                # a matrix none of whose inputs was seen (e.g. down_proj behind an all-zero up_proj): GPTQ would
                # zero every weight (never-seen inputs' weights are dropped); RTN keeps them
                unseen = _unseen(hb).cpu()
                rtn_now = use_rtn.clone()
                rtn_now[idx.cpu()[unseen]] = True
                sel = rtn_now[idx.cpu()]
                if sel.any():
                    _rtn_into(q, qp, grid, w, s, sel.to(dev))
                checks = None
                if heldout is not None:
                    def retry(sub: list[int], factor: float):  # called within this iteration only
                        fs = None if fit is None else (fit[0][sub], fit[1][sub])
                        rs, _ = _solve(w[sub], hb[sub], s, factor_chunk=group, fit=fs, **{**kw, "damp": kw["damp"] * factor})
                        return rs.q, rs.qparams, rs.damping
                    pairs = [fit_ho[e][key] if e in fit_ho else (heldout[e][0 if key == "gu" else 1], None) for e in ids]
                    checks = _heldout_check(w, q, qp, grid, s, parts, ids, rtn_now, [x for x, _ in pairs],
                                            retry=retry if grid is None else None, refs=[xr for _, xr in pairs])
                deq = dequantize(q, qp.scale, qp.zero_point) if grid is None else grid.dequantize(q)  # [c, N, K]
                if key == "gu" and alpha["down"]:  # down_proj's statistics from the quantized gate/up, before
                    # they are written back
                    for j, e in enumerate(ids):
                        if not fitted[e]:
                            continue
                        hs, as_ = stats.down_statistics(e, deq[j], w[j], float(counts[slot[e]]))
                        h_down[slot[e]] = hs
                        stats.a_down[slot[e]] = as_
                        if e in fit_ho:
                            x_ho, xr_ho = fit_ho[e]["gu"]
                            fit_ho[e]["down"] = (stats.down_inputs(x_ho, deq[j]),
                                                 stats.down_inputs(x_ho if xr_ho is None else xr_ho, w[j]))
                sq = {kind: sqnr_db(w[:, rows], deq[:, rows], dim=(-2, -1)).tolist() for kind, rows in parts} \
                    if dev.type != "cpu" else None  # one transfer per chunk on a GPU, not one per expert
                qh = q.cpu()  # emitted from the host (a no-op on the CPU)
                sh, zh = qp.scale.cpu(), None if qp.zero_point is None else qp.zero_point.cpu()
                damping, fb = r.damping.tolist(), r.fallback
                for j, e in enumerate(ids):
                    meta = {"method": "gptq" if not rtn_now[e] else "rtn", "tokens": int(stats.counts[e]),
                            "fallback": reasons[e] or (UNSEEN if unseen[j] else fb[j]),
                            "damping": round(float(damping[j]), 6)}
                    if mode == "affinity":
                        meta["affinity_tokens"] = int(stats.aff_counts[e])
                    if stats.pool_counts[e]:
                        meta["pool_tokens"] = int(stats.pool_counts[e])  # of `tokens`, from the top-up pool
                    if fitted[e] and not unseen[j] and alpha[key]:  # solved against the unquantized outputs
                        meta["fit_unquantized" if g.options.fit_unquantized else "fit_down"] = alpha[key]
                    for kind, rows in parts:
                        db = sq[kind][j] if sq is not None else float(sqnr_db(w[j, rows], deq[j, rows]))
                        m = {**meta, "sqnr_db": round(db, 4)}
                        if checks is not None and not rtn_now[e]:
                            m.update(checks[j][kind])
                        if grid is not None:
                            mod = names.module(e, kind)
                            emit_tensors(res, mod, grid.tensors(mod, j, rows, q[j, rows]), s, m)
                            continue
                        zp = None if zh is None else zh[j, rows]
                        emit(res, names.module(e, kind), qh[j, rows], QParams(sh[j, rows], zp), s, src_dtype, m)
                param.data.index_copy_(0, idx, deq.to(param.dtype))
                if packed is not None:  # the codes travel instead (int8, a quarter of float32's bytes)
                    j0 = 0
                    for i0, i1 in mine[b0:b0 + per]:
                        zp = None if qp.zero_point is None else qp.zero_point[j0:j0 + i1 - i0].to(torch.int32)
                        packed[(key, i0)] = (q[j0:j0 + i1 - i0].to(torch.int8), qp.scale[j0:j0 + i1 - i0].float(), zp)
                        j0 += i1 - i0
                del w, r, q, qp, deq
    return packed


# Where RTN beats GPTQ on an expert's held-out rows, the expert is solved again with its damping raised by
# these factors (0.01 -> 0.1 -> 1 of mean(diag H) by default): a nearly singular Hessian over-fits less, and
# the damped solve often beats both (INT4 grids; FP4 keeps the choice between GPTQ and RTN).
RETRY_DAMPING = (10.0, 100.0)


def _heldout_check(w: torch.Tensor, q: torch.Tensor, qp: QParams, grid, s, parts, ids: list[int],
                   use_rtn: torch.Tensor, xs: list[torch.Tensor], retry=None,
                   refs: list[torch.Tensor | None] | None = None) -> list[dict]:
    """Never worse than RTN on tokens the solve did not see: for each expert j of the batch (weights w [c, N, K],
    GPTQ's codes q and qparams, changed in place) and each part (gate, up / down), the output error
    ||X (W - Q)^T||^2 on its held-out inputs X = xs[j] [m, K] of GPTQ's result and of RTN's. `retry(sub,
    factor)` (INT4): GPTQ of batch experts `sub` with the damping multiplied by `factor` -> (codes, qparams,
    damping); it runs for the experts where RTN did better on some part, each factor of RETRY_DAMPING in turn,
    and its result competes too. Each part's rows take the codes (and INT4 scales) of the candidate with the
    least error, the solve's own on ties. Returns per expert {part: manifest fields}: `method` (gptq or rtn),
    `heldout` {tokens, gptq, rtn, `retries` [{damping, error}] where retried, `kept`: solve, rtn or retry},
    errors relative to ||X W^T||^2, and `damping` where a retried solve was kept.

    `refs` (fit_unquantized, or fit_down for down_proj): per expert, the inputs the unquantized model (fit_down:
    the unquantized gate/up) gives the matrix for the same held-out rows, X_ref (None: X): the error of a
    candidate D is then ||X_ref W^T - X D^T||^2, relative to ||X_ref W^T||^2."""
    dev = w.device
    if grid is None:
        rr = rtn(w, s.num_bits, s.group_size, s.symmetric)
        q_r, s_r = rr.q.to(dev), rr.qparams.scale.to(dev)
        z_r = None if rr.qparams.zero_point is None else rr.qparams.zero_point.to(dev)
        deq_r = dequantize(q_r, s_r, z_r)
        deq_g = dequantize(q, qp.scale, qp.zero_point)
    else:
        q_r = grid.rtn(w, slice(None)).to(dev)
        deq_r, deq_g = grid.dequantize(q_r), grid.dequantize(q)
    n = w.shape[1]

    def errors(j: int, x: torch.Tensor, deqs: list[torch.Tensor]) -> tuple[float, list[list[float]]]:
        """||X W^T||^2 per part and each candidate's ||X (W - D)^T||^2 per part, from one product (with a
        reference X_ref: ||X_ref W^T||^2 and ||X_ref W^T - X D^T||^2)."""
        if refs is not None and refs[j] is not None:
            t = refs[j].to(device=dev, dtype=torch.float32) @ w[j].T
            y = torch.cat([t] + [t - x @ d.T for d in deqs], dim=1)
        else:
            y = x @ torch.cat([w[j]] + [w[j] - d for d in deqs]).T
        parts_of = [[float(y[:, i * n:(i + 1) * n][:, rows].double().square().sum()) for _, rows in parts]
                    for i in range(len(deqs) + 1)]
        return parts_of[0], parts_of[1:]

    xs = [x.to(device=dev, dtype=torch.float32) for x in xs]
    todo = [j for j in range(len(ids)) if xs[j].shape[0] and not bool(use_rtn[ids[j]])]
    base = {j: errors(j, xs[j], [deq_g[j], deq_r[j]]) for j in todo}
    # candidates per expert: (error per part, codes, qparams, damping), the solve's first, then RTN's
    cands = {j: [(base[j][1][0], q[j], QParams(qp.scale[j], None if qp.zero_point is None else qp.zero_point[j]),
                  None),
                 (base[j][1][1], q_r[j], None if grid is not None else QParams(s_r[j], None if z_r is None else z_r[j]),
                  None)] for j in todo}
    retries = {j: [] for j in todo}
    if retry is not None:
        sub = [j for j in todo if any(er < eg for eg, er in zip(*base[j][1]))]
        for factor in RETRY_DAMPING if sub else ():
            rq, rqp, rdamp = retry(sub, factor)
            deq_d = dequantize(rq, rqp.scale, rqp.zero_point)
            for i, j in enumerate(sub):
                _, (ed,) = errors(j, xs[j], [deq_d[i]])
                retries[j].append({"damping": round(float(rdamp[i]), 6), "error": ed})
                cands[j].append((ed, rq[i], QParams(rqp.scale[i], None if rqp.zero_point is None
                                                    else rqp.zero_point[i]), float(rdamp[i])))
    out = []
    for j in range(len(ids)):
        if j not in base:
            out.append({kind: {"heldout": {"tokens": int(xs[j].shape[0])}} for kind, _ in parts})
            continue
        ref = base[j][0]
        res = {}
        for p, (kind, rows) in enumerate(parts):
            best = min(range(len(cands[j])), key=lambda c: (cands[j][c][0][p], c))
            err, cq, cqp, damping = cands[j][best]
            if best:
                q[j, rows] = cq[rows]
                if grid is None:
                    qp.scale[j, rows] = cqp.scale[rows]
                    if qp.zero_point is not None:
                        qp.zero_point[j, rows] = cqp.zero_point[rows]
            den = ref[p] if ref[p] > 0 else 1.0
            held = {"tokens": int(xs[j].shape[0]), "gptq": float(f"{cands[j][0][0][p] / den:.6g}"),
                    "rtn": float(f"{cands[j][1][0][p] / den:.6g}")}
            if retries[j]:
                held["retries"] = [{"damping": r["damping"], "error": float(f"{r['error'][p] / den:.6g}")}
                                   for r in retries[j]]
            held["kept"] = ("solve", "rtn")[best] if best < 2 else "retry"
            res[kind] = {"method": "rtn" if best == 1 else "gptq", "heldout": held}
            if best >= 2:
                res[kind]["damping"] = round(damping, 6)
        out.append(res)
    return out


def share_expert_weights(experts, group: int, par, packed: dict | None = None, scheme=None) -> None:
    """Distributed: every group's quantized gate/up and down weights, broadcast from the rank that solved it,
    so that every rank holds the quantized layer for the next forward. A no-op in one process.

    With `packed` (gptq_experts' codes and group parameters of this rank's groups; INT4 grids, `scheme` the
    group's) the codes (int8), scales (float32) and zero points travel and each receiver dequantizes them
    as the owner did (`dequantize`, elementwise: the same float32 values), 0.28x the bytes of the
    dequantized float32 weights at group size 32; else (FP4 grids) the dequantized weights themselves."""
    if par is None or not par.distributed:
        return
    E = experts.gate_up_proj.shape[0]
    owner = expert_owners(E, group, par)
    jobs = []
    for key, param in (("gu", experts.gate_up_proj), ("down", experts.down_proj)):
        for i0 in range(0, E, group):
            i1 = min(E, i0 + group)
            recv = None  # (param, first expert, received parts) to dequantize once they arrive
            if packed is None:
                parts = (param.data[i0:i1],)
            elif owner[i0] == par.rank:
                parts = packed[(key, i0)]
            else:
                _, n, k = param.shape
                s = scheme.for_in_features(k)
                shape = (i1 - i0, n, k // (s.group_size or k))
                parts = (torch.empty(i1 - i0, n, k, dtype=torch.int8, device=param.device),
                         torch.empty(shape, dtype=torch.float32, device=param.device),
                         None if s.symmetric else torch.empty(shape, dtype=torch.int32, device=param.device))
                recv = (param, i0, parts)
            jobs.append((recv, [par.broadcast_async(t, owner[i0]) for t in parts if t is not None]))
    for recv, waits in jobs:  # posted at once: every rank sends its groups while it receives the others'
        for wait in waits:
            wait()
        if recv is not None:
            param, i0, (q, scale, zp) = recv
            param.data[i0:i0 + q.shape[0]] = dequantize(q, scale, zp).to(param.dtype)
