"""Calibrated weight quantization (GPTQ, AWQ) of one decoder layer, streamed on the LayerExecutor.

For each decoder layer: collect statistics in one forward pass over the calibration tokens (calib/
hessians.py), quantize (calib/gptq_pass.py, calib/awq_pass.py), write the dequantized weights back into
the layer; the caller runs it again, so that layer L+1 calibrates on the output of the *quantized* layer L
(true-sequential). Peak memory: one layer's weights, its Hessians and the calibration activations.

Expert coverage (recipe group options, docs/calibration.md): an expert that received fewer than
`min_tokens` routed tokens (default: 0.5% of the layer's tokens, at least 1) falls back to a Hessian from
all of the layer's tokens (`fallback: all_tokens`, default) or to RTN (`fallback: rtn`); `stats: all`
uses all tokens for every expert. Every expert ends quantized, and the manifest says which fell back and why.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .. import timeline
from ..arch.layout import hf_moe_parts
from ..errors import CalibrationError
from ..match.recipe import Recipe, WeightGroup, affinity_experts
from ..read.checkpoint import Checkpoint
from .awq_pass import MoEBlock, awq_steps
from .emit import LayerResult, emit_expert_input_scales, emit_input_scale
from .gptq_pass import gptq_dense, gptq_experts
from .hessians import ExpertStats, HessianOptions, LinearStats
from .observers import ExpertInputAmax, LinearInputAmax
from .names import disk_name, expert_names
from .weights import reuse_heap
from ..pack.names import Tensor


# ---- the layer procedure ----------------------------------------------------------------------------
def _find_moe(layer: nn.Module):
    return hf_moe_parts(layer)


def linear_targets(ckpt: Checkpoint, recipe: Recipe, idx: int, layer: nn.Module):
    """What a calibrated pass does to decoder layer `idx` (materialized or still on `meta`): (expert names,
    the routed experts' group or None, {disk module: (Linear, group)} of the dense calibrated targets)."""
    names = expert_names(ckpt, idx)
    moe = _find_moe(layer)
    egroup = None
    if moe is not None and names is not None:
        egroup = recipe.match(names.module(0, "gate"))
        if egroup is not None and egroup.method == "rtn" and not egroup.scheme.w4a4:
            egroup = None  # RTN needs no calibration: convert does it while streaming (W4A4: input scales do)
        if egroup is not None and Tensor.PACKED.of(names.module(0, 'gate')) in ckpt.location:
            from ..match.shards import decide
            from .weights import stored_modules

            sw = stored_modules(ckpt).get(names.module(0, "gate"))  # INT4 / FP4 in the source: convert
            if sw is not None and decide(sw, egroup.scheme, True)[0] != "dequantize":  # passes it through
                egroup = None
    dense: dict[str, tuple[nn.Linear, WeightGroup]] = {}
    for rel, mod in layer.named_modules():
        if isinstance(mod, nn.Linear):
            try:
                disk = disk_name(ckpt, idx, rel + ".weight")[: -len(".weight")]
            except CalibrationError:
                continue
            g = recipe.match(disk)
            if g is not None and (g.method != "rtn" or g.scheme.w4a4):
                if g.method == "awq":
                    raise CalibrationError(f"{disk}: AWQ is implemented for routed experts only",
                                           hint="use method gptq or rtn for non-expert modules")
                dense[disk] = (mod, g)
    return names, egroup, dense


class _Layer:
    """One decoder layer's calibrated quantization (quantize_layer): its targets, its MoE block's parts, the
    rank it runs on and the result it builds."""

    def __init__(self, ckpt: Checkpoint, step, par, targets: tuple):
        self.ckpt, self.step, self.par = ckpt, step, par
        self.idx, self.layer = step.index, step.layer
        self.names, self.egroup, self.dense = targets  # linear_targets
        self.moe = _find_moe(self.layer)
        self.dist_par = par if par is not None and par.distributed else None
        self.rank = par.rank if par is not None else 0
        self.res = LayerResult()

    def run(self, fn, what: str, phase: str):
        """`fn()` as one step of the pass (World.step: a failure on one rank stops every rank), timed as `phase`."""
        if self.par is not None:
            return self.par.step(fn, what, phase)
        with timeline.phase(phase):
            return fn()

    def check(self, fit: bool, reference: list | None, primary_tokens: int | None) -> None:
        """Refuse what this layer's groups cannot do: fit options on dense modules, fit_unquantized without the
        unquantized model's stream, a top-up pool that would reach anything but GPTQ's routed experts."""
        egroup, dense, idx = self.egroup, self.dense, self.idx
        for disk, (_, g) in dense.items():
            for key in ("fit_unquantized", "fit_down"):
                if g.method == "gptq" and getattr(g.options, key):
                    raise CalibrationError(f"{disk}: {key} applies to routed experts only",
                                           hint="give the dense modules a group of their own without it")
        if fit and reference is None:
            raise CalibrationError(f"decoder layer {idx}: fit_unquantized needs the unquantized model's stream, "
                                   "which this pass does not carry")
        if primary_tokens is not None and (any(g.method != "rtn" or g.scheme.w4a4 for _, g in dense.values())
                                           or (egroup is not None and egroup.method != "gptq")):
            raise CalibrationError(f"decoder layer {idx}: the top-up pool of balance_tokens would reach modules "
                                   f"other than GPTQ's routed experts ({', '.join(list(dense)[:3]) or 'the experts'})",
                                   hint="target only routed experts with the balance_tokens group")

    def expert_stats(self, fit: bool, reference: list | None, primary_tokens: int | None):
        """(ExpertStats of the routed experts, their solve group size or None) for a calibrated expert group;
        (None, None) otherwise."""
        from .gptq_pass import expert_group_size, expert_owners

        egroup = self.egroup
        if egroup is None or egroup.method == "rtn":  # W4A4 RTN experts: their input scales only
            return None, None
        mlp, experts, router, _ = self.moe
        e_, _, h_ = experts.gate_up_proj.shape
        owned = group = None
        gptq = egroup.method == "gptq"
        if gptq:
            group = expert_group_size(e_, h_, experts.down_proj.shape[-1], experts.gate_up_proj.device)
            if self.dist_par is not None:
                owned = torch.tensor([o == self.rank for o in expert_owners(e_, group, self.dist_par)],
                                     dtype=torch.bool)
        if egroup.options.stats == "affinity" and router is None:
            raise CalibrationError(f"stats: affinity: decoder layer {self.idx} has no router module to score "
                                   "tokens with")
        options = HessianOptions(holdout=egroup.options.holdout if gptq else 0,
                                 router=router if egroup.options.stats == "affinity" else None,
                                 affinity_top_k=getattr(egroup.options, "affinity_top_k", None),
                                 primary_tokens=primary_tokens if gptq else None,
                                 balance_tokens=getattr(egroup.options, "balance_tokens", None),
                                 reference=reference if fit else None, fit_down=gptq and bool(egroup.options.fit_down))
        stats = ExpertStats(experts, need_hessians=gptq, sample_tokens=egroup.options.sample_tokens,
                            block=mlp if egroup.method == "awq" else None, par=self.dist_par, owned=owned,
                            options=options)
        return stats, group

    def observe(self, observers: list, stop_at) -> None:
        """The statistics forward (up to `stop_at`, None: the whole layer) with `observers` hooked, removed after."""
        try:
            self.run(lambda: self.step.observe(stop_at), f"collecting the statistics of decoder layer {self.idx}",
                     "statistics")  # all statistics
        finally:
            for s in observers:
                s.remove()

    def solve_dense(self, lstats: dict, dense_owner: dict) -> None:
        """GPTQ of the dense calibrated modules, each by its owner, then broadcast to every rank."""
        def dense_solves():
            for disk, (mod, g) in self.dense.items():
                if dense_owner[disk] == self.rank and g.method != "rtn":
                    gptq_dense(self.res, self.ckpt, disk, mod, g, lstats[disk])

        if any(g.method != "rtn" for _, g in self.dense.values()):  # the same on every rank: a step only if any
            self.run(dense_solves, f"quantizing the dense modules of decoder layer {self.idx}", "solve")
        if self.dist_par is not None:
            for disk, (mod, g) in self.dense.items():
                if g.method != "rtn":
                    self.dist_par.broadcast_(mod.weight.data, dense_owner[disk])

    def awq(self, stats: ExpertStats) -> None:
        """AWQ of the routed experts, its steps run in turn with their exchanges between the ranks."""
        mlp, experts, router, shared = self.moe
        layer, dense, dist_par, idx = self.layer, self.dense, self.dist_par, self.idx
        # the block's recorded outputs are its unquantized response unless a dense group above just
        # quantized a module inside it (a shared expert's down_proj): then it is measured again
        mlp_rel = next(n for n, m in layer.named_modules() if m is mlp) + "."
        inside = any(n.startswith(mlp_rel) for n, m in layer.named_modules()
                     if any(m is d for d, _ in dense.values()))

        # every rank holds the same samples; the norm-scale candidates and the per-expert searches are
        # split over the ranks, and their results exchanged between the steps (collectives, outside them)
        block = MoEBlock(self.ckpt, idx, self.names, layer, mlp, experts, router, shared)
        steps = awq_steps(self.res, block, self.egroup, stats, fp_out=None if inside else stats.block_outputs(),
                          par=dist_par)

        def awq_step():
            with reuse_heap():  # hundreds of same-sized temporaries per layer
                return next(steps, None)

        share = self.run(awq_step, f"searching AWQ's scales for the experts of decoder layer {idx}", "solve")
        while share is not None:  # an exchange between the ranks, then the next step
            share()
            share = self.run(awq_step, f"AWQ for the experts of decoder layer {idx}", "solve")
        if dist_par is not None:  # AWQ changed the norm, the router and the shared expert (the same
            # fold on every rank; rank 0's, to be sure); the routed experts came from their owners above
            routed = {id(experts.gate_up_proj), id(experts.down_proj)}
            for _, p in sorted(layer.named_parameters()):
                if id(p) not in routed:
                    dist_par.broadcast_(p.data, 0)


def quantize_layer(ckpt: Checkpoint, recipe: Recipe, step, log: Callable[[str], None] = lambda m: None,
                   par=None, primary_tokens: int | None = None, reference: list | None = None) -> LayerResult:
    """Calibrate and quantize decoder layer `step.index` in place (weights replaced by their dequantized
    values); returns what convert must write. The caller forwards the step afterwards (true-sequential).

    `par` (calib/parallel.py; None: one process): the statistics forward runs this rank's batches, the
    statistics are reduced to their owners in batch order, each owner solves its dense modules and expert
    groups (AWQ: the per-expert searches split, each rank quantizes the experts it searched), the dequantized
    weights are broadcast to every rank, and each rank returns its own part of the result (the packed tensors,
    overrides and metadata of what it solved; rank 0 also the input scales), which it writes to the spool
    itself.
    Every local phase runs under World.step, so that a failure on one rank stops every rank.

    `primary_tokens`: the step's inputs end with a top-up pool (GPTQOptions.balance_tokens) after this many
    calibration tokens; only the routed experts' statistics read it, so no other module here may be
    calibrated.

    `reference` (GPTQ's fit_unquantized): the unquantized model's inputs to the routed experts for each
    forward call of the step (this rank's), in batch order (executor.forward_capture); required by such a group."""
    from .gptq_pass import share_expert_weights
    from .hessians import reduce_linear_stats

    job = _Layer(ckpt, step, par, linear_targets(ckpt, recipe, step.index, step.layer))
    egroup, dense, dist_par, moe = job.egroup, job.dense, job.dist_par, job.moe
    if egroup is None and not dense:
        return job.res
    fit = egroup is not None and egroup.method == "gptq" and bool(egroup.options.fit_unquantized)
    job.check(fit, reference, primary_tokens)
    # NVFP4 W4A4 targets: their input amax, observed in the same forward as the other statistics
    act_amax = ExpertInputAmax(moe[1]) if egroup is not None and egroup.scheme.w4a4 else None
    dense_amax = {d: LinearInputAmax(m) for d, (m, g) in dense.items() if g.scheme.w4a4}
    stats, group = job.expert_stats(fit, reference, primary_tokens)
    lstats = {d: LinearStats(m, dist_par) for d, (m, g) in dense.items() if g.method != "rtn"}
    dense_owner = {d: (par.dense_owner(i) if par is not None else 0) for i, d in enumerate(dense)}
    # GPTQ of the routed experts alone changes nothing the layer computes before them: the statistics pass
    # stops at the experts' call, and the forward after the solves runs only the MLP block (executor.py)
    stop_at = moe[1] if egroup is not None and egroup.method in ("gptq", "rtn") and not dense else None
    job.observe([*lstats.values(), *dense_amax.values(), *([stats] if stats is not None else []),
                 *([act_amax] if act_amax is not None else [])], stop_at)
    if dist_par is not None:
        with timeline.phase("statistics"):  # the owners' Grams of the exchanged rows; the exchange nested
            if stats is not None:
                stats.reduce(options=egroup.options if egroup.method == "gptq" else None)
            reduce_linear_stats(dist_par, lstats, dense_owner)
    for s in [*dense_amax.values(), *([act_amax] if act_amax is not None else [])]:
        s.reduce(dist_par)

    with torch.no_grad():
        job.solve_dense(lstats, dense_owner)
        if egroup is not None and egroup.method == "gptq":
            packed = job.run(lambda: gptq_experts(job.res, ckpt, job.names, moe[1], egroup, stats, group, dist_par),
                             f"quantizing the experts of decoder layer {job.idx}", "solve")
            share_expert_weights(moe[1], group, dist_par, packed, egroup.scheme)
        elif egroup is not None and egroup.method == "awq":
            job.awq(stats)
        # W4A4 RTN experts: convert quantizes the weights while streaming; their input scales below
    if job.rank == 0:  # the input scales are the same on every rank (reduced above): rank 0 records them
        if act_amax is not None:
            emit_expert_input_scales(job.res, job.names, act_amax, job.idx)
        for disk, obs in dense_amax.items():
            emit_input_scale(job.res, disk, obs.amax, obs.tokens)
    return job.res


# ---- device memory of a layer's statistics and solves (calib/device.py plans with it) ------------------
def statistics_bytes(ckpt: Checkpoint, recipe: Recipe, idx: int, layer: nn.Module, device: torch.device,
                     compute_dtype: torch.dtype, call_tokens: int, lengths, ranks: int = 1) -> dict[str, int]:
    """Estimated peak bytes, by component, of what `quantize_layer` holds on the device for layer `idx`
    besides the layer's weights and the forward (`layer` may be the meta skeleton). Mirrors the code: the
    expert Hessians (float32; on `ranks` ranks, those of the experts the busiest rank owns), the token
    samples, the Gram/solve working sets (one solve group's factorization within GPTQ_CHUNK_BYTES, a sweep
    batch of groups within GPTQ_SWEEP_BYTES, PAIR_BUDGET-bounded gathers), on several ranks GPTQ's replay
    buffers, GPTQ's fit_unquantized (its cross-Grams, kept inputs and the unquantized model's stream), AWQ's
    copy of the experts, its float32 chunks of experts and its search blocks."""
    from .awq_pass import AWQ_TOKEN_CHUNK, W_MEAN_BYTES, experts_per_chunk, search_block_experts
    from .gptq_pass import expert_group_size, solve_dtype, sweep_experts
    from .hessians import GRAM_CHUNK_BYTES, PAIR_BUDGET
    from ..quant.awq import CLIP_GRAM_BYTES

    names, egroup, dense = linear_targets(ckpt, recipe, idx, layer)
    out: dict[str, int] = {}
    sitem = torch.empty((), dtype=solve_dtype(device)).element_size()
    tokens = int(call_tokens)  # the most tokens one forward call gets (LayerExecutor.call_tokens)
    if egroup is not None and egroup.method == "rtn":  # W4A4 input amax only: one expert's gate/up products
        _, experts, _, _ = _find_moe(layer)
        e, p, h = (int(d) for d in experts.gate_up_proj.shape)
        out["input_amax"] = tokens * (h + p) * 4 + p * h * 4 + e * 8  # rows, products, one expert's fp32 weight
    elif egroup is not None:
        _, experts, router, _ = _find_moe(layer)
        e, p, h = (int(d) for d in experts.gate_up_proj.shape)
        i = int(experts.down_proj.shape[-1])
        k = int(getattr(router, "top_k", 0) or 8)
        s_tok = min(int(egroup.options.sample_tokens), max(1, int(sum(int(t) for t in lengths))))
        upcast = tokens * h * 4 if compute_dtype != torch.float32 else 0  # the hook's float32 copy of a batch
        if egroup.method == "gptq":
            group = expert_group_size(e, h, i, device)
            groups = -(-e // group)
            held = min(e, -(-groups // max(1, int(ranks))) * group)  # rank 0 owns groups 0, R, 2R, ...
            out["hessians"] = (held * (h * h + i * i) + h * h) * 4
            out["samples"] = s_tok * (h * 4 + k * 12)
            ho = int(egroup.options.holdout)
            if ho:  # held-out rows (gate/up inputs, then their down inputs), ~1/ho of the routed tokens
                routed = sum(int(t) for t in lengths) * k * held // e
                out["heldout"] = -(-routed // ho) * (h + i) * 4
            out["gram"] = upcast + PAIR_BUDGET * (3 + (2 * p + 2 * i) // h) + 2 * GRAM_CHUNK_BYTES
            if ranks > 1:  # the replay (ExpertStats.reduce): this rank's batches' MoE inputs and routing, kept
                # from the statistics forward, and two other batches' (the one being added, the next in flight)
                own = -(-sum(int(t) for t in lengths) // int(ranks))
                out["replay"] = (own + 2 * tokens) * (h * 4 + k * 12)
            o = egroup.options
            if o.fit_unquantized or o.fit_down:
                # the cross-Grams (fit_down: down_proj's only), the expert inputs of every call (kept for down_proj's
                # statistics; fit_unquantized: both streams'), the rows each expert took, one expert's rows
                # (fit_unquantized: of both streams) with both gate/up products (the busiest: twice the mean), and
                # fit_unquantized's unquantized-model hidden states (in and out)
                total = sum(int(t) for t in lengths)
                streams = 2 if o.fit_unquantized else 1
                kk = affinity_experts(o.affinity_top_k, k, e) if o.stats == "affinity" else k
                per_expert = 2 * total * kk // e
                citem = torch.empty((), dtype=compute_dtype).element_size()
                grams = held * (h * h + i * i) if o.fit_unquantized else held * i * i
                out["fit"] = (grams * 4 + streams * total * h * 4 + total * kk * held // e * 12
                              + per_expert * (streams * h + 2 * p) * 4
                              + (2 * total * h * citem if o.fit_unquantized else 0))
            out["solve"] = max(solve_bytes(n_out, k_in, min(e, group),
                                           min(held, sweep_experts(k_in, n_out, group, device)), sitem)
                               for n_out, k_in in ((p, h), (h, i)))
        else:  # awq
            out["samples"] = s_tok * (2 * h * 4 + k * 12)
            # the experts before AWQ, in the layer's dtype; then a chunk of experts at a time (awq_pass
            # EXPERT_CHUNK_BYTES) in float32: a candidate's fake quantization, or at the end the weights, codes,
            # dequantized values and the SQNR's float64 copies (~37 bytes per element); or the weight
            # statistic's rows (W_MEAN_BYTES, ~3 float32 copies)
            item = torch.empty((), dtype=compute_dtype).element_size()
            chunk = min(e, experts_per_chunk(p * h)) * p * h
            gs = egroup.scheme.group_size or h
            out["awq_weights"] = (e * (p * h + h * i) * item + e * (p * h + h * i) // gs * 4  # + clip ratios
                                  + max(37 * chunk, 3 * min(e * p * h * 4, W_MEAN_BYTES)))
            tok = min(s_tok, AWQ_TOKEN_CHUNK)
            block = min(e, search_block_experts(p, h))  # experts searched at once (~6 float32 copies)
            out["searches"] = max(8 * PAIR_BUDGET + 2 * CLIP_GRAM_BYTES + 6 * block * (p * h + h * i) * 4,
                                  tok * (h * 4 * (LIVE_TEMPORARIES_AWQ) + k * 2 * p * 4)) + upcast
    dense = {d: (m, g) for d, (m, g) in dense.items() if g.method != "rtn"}  # W4A4 RTN: an amax each, no Hessian
    if dense:
        out["dense_hessians"] = sum(m.in_features * m.in_features * 4 for m, _ in dense.values())
        out["dense_solve"] = max(solve_bytes(m.out_features, m.in_features, 1, 1, sitem) for m, _ in dense.values())
    return out


def solve_bytes(n: int, k: int, factored: int, swept: int, sitem: int) -> int:
    """Peak bytes of GPTQ's solve of `swept` matrices [n, k] (quant/gptq.py `gptq`), `factored` of them factorized
    at a time in a solve dtype of `sitem` bytes. Two phases, never both at once: the factorization (the swept
    matrices' float32 inverse factors and two float32 copies of their weights, while each factorized matrix holds
    ~2.65 solve-dtype copies of its Hessian at the recursion's deepest point: 3 planned), then the column sweep
    (the inverse factors, the weights' transposed working copy, codes, dequantized values and the result: ~4
    float32 copies of the weights). Measured at k = 7168, n = 4096, one matrix, float64: 1.48 GB over the
    weights and the Hessian; planned 1.67 GB."""
    factor = swept * (k * k * 4 + 2 * n * k * 4) + factored * 3 * k * k * sitem
    sweep = swept * (k * k * 4 + 4 * n * k * 4)
    return max(factor, sweep)


LIVE_TEMPORARIES_AWQ = 6  # [tokens, hidden] float32 buffers of one norm-search forward chunk besides the MoE blocks
