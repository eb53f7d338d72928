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

from dataclasses import replace

import torch
from torch import nn

from ..errors import CalibrationError
from ..match.recipe import WeightGroup
from ..pack.layout import fp4_module
from ..quant import fp4
from ..quant.gptq import FixedGrid, GPTQArgs, gptq, refine_codes, refit_scales
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


def solve_args(s, options, device: torch.device, factor_chunk: int | None = None) -> GPTQArgs:
    """GPTQ's arguments (quant/gptq.py GPTQArgs) for the scheme `s` (an FP4 grid: its 4-bit codes, symmetric) and
    a group's GPTQOptions (damp, actorder, block_size, observer), solved on `device`, `factor_chunk` matrices
    factorized at a time (None: all)."""
    return GPTQArgs(num_bits=4 if s.fp4 else s.num_bits, group_size=s.group_size,
                    symmetric=True if s.fp4 else s.symmetric, damp=options.damp, block_size=options.block_size,
                    actorder=options.actorder, observer=options.observer, solve_dtype=solve_dtype(device),
                    factor_chunk=factor_chunk)


def _solve(w: torch.Tensor, h: torch.Tensor, s, args: GPTQArgs, options=None, fit=None):
    """GPTQ of w [c, N, K] under `args` (solve_args): (result, FP4 grid or None). INT4 chooses its group
    parameters in the sweep; with `options` (a group's GPTQOptions; None: neither of these), `refit_scales`
    (INT4): then its group scales are refitted to the codes and zero points (quant/gptq.py refit_scales);
    `refine_sweeps` (INT4): then that many coordinate-descent sweeps move the codes under the final scales
    (quant/gptq.py refine_codes). With `fit` (quant/gptq.py gptq) both work on the fitted weights the solve
    quantized; an FP4 grid's scales are chosen from the weights as they are."""
    if not s.fp4:
        r = gptq(w, h, args, fit=fit)
        wt = w if r.target is None else r.target
        if options is not None and options.refit_scales:
            r.qparams.scale.copy_(refit_scales(wt, r.q, r.qparams.scale, h, r.damping, solve_dtype=args.solve_dtype,
                                               zero_point=r.qparams.zero_point)[0])
        if options is not None and options.refine_sweeps:
            r.q.copy_(refine_codes(wt, r.q, r.qparams, h, r.damping, num_bits=s.num_bits,
                                   sweeps=options.refine_sweeps)[0])
        return r, None
    weight = torch.diagonal(h, dim1=-2, dim2=-1).float() if args.observer == "mse" else None
    grid = _FP4Grid(s, w, weight)
    return gptq(w, h, args, grid=FixedGrid(grid.eff, fp4.quantize_column), fit=fit), grid


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
    r, grid = _solve(w[None], h, s, solve_args(s, g.options, w.device), g.options)
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
    job = _ExpertSolves(res, ckpt, names, experts, g, stats, group, par)
    # each solve batch allocates and frees the same 1-32 MiB temporaries (factorizations, sweeps, refits):
    # served from the heap, not as fresh mappings faulted in again for every batch (weights.reuse_heap)
    with reuse_heap():
        for key in ("gu", "down"):
            job.solve_all(key)
    return job.packed


class _Batch:
    """One sweep batch of experts `ids` of a layer's gate/up or down weights: what its solve, its checks and its
    emission share."""

    def __init__(self, ids: list[int], w: torch.Tensor, hb: torch.Tensor, idx: torch.Tensor):
        self.ids, self.w, self.hb, self.idx = ids, w, hb, idx  # w [c, N, K] float32, hb [c, K, K]
        self.fit = None  # (cross-Grams, alpha) of the fitted experts (quant/gptq.py `fit`)
        self.r = self.grid = self.q = self.qp = self.deq = self.checks = None
        self.unseen = self.rtn_now = None


class _ExpertSolves:
    """One layer's expert solves (`gptq_experts`): the Hessians, each expert's coverage and fallback, and the
    fit and held-out state every solve batch reads."""

    def __init__(self, res: LayerResult, ckpt, names, experts, g: WeightGroup, stats: ExpertStats, group: int | None,
                 par):
        self.res, self.names, self.experts, self.g, self.stats, self.par = res, names, experts, g, stats, par
        self.E = E = stats.E
        self.dev = stats.device
        self.group = expert_group_size(E, stats.H, stats.I, self.dev) if group is None else group
        self.rank = par.rank if par is not None else 0
        self.owner = expert_owners(E, self.group, par)
        self.owned = torch.tensor([o == self.rank for o in self.owner], dtype=torch.bool)
        self._hessians()
        self._fit_state()
        self.packed = {} if par is not None and par.distributed and not g.scheme.for_in_features(stats.H).fp4 else None
        self.src_dtype = source_dtype(ckpt, names.module(0, "gate") + ".weight")

    def _hessians(self) -> None:
        """The held Hessians scaled to 2/n in place, and each expert's coverage: the experts below it take the
        all-token Hessians (`fallback: all_tokens`) or RTN (`use_rtn`), with the reason (`reasons`)."""
        stats, owned, dev, E = self.stats, self.owned, self.dev, self.E
        low, min_tokens, fallback, mode = coverage(self.g.options, stats)
        self.low, self.mode = low, mode
        held = (stats.slot >= 0).nonzero().flatten()  # the experts whose Hessians this rank holds, by slot
        if not torch.equal(held, owned.nonzero().flatten()):
            raise CalibrationError(f"the statistics hold the Hessians of experts {held.tolist()[:8]}..., "
                                   f"this rank solves {owned.nonzero().flatten().tolist()[:8]}...")
        n_tok = stats.aff_counts if mode == "affinity" else stats.counts  # the tokens in each expert's Hessians
        self.counts = counts = n_tok[held].clamp(min=1).float().to(dev)
        # the sums become 2/n-scaled Hessians in place: the statistics are not used after this
        self.h = {"gu": stats.h_gu.mul_((2.0 / counts)[:, None, None]),
                  "down": stats.h_down.mul_((2.0 / counts)[:, None, None])}
        self.slot = stats.slot.tolist()
        self.reasons = [None] * E
        self.use_rtn = torch.zeros(E, dtype=torch.bool)
        if not low.any():
            return
        ids = low.nonzero().flatten()
        if fallback == "rtn" and mode != "all":
            self.use_rtn[ids] = True
        else:
            mine = ids[owned[ids]]
            if stats.h_all_skipped:  # reduce() decided from the same counts and rule: cannot happen
                raise CalibrationError(f"experts {ids.tolist()[:8]} need the all-token Hessian, which was not summed")
            if mine.numel():
                rows = stats.slot[mine].to(dev)
                self.h["gu"][rows] = stats.h_all * (2.0 / max(stats.total, 1))
                self.h["down"][rows] = _all_token_down_hessians(stats, mine.to(dev))
        for e in ids.tolist():
            self.reasons[e] = ("stats: all tokens" if mode == "all" else
                               f"{int(n_tok[e])} {'affinity' if mode == 'affinity' else 'routed'} tokens "
                               f"< min_tokens {min_tokens}: "
                               + ("RTN" if self.use_rtn[e] else "Hessian from all tokens"))

    def _fit_state(self) -> None:
        """fit_unquantized: the experts with routed (or affinity) statistics are fitted to the unquantized model's
        outputs; fit_down: their down_proj alone, to the unquantized gate/up's outputs. Either way down_proj's
        statistics are summed once gate/up are quantized (`_down_statistics`). `alpha`: the weight of each
        kind's correction; `heldout`: every owned expert's held-out rows; `fit_ho`: the fitted experts'."""
        stats, o, E = self.stats, self.g.options, self.E
        self.alpha = {"gu": float(o.fit_unquantized) if stats.a_gu is not None else 0.0,
                      "down": float(o.fit_unquantized or o.fit_down) if stats.defer_down else 0.0}
        self.fitted = (self.owned & ~self.low & ~self.use_rtn if self.alpha["down"]
                       else torch.zeros(E, dtype=torch.bool))
        # held-out rows of every owned expert, the down inputs from the unquantized gate/up (computed before
        # the gate/up solves write their results back; a fitted expert's come from its quantized gate/up, below)
        self.heldout = ({e: stats.heldout_inputs(e, down=not bool(self.fitted[e])) for e in range(E) if self.owned[e]}
                        if stats.holdout else None)
        self.a_gu = stats.a_gu.mul_((2.0 / self.counts)[:, None, None]) if self.alpha["gu"] else None
        # the fitted experts' held-out rows, per kind: (inputs, the unquantized model's inputs or None: the
        # same); down's are those of the quantized and of the unquantized gate/up, set once gate/up are quantized
        self.fit_ho: dict[int, dict] = {}
        if self.alpha["down"] and self.heldout is not None:
            self.fit_ho = {e: {"gu": (self.heldout[e][0], stats.heldout_reference(e) if self.alpha["gu"] else None)}
                           for e in range(E) if self.fitted[e]}

    def solve_all(self, key: str) -> None:
        """Solve, check, emit and write back this rank's experts' gate/up ("gu") or down ("down") weights, a
        sweep batch of solve groups at a time."""
        param = self.experts.gate_up_proj if key == "gu" else self.experts.down_proj
        k, E, group = param.shape[-1], self.E, self.group
        s = self.g.scheme.for_in_features(k)
        half = self.stats.P // 2
        parts = ((("gate", slice(0, half)), ("up", slice(half, self.stats.P))) if key == "gu"
                 else (("down", slice(None)),))
        mine = [(i0, min(E, i0 + group)) for i0 in range(0, E, group) if self.owner[i0] == self.rank]
        per = max(1, sweep_experts(k, param.shape[1], group, self.dev) // group)  # groups per sweep
        args = solve_args(s, self.g.options, self.dev, factor_chunk=group)
        for b0 in range(0, len(mine), per):
            ids = [e for i0, i1 in mine[b0:b0 + per] for e in range(i0, i1)]
            idx = torch.tensor(ids, device=param.device)
            first = self.slot[ids[0]]  # the owned experts' slots are consecutive, in expert order
            b = _Batch(ids, param.data.index_select(0, idx).float(), self.h[key][first:first + len(ids)], idx)
            self._solve(b, key, s, args, parts)
            if key == "gu" and self.alpha["down"]:  # down_proj's statistics from the quantized gate/up, before
                self._down_statistics(b)  # they are written back
            self._emit(b, key, s, parts)
            param.data.index_copy_(0, idx, b.deq.to(param.dtype))
            if self.packed is not None:  # the codes travel instead (int8, a quarter of float32's bytes)
                j0 = 0
                for i0, i1 in mine[b0:b0 + per]:
                    zp = None if b.qp.zero_point is None else b.qp.zero_point[j0:j0 + i1 - i0].to(torch.int32)
                    self.packed[(key, i0)] = (b.q[j0:j0 + i1 - i0].to(torch.int8),
                                              b.qp.scale[j0:j0 + i1 - i0].float(), zp)
                    j0 += i1 - i0
            del b

    def _solve(self, b: _Batch, key: str, s, args: GPTQArgs, parts) -> None:
        """GPTQ of the batch (fitted experts: the weights that fit the unquantized model, quant/gptq.py `fit`),
        RTN for the experts that take it, the held-out check, and the dequantized result (`b.deq`)."""
        w, hb, dev = b.w, b.hb, self.dev
        fit_rows = self.fitted[b.idx.cpu()]
        if fit_rows.any() and self.alpha[key]:
            ab = (self.a_gu if key == "gu" else self.stats.a_down)[self.slot[b.ids[0]]:self.slot[b.ids[0]] + len(b.ids)]
            b.fit = (ab, fit_rows.to(dev, torch.float32) * self.alpha[key])
        b.r, b.grid = _solve(w, hb, s, args, self.g.options, b.fit)
        b.q, b.qp = b.r.q, b.r.qparams
        # a matrix none of whose inputs was seen (e.g. down_proj behind an all-zero up_proj): GPTQ would
        # zero every weight (never-seen inputs' weights are dropped); RTN keeps them
        b.unseen = _unseen(hb).cpu()
        b.rtn_now = self.use_rtn.clone()
        b.rtn_now[b.idx.cpu()[b.unseen]] = True
        sel = b.rtn_now[b.idx.cpu()]
        if sel.any():
            _rtn_into(b.q, b.qp, b.grid, w, s, sel.to(dev))
        if self.heldout is not None:
            def retry(sub: list[int], factor: float):  # called within this batch's check only
                fs = None if b.fit is None else (b.fit[0][sub], b.fit[1][sub])
                rs, _ = _solve(w[sub], hb[sub], s, replace(args, damp=args.damp * factor), self.g.options, fs)
                return rs.q, rs.qparams, rs.damping
            rows = [self.fit_ho[e][key] if e in self.fit_ho else (self.heldout[e][0 if key == "gu" else 1], None)
                    for e in b.ids]
            b.checks = _heldout_check(w, b.q, b.qp, b.grid, s, parts, sel, rows,
                                      retry=retry if b.grid is None else None)
        b.deq = dequantize(b.q, b.qp.scale, b.qp.zero_point) if b.grid is None else b.grid.dequantize(b.q)  # [c, N, K]

    def _down_statistics(self, b: _Batch) -> None:
        """The fitted experts' down_proj statistics (and held-out down inputs) from their quantized gate/up."""
        stats = self.stats
        for j, e in enumerate(b.ids):
            if not self.fitted[e]:
                continue
            slot = self.slot[e]
            hs, as_ = stats.down_statistics(e, b.deq[j], b.w[j], float(self.counts[slot]))
            self.h["down"][slot] = hs
            stats.a_down[slot] = as_
            if e in self.fit_ho:
                x_ho, xr_ho = self.fit_ho[e]["gu"]
                self.fit_ho[e]["down"] = (stats.down_inputs(x_ho, b.deq[j]),
                                          stats.down_inputs(x_ho if xr_ho is None else xr_ho, b.w[j]))

    def _emit(self, b: _Batch, key: str, s, parts) -> None:
        """Every module of the batch's experts into the layer's result, with its manifest fields."""
        stats, w, deq, q = self.stats, b.w, b.deq, b.q
        sq = {kind: sqnr_db(w[:, rows], deq[:, rows], dim=(-2, -1)).tolist() for kind, rows in parts} \
            if self.dev.type != "cpu" else None  # one transfer per chunk on a GPU, not one per expert
        qh = q.cpu()  # emitted from the host (a no-op on the CPU)
        sh, zh = b.qp.scale.cpu(), None if b.qp.zero_point is None else b.qp.zero_point.cpu()
        damping, fb = b.r.damping.tolist(), b.r.fallback
        for j, e in enumerate(b.ids):
            meta = {"method": "gptq" if not b.rtn_now[e] else "rtn", "tokens": int(stats.counts[e]),
                    "fallback": self.reasons[e] or (UNSEEN if b.unseen[j] else fb[j]),
                    "damping": round(float(damping[j]), 6)}
            if self.mode == "affinity":
                meta["affinity_tokens"] = int(stats.aff_counts[e])
            if stats.pool_counts[e]:
                meta["pool_tokens"] = int(stats.pool_counts[e])  # of `tokens`, from the top-up pool
            if self.fitted[e] and not b.unseen[j] and self.alpha[key]:  # solved against the unquantized outputs
                meta["fit_unquantized" if self.g.options.fit_unquantized else "fit_down"] = self.alpha[key]
            for kind, rows in parts:
                db = sq[kind][j] if sq is not None else float(sqnr_db(w[j, rows], deq[j, rows]))
                m = {**meta, "sqnr_db": round(db, 4)}
                if b.checks is not None and not b.rtn_now[e]:
                    m.update(b.checks[j][kind])
                if b.grid is not None:
                    mod = self.names.module(e, kind)
                    emit_tensors(self.res, mod, b.grid.tensors(mod, j, rows, q[j, rows]), s, m)
                    continue
                zp = None if zh is None else zh[j, rows]
                emit(self.res, self.names.module(e, kind), qh[j, rows], QParams(sh[j, rows], zp), s, self.src_dtype, m)


# Where RTN beats GPTQ on an expert's held-out rows, the expert is solved again with its damping raised by
# these factors (0.01 -> 0.1 -> 1 of mean(diag H) by default): a nearly singular Hessian over-fits less, and
# the damped solve often beats both (INT4 grids; FP4 keeps the choice between GPTQ and RTN).
RETRY_DAMPING = (10.0, 100.0)


def _heldout_check(w: torch.Tensor, q: torch.Tensor, qp: QParams, grid, s, parts, skip: torch.Tensor,
                   heldout: list[tuple[torch.Tensor, torch.Tensor | None]], retry=None) -> list[dict]:
    """Never worse than RTN on tokens the solve did not see: for each expert j of the batch (weights w [c, N, K],
    GPTQ's codes q and qparams, changed in place) that does not take RTN (`skip` [c] bool) and each part (gate,
    up / down), the output error ||X (W - Q)^T||^2 on its held-out inputs X = heldout[j][0] [m, K] of GPTQ's
    result and of RTN's. `retry(sub, factor)` (INT4): GPTQ of batch experts `sub` with the damping multiplied by
    `factor` -> (codes, qparams, damping); it runs for the experts where RTN did better on some part, each
    factor of RETRY_DAMPING in turn, and its result competes too. Each part's rows take the codes (and INT4
    scales) of the candidate with the least error, the solve's own on ties. Returns per expert {part: manifest
    fields}: `method` (gptq or rtn), `heldout` {tokens, gptq, rtn, `retries` [{damping, error}] where retried,
    `kept`: solve, rtn or retry}, errors relative to ||X W^T||^2, and `damping` where a retried solve was kept.

    `heldout[j][1]` (fit_unquantized, or fit_down for down_proj): the inputs the unquantized model (fit_down:
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
        if refs[j] is not None:
            t = refs[j].to(device=dev, dtype=torch.float32) @ w[j].T
            y = torch.cat([t] + [t - x @ d.T for d in deqs], dim=1)
        else:
            y = x @ torch.cat([w[j]] + [w[j] - d for d in deqs]).T
        parts_of = [[float(y[:, i * n:(i + 1) * n][:, rows].double().square().sum()) for _, rows in parts]
                    for i in range(len(deqs) + 1)]
        return parts_of[0], parts_of[1:]

    xs = [x.to(device=dev, dtype=torch.float32) for x, _ in heldout]
    refs = [xr for _, xr in heldout]
    todo = [j for j in range(len(heldout)) if xs[j].shape[0] and not bool(skip[j])]
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
    for j in range(len(heldout)):
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
