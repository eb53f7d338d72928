"""The work of the calibrated pass per component, for the cost model (plan/calibration.py): each decoder
layer's shapes, read from the meta model the executor builds; how the pass cuts its tokens into forward batches
and shares them over the ranks; and, per layer, the counted work of each component (forwards, Hessians, GPTQ
solves, AWQ searches, input amax, KV observers, weights read, spool written, communication) divided by the
rates of a throughput table (plan/throughput.py). docs/cost.md describes the model.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from ..arch.layout import ATTN, EXPERTS, ROUTER_MODULES
from ..match.recipe import affinity_experts
from .throughput import Throughput

COMPONENTS = ("forward", "hessians", "gptq_solve", "awq_search", "input_amax", "kv_observe", "read_weights",
              "write_spool", "communication", "fixed")


# ---- shapes of a layer -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _LayerShape:
    dense_params: int  # Linear weights every token passes through (attention, dense MLP, shared experts, router)
    attn_params: int  # of which in the attention module
    experts: int
    p: int  # gate+up rows (2I)
    h: int
    i: int
    top_k: int
    heads: int
    qk_dim: int
    v_dim: int
    indexer: int  # index_n_heads * index_head_dim of a DSA indexer layer (0: none)
    src_bytes: int  # the layer's bytes on disk
    elements: int  # the layer's parameters
    tensors: int  # tensors read
    expert_src_bytes: int


def _layer_shape(ex, idx: int, layer, src_bytes: int, n_tensors: int, expert_bytes: int) -> _LayerShape:
    from torch import nn

    from ..calib import moe

    cfg = ex.config
    experts = next((m for m in layer.modules() if moe.is_routed_experts(m)), None)
    dense = attn = 0
    for name, m in layer.named_modules():
        if isinstance(m, nn.Linear):
            dense += m.in_features * m.out_features
            if name.startswith(f"{ATTN}."):
                attn += m.in_features * m.out_features
        elif name.endswith(ROUTER_MODULES) and getattr(m, "weight", None) is not None:
            dense += m.weight.numel()  # routers that are not nn.Linear
    e = p = h = i = k = 0
    if experts is not None:
        e, p, h = (int(d) for d in experts.gate_up_proj.shape)
        i = int(experts.down_proj.shape[-1])
        k = int(getattr(cfg, "num_experts_per_tok", None) or 8)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    if getattr(cfg, "kv_lora_rank", None):
        qk = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
        v = int(cfg.v_head_dim)
    else:
        qk = v = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    indexer = 0
    if getattr(cfg, "index_topk", None) and any("indexer" in n for n, _ in layer.named_modules()):
        indexer = int(getattr(cfg, "index_n_heads", 1) or 1) * int(getattr(cfg, "index_head_dim", 128) or 128)
    elements = sum(t.numel() for t in layer.state_dict().values())
    return _LayerShape(dense, attn, e, p, h, i, k, heads, qk, v, indexer, src_bytes, elements, n_tensors,
                       expert_bytes)


def _rate(peak: float, half: float, rows: float) -> float:
    rows = max(1.0, rows)
    return peak * rows / (rows + half)


# ---- the work of one layer ---------------------------------------------------------------------------------
def _forward(c: Throughput, s: _LayerShape, batches: list[int], t: int, item: int, hidden: int,
             part: str = "whole") -> float:
    """One forward of a layer over `batches` (the tokens of each forward call; samples of t tokens). `part`:
    "whole"; "to_experts", the first half of a split forward (attention and the router, up to the routed
    experts' call); "block", the second (the MLP block: router, routed and shared experts), as the GPTQ pass
    of the routed experts runs them (calib/executor.py forward_to / forward_from)."""
    from ..calib.executor import LIVE_TEMPORARIES

    attn_part, block_part = part != "block", part != "to_experts"
    router = s.experts * s.h
    if part == "whole":
        params = s.dense_params
    elif part == "to_experts":
        params = s.attn_params + router
    else:
        params = s.dense_params - s.attn_params
    live = {"whole": LIVE_TEMPORARIES, "to_experts": 10, "block": 6}[part]
    sec = 0.0
    for per_call in batches:
        n = max(1, per_call // t)  # samples in the call
        sec += 2 * per_call * params / _rate(c.gemm_flops, c.gemm_half_rows, per_call)
        stream = 2 * live * per_call * hidden * item
        ops = 0
        if attn_part:
            sec += 2 * n * s.heads * t * t * (s.qk_dim + s.v_dim) / _rate(c.gemm_flops, c.gemm_half_rows, t)
            if s.indexer:
                sec += 2 * n * t * t * s.indexer / _rate(c.gemm_flops, c.gemm_half_rows, t)
            # element-wise: the [B, heads, T, T] scores (scale, mask, softmax in float32: ~6 passes), the mask
            stream += 6 * n * s.heads * t * t * max(item, 4) + n * t * t * item
            ops += 100  # norms, projections, rotary, attention, residual, routing
        if block_part:
            ops += 50
            if s.experts:
                rows = per_call * s.top_k / s.experts  # routed rows per expert and call
                sec += 2 * per_call * s.top_k * (s.p * s.h + s.h * s.i) / _rate(c.gemm_flops, c.gemm_half_rows, rows)
                # gather, activation, routing weights, index_add of every routed row; router softmax/top-k; sorting
                stream += per_call * s.top_k * (3 * s.h + 3 * s.p) * item + per_call * s.experts * 4 * 4
                ops += 4 * s.experts  # the batched expert forward: two GEMMs, an index_add_ and bookkeeping per expert
        sec += stream / c.mem_bytes_per_s + ops * c.op_s
    return sec


def _hessians(c: Throughput, s: _LayerShape, batches: list[int], owned: int, hidden: int,
              per_token: int | None = None) -> float:
    """GPTQ statistics of one layer, by the rank that owns `owned` of its experts: the all-token x x^T (one
    rank sums it over every batch), and for each owned expert and batch the Gram of the rows routed to it,
    the down inputs of those rows (one gate/up product) and their Gram, added to the expert's sums.
    `per_token`: the experts each token's row goes to in the statistics (None: the router's top-k;
    `stats: affinity`: affinity_top_k, or every expert), plus the router's scoring of every token."""
    h, e = s.h or hidden, s.experts
    k = s.top_k if per_token is None else min(per_token, e)
    sec = 0.0
    for per_call in batches:
        sec += 2 * per_call * h * h / _rate(c.gram_flops, c.gram_half_rows, per_call)
        if not e or not owned:
            continue
        if per_token is not None:
            sec += 2 * per_call * h * e / _rate(c.gemm_flops, c.gemm_half_rows, per_call)
        rows = per_call * k / e  # per expert and batch (balanced routing)
        routed = rows * owned
        sec += 2 * routed * (h * h + s.i * s.i) / _rate(c.gram_flops, c.gram_half_rows, rows)
        sec += 2 * routed * h * s.p / _rate(c.gemm_flops, c.gemm_half_rows, rows)
        stream = routed * (2 * h + s.p + 2 * s.i) * 4 + owned * (h * h + s.i * s.i) * 4 * 3  # gathers, sums
        sec += stream / c.mem_bytes_per_s + owned * 12 * c.op_s
    return sec


def _fit_unquantized(c: Throughput, s: _LayerShape, batches: list[int], owned: int, hidden: int,
                     per_token: int | None = None, down_only: bool = False) -> tuple[float, float]:
    """(statistics seconds, solve seconds) GPTQ's fit_unquantized adds to one layer (its reference stream's
    forward is counted with the forwards): per owned expert and batch the cross-Gram of its rows with the
    unquantized model's (one more h x h Gram), then after the gate/up solves the down inputs of both streams
    (one more gate/up product than the statistics forward computes) and two i x i Grams; per matrix the
    fitted target: W (A - H) and two products with the solve's own inverse factor (~3 n_out k^2
    multiply-adds, float32; quant/gptq.py `fit`). `down_only` (fit_down): no reference stream, no gate/up
    cross-Gram, down_proj's target only."""
    h, e = s.h or hidden, s.experts
    if not e or not owned:
        return 0.0, 0.0
    k = s.top_k if per_token is None else min(per_token, e)
    stats = 0.0
    for per_call in batches:
        rows = per_call * k / e
        routed = rows * owned
        stats += 2 * routed * ((0 if down_only else h * h) + s.i * s.i) / _rate(c.gram_flops, c.gram_half_rows,
                                                                                 rows)
        stats += 2 * routed * h * s.p / _rate(c.gemm_flops, c.gemm_half_rows, rows)
        stats += routed * ((1 if down_only else 2) * h + s.p) * 4 / c.mem_bytes_per_s
    solve = sum(owned * 6 * n_out * kk * kk / _rate(c.gram_flops, c.gram_half_rows, n_out)
                for n_out, kk in ((s.p, h), (h, s.i))[1 if down_only else 0:])
    return stats, solve


# Coordinate descent after GPTQ (refine_sweeps) on the CPU: the multiply-adds of moved codes per code
# visited, as a fraction of k. Measured on the bench MoE's solve batches ([512, 512] and [512, 256]
# matrices, two sweeps after the refit): 2.1-2.9% of the codes move in the first sweep, 1.2-1.6% in the
# second, each updating the row's gradient over k columns (the last sweep: those still ahead).
REFINE_MOVED = 0.015


def _gptq_solves(c: Throughput, shapes: list[tuple[int, int, int, int]], block: int,
                 refit: bool = False, refine: int = 0) -> tuple[float, float]:
    """(Cholesky seconds, sweep seconds) of GPTQ on matrices [(count, n_out, k_in, chunk)]: `count` of them,
    `chunk` in one column sweep. `refit` (options.refit_scales): each matrix's scales refitted after the
    sweep, ~3 n_out k^2 flops in float32 (A's upper triangle from the codes and the Hessian, n_out k^2, and
    Hd w, 2 n_out k^2), counted as lazy-update GEMMs.
    `refine` (options.refine_sweeps): that many coordinate-descent sweeps after the solve (and the refit),
    plus the starting gradient (one n_out k^2 product); on a GPU each sweep is a column sweep like GPTQ's
    whose block updates reach every column (n_out k^2 flops), on the CPU the compiled row loop visits every
    code and pays k multiply-adds for each that moves (REFINE_MOVED)."""
    chol = sweep = 0.0
    for count, n_out, k, per in shapes:
        if not count:
            continue
        per = max(1, min(count, per))
        chunks = math.ceil(count / per)
        chol += count * (2 / 3) * k ** 3 / _rate(c.chol_flops, c.chol_half_k, k)
        b = min(block, k)
        sweep += chunks * k * c.sweep_col_s
        sweep += count * n_out * k * (b / 2 + 4) / c.sweep_elems_per_s
        # the lazy block updates: float32 bmm in the solve, at the float32 (Gram) rate
        sweep += count * n_out * k * max(0, k - b) / _rate(c.gram_flops, c.gram_half_rows, n_out)
        # act-order permutations, dequantize, SQNR, packing and emitting every module
        sweep += count * (6 * k * k * 8 + 24 * n_out * k) / c.mem_bytes_per_s + count * 40 * c.op_s
        sweep += count * c.module_s  # emitting it (gate/up: two modules, counted at the call)
        if refit:
            sweep += count * 3 * n_out * k * k / _rate(c.gram_flops, c.gram_half_rows, n_out)
        if refine:
            gemm = count * n_out * k * k / _rate(c.gram_flops, c.gram_half_rows, n_out)
            if c.kind == "cpu":  # the compiled row loop: every code visited, K multiply-adds per moved code
                sweep += refine * count * n_out * k * (1 + REFINE_MOVED * k) / c.sweep_elems_per_s + gemm
            else:
                sweep += refine * (chunks * k * c.sweep_col_s + count * n_out * k * (b / 2 + 4) / c.sweep_elems_per_s
                                   + gemm) + gemm
    return chol, sweep


def _heldout_check(c: Throughput, s: _LayerShape, tokens: int, owned: int, holdout: int, fit: tuple[bool, bool]):
    """GPTQ's held-out check (calib/gptq_pass._heldout_check) of the `owned` experts of the busiest rank, after
    their solves: every `holdout`-th row routed to an expert (of `tokens` calibration tokens, balanced routing)
    was kept out of its Hessians; per expert and matrix one product of those rows with W, W - D (GPTQ's) and
    W - D (RTN's, computed for the matrix), the squares of each part summed in float64. `fit` (gate/up, down):
    the matrix is checked against the unquantized model's outputs, one more product. Retries (an INT4 expert
    that RTN beats is solved again at higher damping, calib/gptq_pass.RETRY_DAMPING) depend on the data and
    are not counted."""
    rows = tokens * s.top_k / s.experts / holdout
    sec = 0.0
    for (n_out, k), ref in zip(((s.p, s.h), (s.h, s.i)), fit):
        flops = 2 * rows * k * n_out * (3 + int(ref))
        sec += owned * flops / _rate(c.gram_flops, c.gram_half_rows, rows)  # float32 whatever the layers' dtype
        # RTN's codes and both dequantizations, the three candidates side by side, then per part the product's
        # columns in float64, squared and summed
        stream = (8 * n_out * k * 4 + 6 * n_out * k * 4 + rows * 3 * n_out * (4 + 3 * 8)) * owned
        sec += stream / c.mem_bytes_per_s + owned * 30 * c.op_s
    return sec


def awq_candidates(n_grid: int, stride: int) -> tuple[int, int]:
    """Candidates of AWQ's scale searches per round (quant.awq.grid_coarse, grid_refine): s = 1 and every
    stride-th grid point, then up to 2 (stride - 1) neighbours of the best (fewer at the grid's ends)."""
    from ..quant.awq import grid_coarse  # torch is imported only where the plan needs it

    coarse = len(grid_coarse(n_grid, stride))
    return coarse, min(2 * (stride - 1), n_grid + 1 - coarse)


def _awq_search_parts(c: Throughput, s: _LayerShape, s_tok: int, o, group_size: int | None) -> dict[str, float]:
    """AWQ's searches for one MoE layer (calib/awq_pass.py), seconds per part: `norm`, the norm scale
    (`awq_candidates` on 512 strided sampled tokens, 3 finalists on all of them: each a fake-quantized copy
    of every expert's gate/up and a forward of the MoE block); `down`, the per-expert up -> down scale (the
    down inputs, their weighted Gram, then per candidate a fake-quant of down and a quadratic form,
    H x I x I, per expert); `clip`, the clip search (the inputs' Gram; per ratio a fake-quant and the group
    errors, float32 [rows, g] x [g, g] products; the row test, a fake-quant and one [rows, K] x [K, K]
    product per matrix); `choice`, the four clip combinations on <= 512 rows; `rtn`, RTN with the found
    parameters, SQNR, packing. `o`: the group's AWQ options (match.recipe.AWQOptions); `group_size`: its
    scheme's (None: one group a row)."""
    e, h, p, i, k = s.experts, s.h, s.p, s.i, s.top_k
    experts, down, clip = s.experts, o.scale_down, o.clip  # every routed expert is searched
    g_gu, g_dn = group_size or h, group_size or i
    cands = sum(awq_candidates(o.n_grid, o.grid_stride))
    fq = c.fake_quant_elems_per_s
    mem = c.mem_bytes_per_s
    parts = dict.fromkeys(("norm", "down", "clip", "choice", "rtn"), 0.0)
    # (1) norm scale: every expert's gate/up scaled, fake-quantized and copied in per candidate, block forwards
    sub = min(512, s_tok)
    sec = (cands + 3) * e * p * h * (1 / fq + 12 / mem)
    block_tokens = cands * sub + 3 * s_tok
    block_rows = max(1.0, sub * k / e)
    sec += 2 * block_tokens * (k * (p * h + h * i) + s.dense_params) / _rate(c.gemm_flops, c.gemm_half_rows,
                                                                               block_rows)
    sec += block_tokens * k * (3 * h + 3 * p) * 4 / mem + (cands + 3) * (4 * e + 150) * c.op_s
    parts["norm"] = sec
    # the routed rows of the sampled tokens per expert (experts searched on their own rows)
    rows = s_tok * k / max(1, e)
    # (2) up -> down: down inputs, their weighted Gram, then per candidate a fake-quant of down and H x I x I
    sec = experts * 2 * rows * (h * p + i * i) / _rate(c.gemm_flops, c.gemm_half_rows, rows)
    if down:
        sec += experts * cands * (2 * h * i * i / _rate(c.gemm_flops, c.gemm_half_rows, h) + h * i / fq
                                  + h * i * 4 * 8 / mem)
    parts["down"] = sec
    if clip:
        sec = 0.0
        nratio = 12  # clip_ratios(4 bits, n_grid 20, max_shrink 0.5) and r = 1
        for n_out, kk, g in ((p, h, g_gu), (h, i, g_dn)):
            # the inputs' Gram (float32) and its diagonal blocks
            sec += experts * (2 * rows * kk * kk / _rate(c.gram_flops, c.gram_half_rows, rows)
                              + kk * kk * 8 / mem)
            # per ratio: a fake-quant, the error, the group errors, the running best
            sec += experts * nratio * (n_out * kk / fq + n_out * kk * 12 / mem
                                       + 2 * n_out * kk * g / c.block_form_flops + 8 * c.op_s)
            # the row test: a fake-quant with the chosen ratios, one float32 [rows, K] x [K, K] product
            sec += experts * (n_out * kk / fq + n_out * kk * 24 / mem
                              + 2 * n_out * kk * kk / _rate(c.gemm_flops, c.gemm_half_rows, n_out))
        parts["clip"] = sec
        crow = min(rows, 512)
        parts["choice"] = (experts * crow * (2 * 2 * h * p + 4 * 2 * i * h) / _rate(c.gemm_flops, c.gemm_half_rows, crow)
                           + experts * (p * h + h * i) * 2 / fq)
    # RTN with the found parameters, SQNR, packing and emitting
    parts["rtn"] = (experts * (p * h + h * i) * (1 / fq + 24 / mem) + experts * 60 * c.op_s
                    + experts * 3 * c.module_s)
    return parts



# ---- how the pass cuts its work ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Batches:
    batch_tokens: int  # tokens per forward call of the pass
    all_batches: list[int]  # tokens of every forward batch
    rank_batches: list[int]  # the busiest rank's batches
    rank_tokens: int  # the busiest rank's tokens


def pass_batches(ex, lengths: list[int], g: int, capped: bool = True) -> Batches:
    """A pass's forward batches (calib/activations.batch_plan; GPTQ/AWQ, `capped`: the executor's batch size
    capped so that the samples make at least a few batches, calib/spool.py; KV scales: the executor's) and
    the busiest rank's share of them (calib/parallel.py: the heaviest batch first, each to the least loaded
    rank)."""
    from ..calib import spool

    bt = ex.batch_tokens
    cap = getattr(spool, "pass_batch_tokens", None)
    if capped and cap is not None:
        bt = cap(bt, lengths)
    tokens = [sum(lengths[i] for i in b) for b in _batch_plan(lengths, bt)]
    load = [0] * g
    mine: list[list[int]] = [[] for _ in range(g)]
    least = [(0, r) for r in range(g)]  # (load, rank), a heap: its head is the least loaded, lowest rank
    for b in sorted(range(len(tokens)), key=lambda b: (-tokens[b], b)):
        _, r = heapq.heappop(least)
        load[r] += tokens[b]
        mine[r].append(tokens[b])
        heapq.heappush(least, (load[r], r))
    busiest = max(range(g), key=lambda r: (load[r], -r))
    return Batches(bt, tokens, mine[busiest], load[busiest])


def _batch_plan(lengths: list[int], bt: int) -> list[list[int]]:
    try:
        from ..calib.activations import batch_plan
    except ImportError:  # the executor's own grouping: max(1, bt // T) samples of equal length per call
        def batch_plan(lengths, bt):
            per = max(1, bt // max(1, max(lengths)))
            return [list(range(i, min(len(lengths), i + per))) for i in range(0, len(lengths), per)]
    return batch_plan(lengths, bt)


def kv_batch_tokens(ex) -> int:
    return ex.auto_batch_tokens()


def kv_batches(ex, lengths: list[int], g: int) -> list[int]:
    """KV-scale calibration (quantkit.calibrate; calib/kv_dist.py over ranks): the executor's own batches,
    the busiest rank's share."""
    return pass_batches(ex, lengths, g, capped=False).rank_batches


def _sweep_experts(k: int, n: int, group: int, kind: str) -> int:
    """Experts one column sweep covers (calib/gptq_pass.py sweep_experts)."""
    import torch

    from ..calib.gptq_pass import sweep_experts

    return int(sweep_experts(k, n, group, torch.device("cuda" if kind == "cuda" else "cpu")))


def _expert_group(s: _LayerShape, kind: str) -> int:
    """Experts solved at once, and the unit of expert ownership (calib/gptq_pass.py)."""
    import torch

    from ..calib import gptq_pass

    dev = torch.device("cuda" if kind == "cuda" else "cpu")
    fn = getattr(gptq_pass, "expert_group_size", None)
    if fn is not None:
        return int(fn(s.experts, s.h, s.i, dev))
    return min(gptq_pass.chunk_experts(s.h, dev), gptq_pass.chunk_experts(s.i, dev))


def _communication(s: _LayerShape, egroup, dense, gq: Batches, g: int, item: int, hidden: int,
                   owned: int, s_tok: int) -> dict[str, float]:
    """Bytes one rank receives for one layer in a world of g ranks (calib/parallel.py): every batch's MoE
    inputs (float32 rows, routing indices and weights) broadcast by the rank that forwarded it (AWQ: the
    sampled rows and the block's outputs for them); dense targets' partial Hessians sent to their owners;
    the dequantized weights broadcast by their owners (GPTQ's routed experts on an INT4 grid: their codes,
    one byte each, and float32 scales and zero points per group instead; AWQ: the routed experts' from the
    ranks that searched and quantized them, the rest of the layer from rank 0, and the per-expert search
    results from the ranks that ran them). The packed results do not
    travel: each rank writes what it solved to the spool. GPTQ's fit_unquantized: every batch's unquantized-model MoE inputs too."""
    out: dict[str, float] = {}
    others = sum(gq.all_batches) - gq.rank_tokens
    if egroup is not None and egroup.method == "gptq":
        out["moe_inputs"] = others * (hidden * 4 + s.top_k * 16)
        if egroup.options.fit_unquantized:  # the unquantized model's rows beside them
            out["reference_inputs"] = others * hidden * 4
        sch = egroup.scheme
        if sch.for_in_features(s.h).fp4:
            out["dequantized_weights"] = (s.experts - owned) * (s.p * s.h + s.h * s.i) * item
        else:  # codes (int8) and per-group scales (float32), zero points too when asymmetric
            per_group = 4 * (1 if sch.symmetric else 2)
            out["expert_codes"] = (s.experts - owned) * sum(
                rows * k * (1 + per_group / (sch.for_in_features(k).group_size or k))
                for rows, k in ((s.p, s.h), (s.h, s.i)))
    elif egroup is not None and egroup.method == "rtn":  # NVFP4 W4A4 input amax: gathered maxima only
        out["input_amax"] = s.experts * 3 * 8 * (g - 1) / g
    elif egroup is not None:
        out["moe_inputs"] = s_tok * (g - 1) / g * (2 * hidden * 4 + s.top_k * 16)
        routed = s.experts * (s.p * s.h + s.h * s.i)
        out["dequantized_weights"] = (s.elements - routed + routed * (g - 1) / g) * item
        gs = egroup.scheme.group_size or s.h  # the other ranks' search results: down scales, clip ratios
        out["search_results"] = s.experts * (g - 1) / g * (s.i + 1 + (s.p * s.h + s.h * s.i) / gs) * 4
    if dense:
        out["dense_partials"] = len(gq.all_batches) * sum(m.in_features ** 2 * 4 for m, _ in dense.values()) \
            * (g - 1) / g
        out["dequantized_weights"] = out.get("dequantized_weights", 0) + sum(
            m.in_features * m.out_features * item for m, _ in dense.values()) * (g - 1) / g
    return out


# ---- the model ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PassContext:
    """What every layer's time model of the calibrated pass reads."""

    c: "Throughput"
    ex: object  # the meta-built LayerExecutor
    ckpt: object  # the (virtual) checkpoint
    rec: object  # the Recipe
    kind: str  # "cpu" | "cuda"
    g: int  # ranks
    item: int  # bytes per element of the pass's dtype
    hidden: int
    num_samples: int
    seq_len: int
    gq: object  # the pass's batches over the ranks (pass_batches), the top-up pool's included
    stats_batches: list[int]  # tokens per batch of the calibration samples alone (no top-up pool)


def bytes_per_layer(ckpt, num_layers: int) -> dict[int, list[int]]:
    """Per decoder layer, from the (virtual) headers: [source bytes, tensors, routed-expert bytes]."""
    from ..arch import layer_index

    out: dict[int, list[int]] = {}
    for name in ckpt.location:
        li = layer_index(name)
        if li is None or li >= num_layers:
            continue
        info = ckpt.info(name)
        acc = out.setdefault(li, [0, 0, 0])
        acc[0] += info.nbytes
        acc[1] += 1
        if f".{EXPERTS}." in name:
            acc[2] += info.nbytes
    return out


def calibrated_bytes(layout, rec, num_layers: int) -> tuple[dict[int, int], dict[str, bool]]:
    """(bytes the calibrated groups write per layer: the pass's results; module -> calibrated or not)."""
    from ..arch import layer_index
    from .tensors import tensor_bytes

    packed_layer: dict[int, int] = {}
    calibrated_module: dict[str, bool] = {}
    for name, (shape, code) in layout.items():
        li = layer_index(name)
        if li is None or li >= num_layers:
            continue
        module = name.rsplit(".", 1)[0]
        hit = calibrated_module.get(module)
        if hit is None:
            grp = rec.match(module)
            hit = calibrated_module[module] = grp is not None and grp.method != "rtn"
        if hit:
            packed_layer[li] = packed_layer.get(li, 0) + tensor_bytes(shape, code)
    return packed_layer, calibrated_module


def pass_row(row: dict, comm: dict, held: dict, ctx: PassContext, idx: int, layer, s, packed: int) -> int:
    """Add one layer's GPTQ/AWQ pass seconds to `row` (its communicated bytes to `comm`, the packed results the
    busiest rank holds and writes to `held[idx]`); 1 when the layer has something calibrated, else 0."""
    from ..calib.layer import linear_targets
    from ..calib.spool import fits_unquantized

    c, ex, rec, g, item, hidden, gq = ctx.c, ctx.ex, ctx.rec, ctx.g, ctx.item, ctx.hidden, ctx.gq
    num_samples, seq_len, link = ctx.num_samples, ctx.seq_len, c.link_bytes_per_s
    calibrated = 0
    _, egroup, dense = linear_targets(ctx.ckpt, rec, idx, layer)
    # NVFP4 W4A4 RTN targets are only observed (their input amax): no Hessian, no solve
    dense = {d: v for d, v in dense.items() if v[1].method != "rtn"}
    # statistics forward, then the quantized layer's forward (true-sequential): the busiest rank's batches.
    # GPTQ of the routed experts alone splits them (the statistics stop at the experts, the second
    # forward runs the MLP block only); a layer with nothing calibrated is forwarded once
    split = (egroup is not None and egroup.method in ("gptq", "rtn") and not dense
             and not getattr(ex.config, "index_topk", None))
    if split:
        row["forward"] += _forward(c, s, gq.rank_batches, seq_len, item, hidden, "to_experts") + \
            _forward(c, s, gq.rank_batches, seq_len, item, hidden, "block")
    else:
        row["forward"] += (2 if egroup is not None or dense else 1) * \
            _forward(c, s, gq.rank_batches, seq_len, item, hidden)
    if egroup is not None or dense:
        calibrated = 1
    if fits_unquantized(rec):  # the unquantized model's stream through every layer, saved with the progress
        row["forward"] += _forward(c, s, gq.rank_batches, seq_len, item, hidden)
        row["write_spool"] += gq.rank_tokens * hidden * item / c.write_bytes_per_s + c.fsync_s
    if egroup is not None and egroup.scheme.w4a4 and s.experts:
        # NVFP4 W4A4: each expert's input amax, and its down input's (one gate/up product per routed
        # token, the busiest rank's batches; calib/observers.py ExpertInputAmax)
        for per_call in gq.rank_batches:
            rows = per_call * s.top_k / s.experts
            row["input_amax"] += 2 * per_call * s.top_k * s.h * s.p / _rate(c.gemm_flops, c.gemm_half_rows,
                                                                               rows)
    owned = 0
    if egroup is not None and egroup.method == "gptq":
        owned = _gptq_experts_row(row, ctx, s, egroup)
    elif egroup is not None and egroup.method == "awq":
        _awq_row(row, ctx, s, egroup)
    if dense:
        _dense_row(row, ctx, dense)
    # the spool: the layer's packed results (each rank writes what it solved: the busiest rank's expert groups,
    # AWQ's about E / g experts) and the next layer's inputs (every rank its own samples')
    if g == 1:
        written = 1.0
    elif egroup is not None and egroup.method == "awq":
        written = math.ceil(s.experts / g) / s.experts if s.experts else 1 / g
    else:
        written = owned / s.experts if owned else 1 / g
    held[idx] = int(packed * written)
    row["write_spool"] += (held[idx] + gq.rank_tokens * hidden * item) / c.write_bytes_per_s + 5 * c.fsync_s
    if g > 1:
        got = _communication(s, egroup, dense, gq, g, item, hidden, owned,
                             min(int(egroup.options.sample_tokens), num_samples * seq_len)
                             if egroup is not None and egroup.method != "rtn" else 0)
        for k2, v in got.items():
            comm[k2] = comm.get(k2, 0) + v
        row["communication"] += sum(got.values()) / link
    return calibrated


def _gptq_experts_row(row: dict, ctx: PassContext, s: _LayerShape, egroup) -> int:
    """Add GPTQ of one layer's routed experts to `row` (the busiest rank's: its expert groups' Hessians and
    solves, the held-out check, the fit to the unquantized model); returns the experts that rank owns."""
    c, kind, g, hidden = ctx.c, ctx.kind, ctx.g, ctx.hidden
    group = _expert_group(s, kind)
    groups = math.ceil(s.experts / group)
    owned = min(s.experts, math.ceil(groups / g) * group)  # the busiest rank's experts
    o = egroup.options
    per_token = affinity_experts(o.affinity_top_k, s.top_k, s.experts) if o.stats == "affinity" else None
    # the Grams of the calibration samples (a top-up pool adds a few rows per starved expert: not counted)
    row["hessians"] += _hessians(c, s, ctx.stats_batches, owned, hidden, per_token)
    sweep = [_sweep_experts(kk, nn, group, kind) for nn, kk in ((s.p, s.h), (s.h, s.i))]
    ch, sw = _gptq_solves(c, [(owned, s.p, s.h, sweep[0]), (owned, s.h, s.i, sweep[1])],
                          egroup.options.block_size, egroup.options.refit_scales, egroup.options.refine_sweeps)
    row["gptq_solve"] += ch + sw + owned * c.module_s  # gate and up: one matrix, two modules
    if o.holdout >= 2:
        row["gptq_solve"] += _heldout_check(c, s, sum(ctx.stats_batches), owned, o.holdout,
                                            (bool(o.fit_unquantized), bool(o.fit_unquantized or o.fit_down)))
    if o.fit_unquantized or o.fit_down:
        fs, fsol = _fit_unquantized(c, s, ctx.stats_batches, owned, hidden, per_token,
                                    down_only=not o.fit_unquantized)
        row["hessians"] += fs
        row["gptq_solve"] += fsol
    return owned


def _awq_row(row: dict, ctx: PassContext, s: _LayerShape, egroup) -> None:
    """Add AWQ's searches of one layer's routed experts to `row`: the busiest rank's share of them."""
    c, g, hidden = ctx.c, ctx.g, ctx.hidden
    o = egroup.options
    s_tok = min(int(o.sample_tokens), ctx.num_samples * ctx.seq_len)
    sch = egroup.scheme
    # the norm-scale candidates of each round and the per-expert searches (awq_pass.search_owners:
    # about E / g each) are split over the ranks, and each rank quantizes and emits the experts it searched
    parts = _awq_search_parts(c, s, s_tok, o, sch.group_size)
    share = math.ceil(s.experts / g) / s.experts
    # the busiest rank's share of the candidates' tokens: each round's candidates are split
    rounds = awq_candidates(o.n_grid, o.grid_stride)
    cands, mine, sub = sum(rounds), sum(math.ceil(r / g) for r in rounds), min(512, s_tok)
    norm_share = ((mine * sub + math.ceil(3 / g) * s_tok) / (cands * sub + 3 * s_tok)
                  if s_tok > sub else mine / cands)
    row["awq_search"] += (norm_share * parts["norm"]
                          + share * (parts["down"] + parts["clip"] + parts["choice"] + parts["rtn"]))
    row["awq_search"] += s_tok * hidden * 4 * 2 / c.mem_bytes_per_s  # the samples and block outputs


def _dense_row(row: dict, ctx: PassContext, dense: dict) -> None:
    """Add GPTQ of one layer's dense targets (`dense`: name -> (module, group)) to `row`: every batch's
    Hessians, the solves of the targets the busiest rank owns."""
    c, g, gq = ctx.c, ctx.g, ctx.gq
    dshapes = [(1, m.out_features, m.in_features, 1) for m, _ in dense.values()]
    mine = dshapes[::g]  # the i-th dense target belongs to rank i % G
    row["hessians"] += sum(2 * tok * k * k / _rate(c.gram_flops, c.gram_half_rows, tok)
                           for _, _, k, _ in dshapes for tok in gq.rank_batches)
    refit = any(getattr(grp.options, "refit_scales", False) for _, grp in dense.values())
    refine = max((getattr(grp.options, "refine_sweeps", 0) for _, grp in dense.values()), default=0)
    ch, sw = _gptq_solves(c, mine, 128, refit, refine)
    row["gptq_solve"] += ch + sw


def kv_row(row: dict, ctx: PassContext, s, kvb: list[int]) -> None:
    """Add one layer's KV calibration seconds (forward and the K/V observers) to `row`."""
    c, ex, item, hidden = ctx.c, ctx.ex, ctx.item, ctx.hidden
    row["forward"] += _forward(c, s, kvb, ctx.seq_len, item, hidden)
    kv_width = (int(getattr(ex.config, "kv_lora_rank", 0) or 0) + int(getattr(ex.config, "qk_rope_head_dim", 0)
                or 0)) or 2 * s.heads * s.qk_dim
    tokens = sum(kvb)
    row["kv_observe"] += 2 * tokens * hidden * kv_width / _rate(c.gemm_flops, c.gemm_half_rows, max(kvb)) \
        + 4 * tokens * kv_width * 4 / c.mem_bytes_per_s



@dataclass
class PassSeconds:
    """The pass's time over every decoder layer: seconds by component (COMPONENTS, the fixed costs included),
    each layer's row, the bytes one rank receives by kind, the packed result bytes the busiest rank holds per
    layer, and the layers with something calibrated."""

    seconds: dict[str, float]
    per_layer: list[dict[str, Any]] = field(default_factory=list)
    communication: dict[str, float] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)
    calibrated_layers: int = 0


def pass_seconds(ctx: PassContext, kvb: list[int], layer_bytes: dict[int, list[int]], packed_layer: dict[int, int],
                 pool: int) -> PassSeconds:
    """The GPTQ/AWQ pass (when the recipe runs one) and the KV calibration (when it has a kv_cache section),
    layer by layer: `kvb`, the KV calibration's batches (kv_batches); `layer_bytes`, bytes_per_layer's;
    `packed_layer`, calibrated_bytes' bytes per layer; `pool`, the top-up samples the GPTQ/AWQ pass forwards
    (GPTQ's balance_tokens)."""
    c, ex, hidden = ctx.c, ctx.ex, ctx.hidden
    passes_gq = ctx.rec.needs_calibrated_pass
    passes_kv = ctx.rec.kv_cache is not None
    out = PassSeconds(dict.fromkeys(COMPONENTS, 0.0))
    emb_rows = (ctx.num_samples + pool) * ctx.seq_len
    fixed = (c.startup_s + c.setup_s * (int(passes_gq) + int(passes_kv))
             + emb_rows * hidden * 4 / c.mem_bytes_per_s)
    out.seconds["fixed"] += fixed
    for idx in range(ex.num_layers):
        layer = ex.decoder_layers[idx]
        sb, nt, eb = layer_bytes.get(idx, [0, 0, 0])
        s = _layer_shape(ex, idx, layer, sb, nt, eb)
        row: dict[str, float] = dict.fromkeys(COMPONENTS, 0.0)
        read = sb / c.read_bytes_per_s + s.elements * (ctx.item + 2 + ctx.item) / c.mem_bytes_per_s + nt * 6 * c.op_s
        if passes_gq:
            row["read_weights"] += read
            row["fixed"] += c.layer_s
            out.calibrated_layers += pass_row(row, out.communication, out.held, ctx, idx, layer, s,
                                              packed_layer.get(idx, 0))
        if passes_kv:
            row["read_weights"] += read
            row["fixed"] += c.layer_s
            kv_row(row, ctx, s, kvb)
        for k2, v in row.items():
            out.seconds[k2] += v
        out.per_layer.append({"layer": idx, **{k2: round(v, 4) for k2, v in row.items() if v}})
    return out
