"""Statistics a calibrated pass collects in one forward of a decoder layer: per-expert Hessians of the
tokens the router sends to each expert (one Gram per expert and forward batch, summed in batch order),
Hessians of dense Linears, token counts and bounded token samples (for AWQ's searches and for experts that
see too few tokens), and the expert coverage policy (which experts fall back, and to what). With several
ranks the statistics are reduced to the rank that owns each expert or module (calib/parallel.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import timeline
from ..errors import CalibrationError
from ..match.recipe import affinity_experts
from . import moe

# Legend: E = experts, T = tokens, H = hidden, I = expert intermediate, P = 2*I (gate+up rows)
PAD_RATIO = 0.75  # routed_blocks: an expert joins a chunk with at least this share of its busiest's tokens
PAIR_BUDGET = 1 << 26  # bytes of padded [E, T, *] activations processed at once when batching over experts


@dataclass(frozen=True)
class HessianOptions:
    """What GPTQ's expert Hessians are summed over besides the routed tokens (ExpertStats, which describes
    each): `holdout` k (every k-th routed token held out; 0: none), `router` and `affinity_top_k` (`stats:
    affinity`), `primary_tokens` and `balance_tokens` (the top-up pool), `reference` (fit_unquantized: the
    unquantized model's expert inputs of each forward call) and `fit_down`. Read only with need_hessians."""

    holdout: int = 0
    router: nn.Module | None = None
    affinity_top_k: int | str | None = None
    primary_tokens: int | None = None
    balance_tokens: int | None = None
    reference: list[torch.Tensor] | None = None
    fit_down: bool = False


class ExpertStats:
    """Hooks `experts.forward(hidden [T, H], top_k_index [T, k], top_k_weights)` and accumulates, per expert,
    the routed-token Hessians of gate/up inputs and of down inputs, token counts, and (for AWQ / fallbacks)
    bounded token samples. The routing of each call is the one the batched expert forward uses
    (`moe.routing_for`: sorted once per call). Hessians and samples live on the experts' device, in float32;
    the counts on the host.

    `h_gu` / `h_down` hold the experts this rank accumulates (all of them in one process), expert e's at row
    `slot[e]`: on 8 ranks each holds 1/8 of a layer's Hessians (Kimi K2: ~10 GiB instead of ~80 GiB).

    Each forward call (one batch of the executor's batch plan) adds, for each expert, the Gram of exactly
    the rows routed to it in that batch (one `mm` on those rows, in ascending token order): an expert's sum
    depends on nothing but its own rows and the batch order. With a distributed `par` (calib/parallel.py)
    the hook only records its rank's batches; `reduce()` then replays every batch in batch order on every
    rank (the forwarding rank broadcasts its inputs and routing), each rank adding the Grams of the experts
    it owns (`owned`), so that the sums are the ones a single process computes."""

    def __init__(self, experts: nn.Module, need_hessians: bool, sample_tokens: int, block: nn.Module | None = None,
                 par=None, owned: torch.Tensor | None = None, options: HessianOptions = HessianOptions()):
        """`block`: the MoE block around `experts`; when given, its outputs for the sampled tokens are kept
        too (`block_outputs`: the unquantized block's response AWQ's norm-scale search measures against).
        `par`: the pass's Parallel (None: one process); `owned` [E] bool: the experts whose Hessians this
        rank accumulates (None: all). The fields of `options` (GPTQ's, HessianOptions): `holdout` k >= 2:
        every k-th token routed to an expert (counted over the whole pass, in batch order and ascending token
        order within a batch) is left out of its Hessians and kept as a held-out row (`heldout_inputs`) for GPTQ's check against RTN; 0: none.
        `router` (GPTQ's `stats: affinity`): each expert's Hessians then sum, over every token among its
        router's `affinity_top_k` preferred (an integer, or "nk": n times the call's top-k; None: every
        token), x x^T weighted by the router's affinity for that pair (`moe.router_affinities`), the forward
        still following the router's real top-k; rows held out of the routed tokens stay out (`aff_counts`:
        each expert's tokens in the affinity set, held-out rows included, like `counts`).

        `primary_tokens` (GPTQ's `balance_tokens`, with a top-up pool): the layer's rows after the first
        `primary_tokens` (in batch order; calib/spool.py puts the pool last) are the pool's. They count for
        nothing but the top-up: an expert with fewer than `balance_tokens` routed rows gets the pool's rows
        routed to it, in order, until it has that many (`_top_up`); `total`, samples, held-out rows and the
        all-token Hessian stay the calibration samples'.

        `reference` (GPTQ's fit_unquantized): the unquantized model's inputs to the experts for the same
        tokens, [rows, H] per forward call in batch order (executor.forward_capture; distributed: this rank's
        calls, replayed with the others' by `reduce`). Each expert
        then also sums the cross-Gram X_ref^T X of its rows (`a_gu`, weighted like its Hessian), keeps each
        call's inputs and the rows each expert took (`rows_of`), and its held-out rows' reference inputs;
        its down_proj statistics are not summed in the forward but after its gate/up are quantized
        (`down_statistics`), from the quantized gate/up's outputs. `fit_down` (GPTQ's fit_down): the same for
        down_proj alone, without a reference: each call's inputs and the rows each expert took are kept, and
        down_proj's statistics, taken after gate/up are quantized, cross the quantized gate/up's outputs
        with the unquantized gate/up's for the same inputs."""
        holdout, router, reference = options.holdout, options.router, options.reference
        self.experts = experts
        e, p, h = experts.gate_up_proj.shape
        self.E, self.P, self.H, self.I = e, p, h, experts.down_proj.shape[-1]
        self.device = dev = experts.gate_up_proj.device
        self.need_h = need_hessians
        self.par = par if par is not None and par.distributed else None
        self.owned = owned
        self.counts = torch.zeros(e, dtype=torch.long)
        # Hessians only for the experts this rank accumulates: expert e's are row slot[e] (-1: not held here)
        ids = torch.arange(e) if owned is None else owned.cpu().nonzero().flatten()
        self.slot = torch.full((e,), -1, dtype=torch.long)
        self.slot[ids] = torch.arange(len(ids))
        n = len(ids)
        self.h_gu = torch.zeros(n, h, h, device=dev) if need_hessians else None  # sums of x x^T (scaled at the end)
        self.h_down = torch.zeros(n, self.I, self.I, device=dev) if need_hessians else None
        self.h_all = torch.zeros(h, h, device=dev)
        self.h_all_skipped = False  # distributed: not summed, as no fallback of the group reads it (reduce)
        self.holdout = int(holdout) if need_hessians else 0
        self.ho_x: list[list[torch.Tensor]] = [[] for _ in range(n)]  # held-out gate/up inputs, by slot
        self.router = router if need_hessians else None
        if self.router is not None:
            moe.router_weight(router, h, e)  # checked before the pass, not at its first batch
        self.affinity_top_k = options.affinity_top_k
        self.aff_counts = torch.zeros(e, dtype=torch.long)
        self.total = 0
        self.primary = options.primary_tokens if need_hessians else None
        self.balance = options.balance_tokens
        self._seen = 0  # rows observed, the pool's included
        self.pool_counts = torch.zeros(e, dtype=torch.long)  # routed rows each expert took from the pool
        self.sample_tokens = sample_tokens
        self.x_samples: list[torch.Tensor] = []  # [t, H] all tokens (subsampled) for AWQ / fallbacks
        self.idx_samples: list[torch.Tensor] = []
        self.w_samples: list[torch.Tensor] = []  # [t, k] the router's weights of those tokens' top-k experts
        self._n_samples = 0
        self.y_samples: list[torch.Tensor] = []  # [t, H] float32: the block's outputs for x_samples
        self._take = 0  # sampled rows of the current call, for the block's output hook
        self._records: list[list] = []  # distributed: [x, idx, weights, block output, x_ref] of each own call
        self.reference = reference if need_hessians else None
        self.a_gu = torch.zeros(n, h, h, device=dev) if self.reference is not None else None
        # down_proj's statistics wait for the quantized gate/up (fit_unquantized or fit_down)
        self.defer_down = need_hessians and (self.reference is not None or options.fit_down)
        self.a_down = torch.zeros(n, self.I, self.I, device=dev) if self.defer_down else None
        # (x, x_ref or None) of every call: fit_unquantized's two streams, fit_down's one
        self.kept: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.rows_of: list[list[tuple]] = [[] for _ in range(n)]  # by slot: (call, rows, weights or None)
        self.ho_ref: list[list[torch.Tensor]] = [[] for _ in range(n)]  # held-out rows' reference inputs
        self.handle = experts.register_forward_pre_hook(self._hook)
        self.block_handle = block.register_forward_hook(self._block_hook) if block is not None else None

    def _hook(self, module, args):
        x, idx = args[0].detach().float(), args[1].detach()
        x = x.reshape(-1, self.H)
        wts_in = args[2] if len(args) > 2 else None
        if idx.dim() == 2 and idx.shape[0] == x.shape[0] and (wts_in is None or wts_in.shape == idx.shape):
            routing = moe.routing_for(module, args[1], wts_in)  # shared with the forward of this call
        else:
            idx = idx.reshape(x.shape[0], -1)
            routing = moe.route(idx, None, self.E)
        idx = idx.reshape(x.shape[0], -1)
        wts = wts_in.detach().reshape(x.shape[0], -1).float() if wts_in is not None else None
        if wts is None or wts.shape != idx.shape:
            wts = torch.ones(idx.shape, device=x.device)
        x_ref = None
        if self.reference is not None:
            call = len(self._records) if self.par is not None else len(self.kept)
            if call >= len(self.reference) or self.reference[call].shape != x.shape:
                raise CalibrationError(f"the unquantized model's stream does not match the forward call {call} "
                                       f"of the routed experts ({len(self.reference)} calls recorded)")
            x_ref = self.reference[call].to(x.device)
            self.reference[call] = None  # held by the statistics from now on
        if self.par is not None:  # reduce() replays it in batch order
            self._records.append([x.clone(), idx.clone(), wts.clone(), None, x_ref])
            return
        if self.defer_down:
            self.kept.append((x.clone(), x_ref))
        self._observe(x, idx, wts, routing, h_all=True)

    def _observe(self, x: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor, routing: "moe.Routing",
                 h_all: bool, rows: int | None = None) -> None:
        """`_observe_call` timed as the timeline's `grams` phase (nested in the statistics forward that calls it:
        what the Hessians cost apart from the forward itself)."""
        with timeline.phase("grams"):
            self._observe_call(x, idx, wts, routing, h_all, rows)

    def _observe_call(self, x: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor, routing: "moe.Routing",
                      h_all: bool, rows: int | None = None) -> None:
        """One batch's contribution, in batch order: token total, all-token Hessian, samples, counts, Grams.
        `rows`: the batch's tokens when x holds only its first (sampled) rows (no Hessians then). With a
        top-up pool, the batch's rows past the calibration samples' go to `_top_up` instead."""
        if self.primary is not None:
            n = x.shape[0]
            p = min(max(self.primary - self._seen, 0), n)
            if p < n:
                if p:  # a batch across the boundary: its calibration rows first (they advance _seen)
                    self._observe(x[:p], idx[:p], wts[:p], moe.route(idx[:p], wts[:p], self.E), h_all)
                    if self.defer_down:  # the pool's rows as a call of their own: what _top_up's indices address
                        call_x, call_ref = self.kept[-1]
                        self.kept.append((call_x[p:], None if call_ref is None else call_ref[p:]))
                self._seen += n - p
                self._top_up(x[p:], idx[p:], wts[p:])
                return
            self._seen += n
        self.total += x.shape[0] if rows is None else rows
        if h_all:
            self.h_all += x.T @ x
        if self._n_samples < self.sample_tokens:
            take = min(self.sample_tokens - self._n_samples, x.shape[0])
            self.x_samples.append(x[:take].clone())
            self.idx_samples.append(idx[:take].clone())
            self.w_samples.append(wts[:take].clone())
            self._n_samples += take
            self._take = take
        prior = self.counts.tolist()
        self.counts += routing.counts.cpu()
        if self.need_h:
            aff = None
            if self.router is not None:
                aff = moe.router_affinities(self.router, x, self.affinity_k(idx.shape[1]))
                self.aff_counts += aff.counts.cpu()
            self._add_grams(x, routing, prior, aff)

    def affinity_k(self, top_k: int) -> int:
        """The experts each token's row goes to in the affinity statistics of a call routed to `top_k`."""
        return affinity_experts(self.affinity_top_k, top_k, self.E)

    def _add_grams(self, x: torch.Tensor, routing: "moe.Routing", prior: list[int],
                   aff: "moe.Routing | None" = None) -> None:
        """h_gu[e] += X_e^T X_e and h_down[e] += D_e^T D_e for every (owned) expert e, X_e the rows routed to
        it (ascending token order), D_e = act(X_e gate_e^T) * (X_e up_e^T): one product per expert on its exact
        rows, so its value does not depend on which other experts are computed alongside.

        The gathered rows, the gate/up products and both Gram products go to buffers allocated once per call
        and reused for every expert (the same products as fresh tensors): the executor serves allocations of
        1 MiB or more with fresh mappings (weights.bound_heap), and faulting pages in again for each expert's
        temporaries cost ~1/10 of a GPTQ pass. With `holdout` k, the rows whose running index for their
        expert (`prior`: its token count before this batch) is k-1 mod k are kept aside instead.

        With `aff` (the router's affinities, `stats: affinity`) an expert's rows are its affinity rows instead,
        less the ones held out of its routed tokens, each row scaled by the square root of its affinity
        before both Grams (after the down inputs are computed from the unscaled row)."""
        token, _ = routing.token_major()
        b = routing.bounds
        slots = self.slot.tolist()
        if aff is not None:
            a_tok, a_w = aff.token_major()
            ab = aff.bounds
        has = (lambda e: b[e + 1] > b[e] or ab[e + 1] > ab[e]) if aff is not None else (lambda e: b[e + 1] > b[e])
        todo = [(e, b[e], b[e + 1], slots[e]) for e in range(self.E) if has(e) and slots[e] >= 0]
        if not todo:
            return
        rows = max(t - s for _, s, t, _ in todo)
        if aff is not None:
            rows = max(rows, max(ab[e + 1] - ab[e] for e, *_ in todo))
        bufs = self._gram_buffers(x, rows)
        k = self.holdout
        for e, s, t, j in todo:
            rows_e, held_rows, w_e = token[s:t], None, None
            if k:
                held = (torch.arange(prior[e], prior[e] + t - s, device=token.device) % k) == k - 1
                if bool(held.any()):
                    held_rows = rows_e[held]
                    self.ho_x[j].append(x.index_select(0, held_rows))
                    rows_e = rows_e[~held]
            if aff is not None:
                rows_e, w_e = a_tok[ab[e]:ab[e + 1]], a_w[ab[e]:ab[e + 1]]
                if held_rows is not None:
                    keep = ~torch.isin(rows_e, held_rows)
                    rows_e, w_e = rows_e[keep], w_e[keep]
            if rows_e.numel():
                self._add_rows(e, j, x, rows_e, w_e, bufs)
            if held_rows is not None and self.a_gu is not None:
                self.ho_ref[j].append(self.kept[-1][1].index_select(0, held_rows))

    def _gram_buffers(self, x: torch.Tensor, rows: int) -> tuple:
        """Buffers for `_add_rows` of up to `rows` rows of x: gathered rows, gate/up products, both Grams, and
        whether act_fn is SiLU (run in place)."""
        return (x.new_empty(rows, self.H), x.new_empty(rows, self.P), x.new_empty(self.H, self.H),
                x.new_empty(self.I, self.I), moe._silu_in_place(self.experts.act_fn))

    def _add_rows(self, e: int, j: int, x: torch.Tensor, rows_e: torch.Tensor, w_e: torch.Tensor | None,
                  bufs: tuple) -> None:
        """h_gu[j] += X^T X and h_down[j] += D^T D for expert e's rows `rows_e` of x (X [n, H], D its down
        inputs), each row scaled by the square root of its weight in `w_e` (None: 1) after D is computed.
        fit_unquantized: a_gu[j] += X_ref^T X (X_ref the same rows of the unquantized model's inputs, scaled
        alike). fit_unquantized or fit_down: the rows are recorded for `down_statistics` instead of the down
        Gram."""
        ws_x, ws_gu, g_gu, g_down, silu = bufs
        xe = ws_x[:rows_e.numel()]
        torch.index_select(x, 0, rows_e, out=xe)  # [n, H]
        xr = self.kept[-1][1].index_select(0, rows_e) if self.a_gu is not None else None  # X_ref
        d = None if self.defer_down else self.down_inputs_one(e, xe, out=ws_gu[:rows_e.numel()], silu=silu)
        if w_e is not None:
            r = w_e.sqrt()[:, None]
            for t in (xe, xr, d):
                if t is not None:
                    t.mul_(r)
        self.h_gu[j] += torch.mm(xe.T, xe, out=g_gu)
        if xr is not None:
            self.a_gu[j] += torch.mm(xr.T, xe, out=g_gu)
        if d is None:
            self.rows_of[j].append((len(self.kept) - 1, rows_e, w_e))
        else:
            self.h_down[j] += torch.mm(d.T, d, out=g_down)

    def _top_up(self, x: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor) -> None:
        """Rows of the top-up pool. While an expert has fewer than `balance` routed rows, each pool row counts
        for it: the rows routed to it enter its Grams (on its owner) and its counts (on every rank), in
        ascending token order, until the one that brings it to `balance`; under `stats: affinity` every row
        up to that one enters them, weighted by its affinity as in `_add_grams`."""
        if not self.balance:
            return
        routing = moe.route(idx, wts, self.E)
        token, _ = routing.token_major()
        b = routing.bounds
        aff = moe.router_affinities(self.router, x, self.affinity_k(idx.shape[1])) if self.router is not None else None
        if aff is not None:
            a_tok, a_w = aff.token_major()
            ab = aff.bounds
        slots = self.slot.tolist()
        bufs = self._gram_buffers(x, x.shape[0])
        for e in range(self.E):
            need = self.balance - int(self.counts[e])
            if need <= 0:
                continue
            routed = token[b[e]:b[e + 1]]
            rows_e, w_e = routed[:need], None
            self.counts[e] += rows_e.numel()
            self.pool_counts[e] += rows_e.numel()
            if aff is not None:  # every row up to the one that completes it (the whole call if none does)
                a_rows, a_wts = a_tok[ab[e]:ab[e + 1]], a_w[ab[e]:ab[e + 1]]
                if routed.numel() >= need:
                    keep = a_rows <= int(rows_e[-1])
                    a_rows, a_wts = a_rows[keep], a_wts[keep]
                rows_e, w_e = a_rows, a_wts
                self.aff_counts[e] += rows_e.numel()
            if slots[e] >= 0 and rows_e.numel():
                self._add_rows(e, slots[e], x, rows_e, w_e, bufs)

    def down_statistics(self, e: int, gate_up: torch.Tensor, gate_up_ref: torch.Tensor,
                        count: float) -> tuple[torch.Tensor, torch.Tensor]:
        """fit_unquantized or fit_down: expert e's down_proj Hessian D^T D and cross-Gram D_ref^T D, each
        2/count-scaled, over the rows its gate/up statistics took (weighted alike): D the down inputs its
        quantized gate/up `gate_up` [P, H] produce from the quantized model's inputs, D_ref those its
        unquantized gate/up `gate_up_ref` produce from the unquantized model's (fit_unquantized) or from the
        same inputs (fit_down)."""
        j = int(self.slot[e])
        parts = self.rows_of[j]
        scale = 2.0 / max(count, 1.0)
        if not parts:
            z = torch.zeros(self.I, self.I, device=self.device)
            return z, z.clone()
        # every call's rows at once: two products and two Grams per expert
        x = torch.cat([self.kept[call][0].index_select(0, rows) for call, rows, _ in parts])
        xr = (torch.cat([self.kept[call][1].index_select(0, rows) for call, rows, _ in parts])
              if self.a_gu is not None else x)
        d, dr = self.down_inputs(x, gate_up), self.down_inputs(xr, gate_up_ref)
        if parts[0][2] is not None:
            r = torch.cat([w for _, _, w in parts]).sqrt()[:, None]
            d.mul_(r)
            dr.mul_(r)
        return torch.mm(d.T, d).mul_(scale), torch.mm(dr.T, d).mul_(scale)

    def heldout_reference(self, e: int) -> torch.Tensor:
        """fit_unquantized: the unquantized model's inputs for expert e's held-out rows [m, H]."""
        rows = self.ho_ref[int(self.slot[e])]
        return torch.cat(rows) if rows else torch.zeros(0, self.H, device=self.device)

    def down_inputs(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """act(x gate^T) * (x up^T) for rows x [n, H] under gate/up weights `gate_up` [P, H] -> [n, I]."""
        g, u = (x @ gate_up.float().T).chunk(2, dim=-1)
        return self.experts.act_fn(g) * u

    def heldout_inputs(self, e: int, down: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Expert e's held-out rows (owned experts only): (gate/up inputs [m, H], down inputs [m, I] from the
        experts' weights as they are now, i.e. before they are quantized; None when not `down`), in the order
        they were seen."""
        rows = self.ho_x[int(self.slot[e])]
        x = torch.cat(rows) if rows else torch.zeros(0, self.H, device=self.device)
        return x, self.down_inputs_one(e, x) if down else None

    def down_inputs_one(self, e: int, xe: torch.Tensor, out: torch.Tensor | None = None,
                        silu: bool = False) -> torch.Tensor:
        """act(gate_e x) * up_e x for the rows xe [n, H] of expert e -> [n, I]. `out` [n, P]: a buffer for the
        gate/up products (the result is then a view of its gate half when `silu`: act_fn is exactly SiLU and
        runs in place, moe._silu_in_place)."""
        w = self.experts.gate_up_proj[e].detach()  # reduce() replays outside the forward's no_grad
        if out is None:
            return self.down_inputs(xe, w)
        g, u = torch.mm(xe, w.float().T, out=out).chunk(2, dim=-1)  # [n, P]
        if silu:
            return torch.nn.functional.silu(g, inplace=True).mul_(u)
        return self.experts.act_fn(g) * u

    def _block_hook(self, module, args, output):
        y = output[0] if isinstance(output, tuple) else output
        if self.par is not None:
            if self._records and self._records[-1][3] is None:
                self._records[-1][3] = y.detach().reshape(-1, self.H).float().clone()
            return
        take, self._take = self._take, 0
        if take:
            self.y_samples.append(y.detach().reshape(-1, self.H)[:take].float().clone())

    def reduce(self, h_all_owner: int | None = None, options=None) -> None:
        """Distributed: replay every batch in batch order on every rank, from the rank that forwarded it
        (its routing and router weights, and its MoE inputs: all rows for GPTQ, the sampled rows and the
        block's outputs for them otherwise; broadcast). Counts, totals and samples end equal on every rank;
        each rank's Hessians hold its owned experts' sums; the all-token Hessian is summed by `h_all_owner`
        (default: the last rank) and broadcast, unless the group's `options` show before the replay that no
        fallback will read it (all_token_hessian_needed: every expert has its routed min_tokens, or the
        fallback is RTN); then it stays zero. A no-op in one process (the hook observed every batch)."""
        par = self.par
        if par is None:
            return
        if len(par.mine) != len(self._records):
            raise CalibrationError(f"{len(self._records)} routed-experts calls observed for "
                                   f"{len(par.mine)} forward batches")
        mine = dict(zip(par.mine, self._records))
        own_routing = {b: moe.route(r[1], None, self.E) for b, r in mine.items()}  # reused in the replay
        shapes = par.world.all_gather([(int(r[0].shape[0]), int(r[1].shape[1]), r[3] is not None,
                                        own_routing[b].counts.cpu().tolist()) for b, r in mine.items()])
        counts = torch.tensor([c for lst in shapes for *_, c in lst], dtype=torch.long).reshape(-1, self.E).sum(0)
        total = sum(rows for lst in shapes for rows, *_ in lst)
        # with a top-up pool the counts above hold the whole pool's rows, not what the top-up will take
        need_all = self.need_h and (options is None or self.primary is not None
                                    or all_token_hessian_needed(options, counts, total))
        self.h_all_skipped = self.need_h and not need_all
        shapes = [[t[:3] for t in lst] for lst in shapes]
        meta: dict[int, tuple[int, int, bool]] = {}
        for rank, lst in enumerate(shapes):
            meta.update(zip([b for b, o in enumerate(par.owner) if o == rank], lst))
        dev = self.device
        h_all_owner = par.size - 1 if h_all_owner is None else h_all_owner

        def post(b: int):
            """Batch b's routing and inputs from the rank that forwarded it: (x, idx, wts, waits). With
            Hessians every row travels, known before the replay, so the next batch's broadcasts are posted
            while this one's Grams are computed; otherwise the rows depend on the samples taken so far."""
            rows, k, _ = meta[b]
            src, rec = par.owner[b], mine.get(b)
            n_x = rows if self.need_h else min(max(self.sample_tokens - self._n_samples, 0), rows)
            x = rec[0] if rec is not None else torch.empty(rows, self.H, device=dev)
            idx = rec[1] if rec is not None else torch.empty(rows, k, dtype=torch.long, device=dev)
            wts = rec[2] if rec is not None else torch.empty(rows, k, device=dev)
            xr = None
            if self.a_gu is not None:  # fit_unquantized: the unquantized model's rows too, kept by every rank
                xr = rec[4] if rec is not None else torch.empty(rows, self.H, device=dev)
            return x, idx, wts, xr, [par.broadcast_async(t, src) for t in (idx, wts, x[:n_x], xr) if t is not None]

        ahead = post(0) if self.need_h and par.plan else None
        for b in range(len(par.plan)):
            rows, k, has_y = meta[b]
            src, rec = par.owner[b], mine.get(b)
            take = min(max(self.sample_tokens - self._n_samples, 0), rows)
            n_x = rows if self.need_h else take
            x, idx, wts, xr, waits = ahead if ahead is not None else post(b)
            ahead = post(b + 1) if self.need_h and b + 1 < len(par.plan) else None
            for wait in waits:
                wait()
            if has_y and take:
                y = rec[3] if rec is not None else torch.empty(rows, self.H, device=dev)
                par.broadcast_(y[:take], src)
                self.y_samples.append(y[:take].clone())
            routing = own_routing.pop(b, None) or moe.route(idx, None, self.E)
            if self.defer_down:
                self.kept.append((x, xr))
            if self.need_h:
                self._observe(x, idx, wts, routing, h_all=need_all and par.rank == h_all_owner)
            else:
                self._observe(x[:n_x], idx, wts, routing, h_all=False, rows=rows)
            if rec is not None:
                rec.clear()
        self._records = []
        if need_all:
            par.broadcast_(self.h_all, h_all_owner)

    def remove(self):
        self.handle.remove()
        if self.block_handle is not None:
            self.block_handle.remove()

    def block_outputs(self) -> torch.Tensor | None:
        """[t, H] float32: the MoE block's outputs for the sampled tokens (aligned with `samples()`), when a
        block was hooked and every sampled call went through it; else None."""
        if self.block_handle is None or sum(len(y) for y in self.y_samples) != self._n_samples:
            return None
        return torch.cat(self.y_samples) if self.y_samples else None

    def samples(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.x_samples), torch.cat(self.idx_samples)

    def routing_weights(self) -> torch.Tensor:
        """[t, k] router weights of the sampled tokens (aligned with `samples()`)."""
        return torch.cat(self.w_samples)


# Bytes the memory plan (calib/layer.py statistics_bytes) keeps for the statistics' Gram products. The
# Grams are now one product per expert and batch (`ExpertStats._add_grams`), far smaller: the plan
# overestimates this part.
GRAM_CHUNK_BYTES = 1 << 25


def routed_batches(x: torch.Tensor, idx: torch.Tensor, num_experts: int, width: int, budget: int = PAIR_BUDGET,
                   weights: torch.Tensor | None = None, only: torch.Tensor | None = None,
                   max_experts: int | None = None):
    """Yield (expert ids [e], padded tokens [e, t, D], mask [e, t]) over chunks of experts: the tokens routed
    to each expert (idx [T, k], the router's top-k indices), gathered and zero-padded to the chunk's longest
    list, so that per-expert products are one batched matmul. With `weights` [T, k] (the router's top-k
    weights), each item also carries the weight of each gathered token for that expert: (ids, tokens, mask,
    weights [e, t], 0 on padding). `only` (bool [num_experts]): just those experts, each in the chunk and at the
    padded length it has among all experts (routed_blocks); `max_experts`: at most that many per chunk."""
    yield from routed_blocks(x, moe.route(idx, weights, num_experts), width, budget, weights=weights is not None,
                             only=only, max_experts=max_experts)


def routed_blocks(x: torch.Tensor, routing: "moe.Routing", width: int, budget: int = PAIR_BUDGET,
                  weights: bool = False, only: torch.Tensor | None = None, max_experts: int | None = None):
    """`routed_batches` from a routing already sorted (`moe.route` / `moe.routing_for`). Each expert's tokens
    come in ascending token order, zero-padded; experts are chunked so that a padded block [e, t, width]
    of float32 stays within `budget` bytes (at least one expert). The experts go by token count, the
    busiest first (ties: the lower id), and a chunk ends where an expert has fewer than PAD_RATIO of its
    first expert's tokens, so that padding is at most a quarter of any chunk's rows: routing is skewed (the
    bench MoE's busiest expert gets 2-3x the mean), and padding every expert of a layer to the busiest one
    doubled the rows every batched product works on. On x's device.

    `only` (bool [E]): just those experts, but chunked and padded as among all of them. A rank that runs the
    searches of some experts (AWQ, several ranks) then gives each the very operands one process gives it: a
    product's reduction over a differently padded token axis is blocked differently by BLAS, which changed
    bytes (the bench MoE's AWQ on 2 ranks). Chunks with none of them are skipped."""
    token, slot_w = routing.token_major()
    if weights:
        slot_w = slot_w.float()
    counts = routing.counts.cpu()
    starts = routing.bounds
    wanted = None if only is None else only.cpu()
    present = (counts > 0).nonzero().flatten()
    present = present[torch.sort(counts[present], descending=True, stable=True).indices]
    dev = x.device
    i = 0
    while i < present.numel():
        # grow the chunk while the padded block stays within the budget and its padding small
        j = i + 1
        longest = int(counts[present[i]])  # the busiest of the chunk: its first
        while j < present.numel():
            if ((j - i + 1) * longest * width * 4 > budget or int(counts[present[j]]) < PAD_RATIO * longest
                    or (max_experts is not None and j - i >= max_experts)):
                break
            j += 1
        ids = present[i:j]
        if wanted is not None:
            ids = ids[wanted[ids]]
            if not len(ids):
                i = j
                continue
        xs = torch.zeros(len(ids), longest, width, device=dev)
        mask = torch.zeros(len(ids), longest, device=dev)
        ws = torch.zeros(len(ids), longest, device=dev) if weights else None
        for r, e in enumerate(ids.tolist()):
            c, s = int(counts[e]), starts[e]
            xs[r, :c] = x[token[s:s + c]]
            mask[r, :c] = 1
            if ws is not None:
                ws[r, :c] = slot_w[s:s + c]
        ids = ids.to(dev)
        yield (ids, xs, mask) if ws is None else (ids, xs, mask, ws)
        i = j


class LinearStats:
    """Hessian of one nn.Linear's inputs (dense targets: attention, dense MLP, shared experts): the sum over
    forward batches, in batch order, of each batch's partial x^T x. With a distributed `par` the hook keeps
    its rank's partials and `reduce_linear_stats` sums every batch's on the module's owner."""

    def __init__(self, module: nn.Linear, par=None):
        self.h = torch.zeros(module.in_features, module.in_features, device=module.weight.device)
        self.count = 0
        self.par = par if par is not None and par.distributed else None
        self.parts: list[torch.Tensor] = []  # distributed: this rank's partials, in its batch order
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        x = args[0].detach().float().reshape(-1, self.h.shape[0])
        if self.par is not None:
            self.parts.append(x.T @ x)
        else:
            self.h += x.T @ x
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        return self.h * (2.0 / max(self.count, 1))

    def remove(self):
        self.handle.remove()


def reduce_linear_stats(par, stats: dict[str, LinearStats], owners: dict[str, int]) -> None:
    """Distributed: each module's Hessian summed on its owner (`owners[name]`) from every batch's partial,
    in batch order (Parallel.sum_in_batch_order); token counts summed on every rank (integers, exact).
    Other ranks' `h` stay zero. A no-op in one process."""
    if par is None or not par.distributed or not stats:
        return
    for name, st in stats.items():
        if len(st.parts) != len(par.mine):
            raise CalibrationError(f"{name}: {len(st.parts)} forward calls observed for {len(par.mine)} batches")
    counts = par.world.all_gather({n: st.count for n, st in stats.items()})
    parts = {(n, b): t for n, st in stats.items() for b, t in zip(par.mine, st.parts)}
    keys = [(n, owners[n], tuple(st.h.shape)) for n, st in stats.items()]
    sums = par.sum_in_batch_order(keys, parts)
    for n, st in stats.items():
        st.parts = []
        st.count = sum(c[n] for c in counts)
        if n in sums:
            st.h = sums[n].to(st.h.device)


def _min_tokens(options, total: int) -> int:
    """An expert's least statistics tokens: options.min_tokens, by default 0.5% of the layer's tokens."""
    return int(options.min_tokens) if options.min_tokens is not None else max(1, math.ceil(0.005 * total))


def all_token_hessian_needed(options, counts: torch.Tensor, total: int) -> bool:
    """Whether a GPTQ group with `options` can read the all-token Hessian, given each expert's routed tokens
    `counts` [E] over the layer's `total` tokens: `stats: all` always, `stats: affinity` always (its counts
    are known only after the replay), `routed` only where an expert has fewer than min_tokens and the
    fallback is all_tokens (coverage's rule, decided before the statistics)."""
    if options.stats != "routed":
        return True
    return options.fallback != "rtn" and bool((counts < _min_tokens(options, total)).any())


def coverage(options, stats: ExpertStats) -> tuple[torch.Tensor, int, str, str]:
    """(experts whose statistics come from all tokens [E] bool, min_tokens, fallback, stats mode) for a
    group's options (match.recipe GPTQOptions / AWQOptions)."""
    min_tokens = _min_tokens(options, stats.total)
    if options.stats == "all":
        low = torch.ones(stats.E, dtype=torch.bool)
    else:  # routed: the tokens the router sent; affinity: the tokens in each expert's weighted Hessian
        low = (stats.counts if options.stats == "routed" else stats.aff_counts) < int(min_tokens)
    return low, int(min_tokens), options.fallback, options.stats
