"""AWQ for the routed experts of one decoder layer (quant/awq.py does the searches): a scale shared by every
expert's gate/up folded into the post-attention norm (router and shared expert compensated), per-expert
up -> down scales, clipping; then RTN with the found parameters, written back into the layer.

Each scale search tries plain RTN and every grid_stride-th of the n_grid grid points, then the grid points
next to the best one (quant.awq.grid_coarse / grid_refine: 13 candidates by default). What keeps that cheap:
- (1) the norm scale: a candidate is a forward of the whole MoE block (router, routed experts with the
  batched expert forward, shared expert). Every candidate runs on a strided subset of the sampled tokens
  (NORM_SEARCH_TOKENS); the NORM_SEARCH_FINALISTS best of them and s = 1 then run on every sampled token,
  and the best of those wins, so the result still can only improve on RTN over the whole sample. The
  unquantized block's output on the sample is recorded by the statistics pass (no extra forward).
- (2) the per-expert up -> down scales: a candidate's loss, the router-weighted output error of the expert,
  is a quadratic form in the down weights' error: sum_t w_t^2 |(Q(dn s)/s - dn) he_t|^2 = sum_n d_n G d_n^T
  with G = sum_t w_t^2 he_t he_t^T [I, I] formed once per expert, so a candidate costs H x I x I per expert
  whatever the number of tokens (it was tokens x I x H).
- (3) clipping: search_clip's Gram matrices; the four (gate/up, down) clip combinations share the two
  gate/up products.
On a GPU every tensor stays on the layer's device; results go to the host only to be emitted."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..arch.layout import DENSE_MLP, HF_BLOCK, POST_ATTN_NORM, ROUTER, shared_name
from ..errors import CalibrationError
from ..match.recipe import WeightGroup
from ..quant.awq import (choose_qparams_clipped, fake_quant, grid_coarse, grid_refine, scale_candidates,
                         search_clip, search_scales)
from ..quant.int4 import QParams, dequantize, quantize, sqnr_db
from ..pack.layout import scale_dtype
from .emit import LayerResult, emit, source_dtype
from .hessians import PAIR_BUDGET, ExpertStats, coverage, routed_batches
from .names import disk_name

AWQ_TOKEN_CHUNK = 8192  # tokens per MoE forward inside the norm-scale search (bounds its temporaries)
NORM_SEARCH_TOKENS = 512  # sampled tokens (strided) every norm-scale candidate is tried on first
NORM_SEARCH_FINALISTS = 2  # best candidates on that subset, tried again with s = 1 on every sampled token
CLIP_CHOICE_TOKENS = 512  # rows per expert (strided) the four clip combinations are compared on at most
# float32 bytes of experts' weights a whole-layer step (a norm-scale candidate's fake quantization, the
# final quantization) works on at once: every step is per expert, so the chunking changes no result, and a
# layer's experts are held once, in the layer's dtype, not as float32 working copies (a Kimi K2 layer's
# gate/up is 42 GiB in float32)
EXPERT_CHUNK_BYTES = 1 << 30
W_MEAN_BYTES = 1 << 30  # float32 bytes of rows `_rows_w_mean` averages in one piece (above: summed by chunks)


def experts_per_chunk(expert_elems: int) -> int:
    """Experts of `expert_elems` elements in EXPERT_CHUNK_BYTES of float32 (at least one)."""
    return max(1, EXPERT_CHUNK_BYTES // max(1, expert_elems * 4))


def search_block_experts(p: int, h: int) -> int:
    """Experts searched at once (`_awq_expert_batches`): the searches hold ~6 float32 copies of a block's
    weights, so at most a quarter of EXPERT_CHUNK_BYTES of gate/up [p, h] per block (at least one)."""
    return experts_per_chunk(4 * p * h)


def _expert_chunks(n_experts: int, expert_elems: int):
    """Slices of at most EXPERT_CHUNK_BYTES of float32 experts (at least one expert each)."""
    per = experts_per_chunk(expert_elems)
    return [slice(i, min(n_experts, i + per)) for i in range(0, n_experts, per)]


def _stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as it will be written in `dtype` (the tensor's source dtype), back in float32."""
    return t.to(dtype).float() if dtype.is_floating_point else t.float()



def _mlp_out(mlp, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The MoE block's output [T, H] (float32) for inputs x [T, H], in chunks of tokens."""
    return torch.cat([mlp(x[i:i + AWQ_TOKEN_CHUNK].to(dtype)[None])[0].float()
                      for i in range(0, x.shape[0], AWQ_TOKEN_CHUNK)])


def _group_w_mean(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """AWQ's weight statistic: |w| / max|w| within each quantization group, averaged over output rows.
    w [..., N, K] -> [..., K]."""
    k = w.shape[-1]
    g = group_size or k
    a = w.abs().reshape(*w.shape[:-1], k // g, g)
    return (a / a.amax(-1, keepdim=True).clamp(min=1e-12)).reshape(w.shape).mean(-2)


def _rows_w_mean(parts: list[torch.Tensor], group_size: int | None) -> torch.Tensor:
    """`_group_w_mean` of the rows of `parts` ([..., K] each) stacked: in one piece up to W_MEAN_BYTES of
    float32 (the result of one torch.cat), above that summed in float64 over chunks of rows (no copy of
    every row at once)."""
    k = parts[0].shape[-1]
    rows = [p.reshape(-1, k) for p in parts]
    n = sum(r.shape[0] for r in rows)
    if n * k * 4 <= W_MEAN_BYTES:
        return _group_w_mean(torch.cat([r.float() for r in rows]), group_size)
    acc = torch.zeros(k, dtype=torch.float64, device=parts[0].device)
    step = max(1, W_MEAN_BYTES // (k * 4))
    for r in rows:
        for i in range(0, r.shape[0], step):
            acc += _group_w_mean(r[i:i + step].float(), group_size).double() * min(step, r.shape[0] - i)
    return (acc / n).float()


def _search_norm_scale(x_mean, w_mean, loss_on, x: torch.Tensor, fp_out: torch.Tensor, n_grid: int,
                       stride: int = 1):
    """The norm-scale grid search (quant.awq.search_scales' candidates, coarse-to-fine rounds and tie rule:
    the lower candidate index, s = 1 first, wins a tie), with the candidates tried on NORM_SEARCH_TOKENS
    strided tokens first and the NORM_SEARCH_FINALISTS best and s = 1 then on all of x.
    `loss_on(s, x, ref)` -> scalar. Returns (s, a)."""
    return _drive(_norm_search_steps(x_mean, w_mean, loss_on, x, fp_out, n_grid, stride=stride))


def _drive(steps):
    """Run a generator of `awq_steps`' kind to its end, calling every exchange it yields; its return value."""
    try:
        while True:
            next(steps)()
    except StopIteration as stop:
        return stop.value


def _losses(par, loss_of, todo: list[int]):
    """Generator: {candidate: loss} for the candidates `todo`. One process computes them all (no yield); a
    distributed `par` has each computed by one rank (the j-th by rank j % world) and exchanged (yields the
    all-gather for the caller to run), and returns them all on every rank."""
    if par is None or not par.distributed:
        return {i: loss_of(i) for i in todo}
    mine = {i: loss_of(i) for j, i in enumerate(todo) if j % par.size == par.rank}
    box: dict = {}
    yield lambda: box.update(all=par.world.all_gather(mine))
    return {i: v for part in box["all"] for i, v in part.items()}


def _norm_search_steps(x_mean, w_mean, loss_on, x: torch.Tensor, fp_out: torch.Tensor, n_grid: int, par=None,
                       stride: int = 1):
    """`_search_norm_scale` as a generator. Distributed (`par`): each round's candidates are split over the
    ranks and their losses exchanged (yielded, see `awq_steps`); every rank then makes the same choice from
    the same numbers, so the result does not depend on the world size."""
    n = x.shape[0]
    cands = [(-1.0, torch.ones_like(x_mean, dtype=torch.float32))] + list(scale_candidates(x_mean, w_mean, n_grid))
    if n <= NORM_SEARCH_TOKENS:  # every round on every token
        xs, refs = x, fp_out
    else:
        sub = torch.linspace(0, n - 1, NORM_SEARCH_TOKENS, device=x.device).round().long()
        xs, refs = x[sub], fp_out[sub]

    def on_subset(i):
        return float(loss_on(cands[i][1], xs, refs))

    def best(losses: dict) -> int:
        return min(losses, key=lambda i: (losses[i], i))  # least loss, then the lower index

    coarse = grid_coarse(n_grid, stride)
    seen = yield from _losses(par, on_subset, coarse)
    if stride > 1:
        centre = best({i: seen[i] for i in coarse[1:]})
        seen.update((yield from _losses(par, on_subset, grid_refine(centre, n_grid, stride))))
    if n > NORM_SEARCH_TOKENS:
        ranked = sorted(seen, key=lambda i: (seen[i], i))
        finalists = sorted({0, *ranked[:NORM_SEARCH_FINALISTS]})
        seen = yield from _losses(par, lambda i: float(loss_on(cands[i][1], x, fp_out)), finalists)
    win = best(seen)
    return cands[win][1], float(cands[win][0])


@dataclass(frozen=True)
class MoEBlock:
    """A decoder layer's MoE block as AWQ folds into it: the checkpoint and layer index its on-disk names come
    from, the routed experts' names, the decoder layer, the block (`mlp`), its routed experts, its router and
    its shared expert (None where it has none)."""

    ckpt: object
    idx: int
    names: object
    layer: nn.Module
    mlp: nn.Module
    experts: nn.Module
    router: nn.Module | None
    shared: nn.Module | None


def _norm_readers(res: LayerResult, block: MoEBlock) -> list[tuple[nn.Module, str]]:
    """The unquantized tensors that read the post-attention norm's output besides the routed experts: (module,
    on-disk weight name) of the router and the shared expert's gate and up. One that a calibrated group has
    already quantized is refused: its fold could not be stored."""
    ckpt, idx = block.ckpt, block.idx
    readers = []
    if block.router is not None:
        readers.append((block.router, disk_name(ckpt, idx, f"{HF_BLOCK}.{ROUTER}.weight")))
    if block.shared is not None:
        sname = shared_name(block.mlp)
        for nm in (DENSE_MLP.gate, DENSE_MLP.up):
            readers.append((getattr(block.shared, nm), disk_name(ckpt, idx, f"{HF_BLOCK}.{sname}.{nm}.weight")))
    for _, name in readers:
        if name[: -len(".weight")] in res.modules:
            raise CalibrationError(f"{name[: -len('.weight')]}: quantized by a calibrated group, but it reads the "
                                   "post-attention norm that AWQ scales",
                                   hint="quantize it with method rtn, or leave it unquantized")
    return readers


def _awq_norm_scale(res, block: MoEBlock, g: WeightGroup, x: torch.Tensor, gu: torch.Tensor,
                    fp_out: torch.Tensor | None = None, par=None):
    """(1) One per-channel scale s [H] for every routed expert's gate/up (and the shared expert's): the
    post-attention norm weight becomes norm / s, every reader of the norm output (experts, router, shared
    expert) is multiplied by s. The search loss is the MoE block output error against the unquantized block,
    with the routed experts' gate/up quantized in the scaled domain *and* the norm, router and shared
    expert exactly as they will be stored (rounded to their source dtype): a scale whose fold would perturb
    the router more than it helps the experts loses. s = 1 (plain RTN) is a candidate. `gu`: the routed
    experts' gate/up [E, P, H] in float32 as they are now (not modified); `fp_out`: the unquantized block's
    output on x (computed here when None).

    Applies the chosen fold to the layer in place, records the changed source tensors as overrides and
    returns (effective scale s [H] (float32, exact for the stored norm), alpha)."""
    ckpt, mlp, experts, router = block.ckpt, block.mlp, block.experts, block.router
    s_gu = g.scheme.for_in_features(x.shape[-1])
    dtype = experts.gate_up_proj.dtype
    norm = block.layer.post_attention_layernorm
    norm_name = disk_name(ckpt, block.idx, f"{POST_ATTN_NORM}.weight")
    readers = _norm_readers(res, block)  # unquantized tensors that read the norm output: (module, on-disk name)
    norm_w = norm.weight.detach().float().clone()
    norm_dt = source_dtype(ckpt, norm_name)
    orig = [(m, name, m.weight.detach().float().clone(), source_dtype(ckpt, name)) for m, name in readers]

    def fold(s):
        """The stored norm for scale s, the effective (exact) scale and the stored readers."""
        nw = _stored(norm_w / s, norm_dt)
        s_eff = torch.where((nw != 0) & (norm_w != 0), norm_w / nw.where(nw != 0, torch.ones_like(nw)),
                            torch.ones_like(nw))
        return nw, s_eff, [_stored(w * s_eff, dt) for _, _, w, dt in orig]

    if fp_out is None:
        fp_out = _mlp_out(mlp, x, dtype)
    x_mean = x.abs().mean(0)
    w_mean = _rows_w_mean([gu] + [w for m, _, w, _ in orig if m is not router], s_gu.group_size)
    last = [None]  # the scale whose quantized gate/up the experts hold now (the finalists repeat some)
    chunks = _expert_chunks(gu.shape[0], gu[0].numel())
    direct = dtype == torch.float32 and experts.gate_up_proj.is_contiguous()
    scaled = None if direct else torch.empty((chunks[0].stop - chunks[0].start, *gu.shape[1:]), device=gu.device)

    def block_loss(s, xs, ref):
        _, s_eff, stored = fold(s)
        for (m, _, _, _), w in zip(orig, stored):
            m.weight.data.copy_(w.to(m.weight.dtype))
        if last[0] is None or not torch.equal(last[0], s_eff):
            for c in chunks:  # every expert's gate/up scaled and fake-quantized, a chunk at a time
                # a float32 layer's chunk is worked on where it lies (no copy back; same values)
                buf = experts.gate_up_proj.data[c] if direct else scaled[:c.stop - c.start]
                torch.mul(gu[c], s_eff, out=buf)
                q = fake_quant(buf, s_gu.num_bits, s_gu.group_size, s_gu.symmetric, out=buf)
                if not direct:
                    experts.gate_up_proj.data[c].copy_(q)
            last[0] = s_eff
        return (_mlp_out(mlp, xs / s_eff, dtype) - ref).square().mean()

    try:
        s1, a1 = yield from _norm_search_steps(x_mean, w_mean, block_loss, x, fp_out, g.options.n_grid, par,
                                               g.options.grid_stride)
    finally:
        experts.gate_up_proj.data.copy_(gu.to(dtype))  # gu is the float32 copy of these very values
        for m, _, w, _ in orig:
            m.weight.data.copy_(w.to(m.weight.dtype))
    nw, s_eff, stored = fold(s1)
    if bool((s_eff != 1).any()):
        norm.weight.data.copy_(nw.to(norm.weight.dtype))
        res.overrides[norm_name] = norm.weight.detach().cpu().clone()
        for (m, name, _, _), w in zip(orig, stored):
            m.weight.data.copy_(w.to(m.weight.dtype))
            res.overrides[name] = m.weight.detach().cpu().clone()
        for c in chunks:
            experts.gate_up_proj.data[c].copy_(gu[c] * s_eff)
    return s_eff, float(a1)


def _awq_expert_batches(stats: ExpertStats, x: torch.Tensor, low: torch.Tensor, fallback: str,
                        only: torch.Tensor | None = None):
    """(expert ids [e], tokens [e, t, H], token weights [e, t]) for the per-expert searches: the tokens
    routed to each expert, weighted by the router's weight for that expert (its share of the block output),
    0 on padding. Experts below the coverage threshold (`low`) get all sampled tokens with weight 1
    (fallback all_tokens) or nothing (fallback rtn: no search). `only` (bool [E]): just those experts."""
    _, sidx = stats.samples()
    wts = stats.routing_weights()
    most = search_block_experts(stats.P, stats.H)
    for ids, xe, mask, ws in routed_batches(x, sidx, stats.E, stats.H, weights=wts, only=only, max_experts=most):
        keep = ~low[ids.to(low.device)].to(ids.device)
        if keep.any():
            yield ids[keep], xe[keep], (ws * mask)[keep]
    fall = low if only is None else low & only.to(low.device)
    if fallback == "all_tokens" and fall.any():
        ids = fall.nonzero().flatten().to(x.device)
        per = min(most, max(1, PAIR_BUDGET // max(1, x.shape[0] * max(stats.P, stats.H) * 4)))
        for i in range(0, len(ids), per):
            sel = ids[i:i + per]
            yield sel, x.expand(len(sel), *x.shape), torch.ones(len(sel), x.shape[0], device=x.device)


def down_scale_loss(he: torch.Tensor, wt: torch.Tensor, dn: torch.Tensor, scheme):
    """The per-expert up -> down scale search's loss: s [e, I] -> [e], the router-weighted output error of
    each expert with its down_proj quantized in the scaled domain, sum_t wt_t^2 |he_t (Q(dn s)/s - dn)^T|^2 /
    sum_t wt_t^2, for down inputs he [e, t, I], token weights wt [e, t] (0 on padding) and dn [e, H, I].
    Computed as the quadratic form sum_n d_n G d_n^T with G = sum_t wt_t^2 he_t he_t^T [e, I, I], formed
    here once: a candidate then costs H x I x I per expert, whatever the number of tokens."""
    hw = he * wt[..., None]
    gram = torch.bmm(hw.transpose(1, 2), hw)  # [e, I, I]
    del hw
    norm_ = wt.square().sum(1).clamp(min=1e-12)

    def loss(s: torch.Tensor) -> torch.Tensor:
        d = fake_quant(dn * s[:, None, :], scheme.num_bits, scheme.group_size, scheme.symmetric) / s[:, None, :] - dn
        return (torch.bmm(d, gram) * d).sum((1, 2)) / norm_

    return loss


def search_owners(tokens: list[int], size: int) -> list[int]:
    """The rank that runs each expert's per-expert searches in a world of `size`: the busiest expert first,
    each to the least loaded rank, an expert's load being its sampled tokens plus the mean (the searches'
    work per candidate that does not depend on tokens). Ties: the lower expert, the lower rank."""
    owner = [0] * len(tokens)
    if size <= 1:
        return owner
    fixed = sum(tokens) / max(1, len(tokens))
    load = [0.0] * size
    for e in sorted(range(len(tokens)), key=lambda e: (-tokens[e], e)):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[e] = r
        load[r] += tokens[e] + fixed
    return owner


def _share_rows(par, owner: list[int], tensors: list[torch.Tensor]) -> None:
    """Rank r broadcasts the rows (experts) it owns of each tensor [E, ...] to every rank (in place)."""
    for r in range(par.size):
        rows = torch.tensor([e for e, o in enumerate(owner) if o == r], dtype=torch.long)
        if not len(rows):
            continue
        for t in tensors:
            buf = t[rows.to(t.device)].contiguous()
            par.broadcast_(buf, r)
            t[rows.to(t.device)] = buf


def _share_search_results(par, owner: list[int], tensors: list[torch.Tensor], labels: list[str]) -> None:
    """Every rank's per-expert search results on every rank: the rows each rank owns of each tensor (in place),
    and the labels through an object collective."""
    _share_rows(par, owner, tensors)
    everyone = par.world.all_gather(labels)
    for e, o in enumerate(owner):
        labels[e] = everyone[o][e]


def awq_steps(res: LayerResult, block: MoEBlock, g: WeightGroup, stats: ExpertStats,
              fp_out: torch.Tensor | None = None, par=None):
    """AWQ for a MoE block: (1) one scale s [H] shared by every routed expert's gate/up (and the shared
    expert's), searched on the MoE block output and folded into the post-attention norm (router and shared
    expert compensated, see `_awq_norm_scale`); (2) per-expert up->down scales folded into up_proj, searched
    on each expert's output on its routed tokens weighted by the router's weights; (3) clipping search per
    linear on the inputs it now sees, kept for an expert only where it lowers that expert's (weighted)
    output error; then RTN with the found clip ratios.

    Coverage (as for GPTQ, options min_tokens / fallback / stats): an expert with fewer sampled routed
    tokens than min_tokens searches (2) and (3) on all sampled tokens (fallback all_tokens) or skips them
    (fallback rtn: down scale 1, no clipping); the manifest records it. `fp_out`: the block's unquantized
    output on the sampled tokens when the statistics pass recorded it (else one more forward computes it).

    A generator, so that a distributed caller can keep the collectives out of its failure-propagating steps:
    each `next()` runs a step and, in a distributed pass, yields the function that exchanges its results
    between the ranks (a collective: every rank calls it); the last `next()` ends it (one process: the only
    `next()` runs every step, quantizing and emitting included). Distributed (`par`, calib/parallel.py; every
    rank holds the same samples and the same layer): the candidates of each round of (1) are split over the
    ranks and their losses exchanged (two more yields), the per-expert searches (2) and (3) are split too (`search_owners`), and each rank quantizes and
    emits the experts it searched, then sends their quantized weights to every rank (the last yield; the
    caller broadcasts the rest of the layer from rank 0). Every candidate, every expert's search and its
    quantization sees the same operands whatever the world size."""
    experts = block.experts
    x, sidx = stats.samples()  # [T, H]: the MoE block's input (the post-attention norm output)
    # the weights before AWQ, in the layer's dtype (float32 copies would be exact but twice a bfloat16 layer)
    original = {"gu": experts.gate_up_proj.detach().clone(), "down": experts.down_proj.detach().clone()}

    # (1) norm -> gate/up
    leader = par is None or not par.distributed or par.leader
    found = _Found(g, stats, experts.act_fn, x.device)
    found.s1, found.a1 = yield from _awq_norm_scale(res if leader else LayerResult(), block, g, x, original["gu"],
                                                    fp_out, par)
    gu = experts.gate_up_proj.detach()  # = original * s1, [E, P, H]; float32 per searched batch of experts
    x_scaled = x / found.s1  # what the experts now see
    low, fallback, sampled = found.coverage(x, sidx)

    # (2) per-expert up -> down scale and (3) clipping
    owner = search_owners(sampled.tolist(), par.size if par is not None and par.distributed else 1)
    mine = None
    if par is not None and par.distributed:
        mine = torch.tensor([o == par.rank for o in owner], dtype=torch.bool)
    for ids, xe, wt in _awq_expert_batches(stats, x_scaled, low.to(x.device), fallback, only=mine):
        found.search(ids, xe, wt, gu, original["down"])
    if mine is not None:
        yield lambda: _share_search_results(par, owner, [found.s2, found.a2, found.clip_gu, found.clip_dn],
                                            found.clipped)
    # (4) quantize and emit: each rank the experts whose searches it ran (one process: every expert), then every
    # rank gets the others' quantized weights (the last exchange)
    _quantize_experts(res, block, stats, found, original, mine)
    if mine is not None:
        yield lambda: _share_rows(par, owner, [experts.gate_up_proj.data, experts.down_proj.data])


class _Found:
    """What AWQ finds for a layer's routed experts (awq_steps): the norm scale s1 [H] and its alpha a1, each
    expert's up -> down scale s2 [E, I] and its alpha a2 [E], the clip ratios of its gate/up and down (1: none)
    and which of them it kept, and why an expert fell back (`reasons`)."""

    def __init__(self, g: WeightGroup, stats: ExpertStats, act_fn, dev: torch.device):
        E, P, H, I = stats.E, stats.P, stats.H, stats.I
        self.g, self.stats, self.act_fn, self.dev = g, stats, act_fn, dev
        self.s_gu, self.s_dn = g.scheme.for_in_features(H), g.scheme.for_in_features(I)
        self.s1 = self.a1 = None
        self.s2 = torch.ones(E, I, device=dev)
        self.a2 = torch.full((E,), -1.0, device=dev)
        self.clip_gu = torch.ones(E, P, H // (self.s_gu.group_size or H), device=dev)
        self.clip_dn = torch.ones(E, H, I // (self.s_dn.group_size or I), device=dev)
        self.clipped = [""] * E
        self.reasons: list[str | None] = [None] * E

    def coverage(self, x: torch.Tensor, sidx: torch.Tensor):
        """(low [E] bool, fallback, sampled tokens per expert [E]): the experts below the coverage threshold,
        counted on the sampled tokens x [T, H] (routed to sidx [T, k]) the searches use; `reasons` set."""
        g, E = self.g, self.stats.E
        low, min_tokens, fallback, mode = coverage(g.options, self.stats)
        sampled = torch.bincount(sidx.flatten(), minlength=E + 1)[:E].cpu()
        if g.options.min_tokens is None:
            min_tokens = max(1, math.ceil(0.005 * x.shape[0]))
        if mode == "routed":
            low = sampled < min_tokens
        for e in low.nonzero().flatten().tolist():
            if mode == "all":
                self.reasons[e] = "stats: all tokens"
            else:
                self.reasons[e] = (f"{int(sampled[e])} routed tokens < min_tokens {min_tokens}: "
                                   + ("down scale 1, no clipping" if fallback == "rtn" else "searched on all tokens"))
        return low, fallback, sampled

    def search(self, ids: torch.Tensor, xe: torch.Tensor, wt: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor):
        """(2) and (3) for experts `ids` on their tokens xe [e, t, H] (scaled by s1) with token weights wt [e, t]
        (0 on padding): gu [E, P, H] the scaled gate/up, dn [E, H, I] the down weights."""
        o, s_dn, dev = self.g.options, self.s_dn, self.dev
        gu_e, dn_e = gu[ids].float(), dn[ids].float()  # [e, P, H], [e, H, I]
        g_, u_ = torch.bmm(xe, gu_e.transpose(1, 2)).chunk(2, dim=-1)
        he = self.act_fn(g_) * u_  # [e, t, I]: down_proj inputs
        del g_, u_
        real = (wt > 0).float()
        cnt = real.sum(1).clamp(min=1)
        if o.scale_down:
            expert_loss = down_scale_loss(he, wt, dn_e, s_dn)
            h_mean = torch.bmm(real[:, None, :], he.abs())[:, 0] / cnt[:, None]  # mean |he| over real tokens
            best, a_best, _ = search_scales(h_mean, _group_w_mean(dn_e, s_dn.group_size), expert_loss, o.n_grid,
                                            stride=o.grid_stride)
            del expert_loss
        else:
            best, a_best = torch.ones(len(ids), self.stats.I, device=dev), torch.full((len(ids),), -1.0, device=dev)
        self.s2[ids], self.a2[ids] = best, a_best.float()
        if o.clip:
            self._clip(ids, xe, wt, he, gu_e, dn_e, best)

    def _clip(self, ids, xe, wt, he, gu_e, dn_e, best) -> None:
        """(3): each linear's clip ratios searched on the inputs it now sees (token-weighted), each kept only
        where it lowers the expert's output error with everything quantized."""
        s_gu, s_dn, dev = self.s_gu, self.s_dn, self.dev
        half = gu_e.shape[1] // 2
        w2 = wt.square()  # [e, t]: each token's share of the block output error
        # the matrices as they will be quantized: up rows / s2, down columns * s2
        gu_s = torch.cat([gu_e[:, :half], gu_e[:, half:] / best[:, :, None]], 1)
        dn_s = dn_e * best[:, None, :]
        wx = xe * wt[..., None]  # token-weighted inputs: the per-linear errors count like the block output's
        r_gu = search_clip(gu_s, wx, s_gu.num_bits, s_gu.group_size, s_gu.symmetric)
        del wx
        r_dn = search_clip(dn_s, (he / best[:, None, :]) * wt[..., None], s_dn.num_bits, s_dn.group_size,
                           s_dn.symmetric)
        # keep each clip only where it lowers the expert's output error (with everything quantized), compared
        # on at most CLIP_CHOICE_TOKENS of each expert's rows (strided; padding rows weigh 0)
        if xe.shape[1] > CLIP_CHOICE_TOKENS:
            rows_c = torch.linspace(0, xe.shape[1] - 1, CLIP_CHOICE_TOKENS, device=dev).round().long()
            xe, he, w2 = xe[:, rows_c], he[:, rows_c], w2[:, rows_c]
        ref = torch.bmm(he, dn_e.transpose(1, 2))  # [e, t, H]: the expert's unquantized output
        q_dn = {c: fake_quant(dn_s, s_dn.num_bits, s_dn.group_size, s_dn.symmetric, r)
                for c, r in ((False, None), (True, r_dn))}
        best_err, choice = None, None
        for cg in (False, True):
            q_gu = fake_quant(gu_s, s_gu.num_bits, s_gu.group_size, s_gu.symmetric, r_gu if cg else None)
            g_, u_ = torch.bmm(xe, q_gu.transpose(1, 2)).chunk(2, dim=-1)
            hq = self.act_fn(g_) * u_  # the down inputs with gate/up quantized (clipped or not)
            del g_, u_, q_gu
            for cd in (False, True):
                d = torch.baddbmm(ref, hq, q_dn[cd].transpose(1, 2), beta=-1)  # [e, t, H]: output error
                err = (d.square_().sum(-1) * w2).sum(1)
                del d
                if best_err is None:
                    best_err, choice = err, torch.zeros(len(ids), 2, dtype=torch.bool, device=dev)
                    continue
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                choice[better] = torch.tensor([cg, cd], device=dev)
        choice = choice.cpu()
        for r, e in enumerate(ids.tolist()):
            if choice[r, 0]:
                self.clip_gu[e] = r_gu[r]
            if choice[r, 1]:
                self.clip_dn[e] = r_dn[r]
            self.clipped[e] = {(False, False): "none", (True, False): "gate_up", (False, True): "down",
                               (True, True): "gate_up+down"}[(bool(choice[r, 0]), bool(choice[r, 1]))]


def _quantize_experts(res: LayerResult, block: MoEBlock, stats: ExpertStats, found: _Found, original: dict,
                      mine: torch.Tensor | None) -> None:
    """(4) RTN of the experts `mine` (None: every one) with the found scales and clip ratios, emitted and written
    back into the layer. Every step is per expert: the same bytes whatever the chunks (the SQNR on the CPU one
    expert at a time, as GPTQ's)."""
    experts, names = block.experts, block.names
    E, P = stats.E, stats.P
    half, dev, s2 = P // 2, found.dev, found.s2
    # to report SQNR against the original weights: effective weight = stored / (what was folded into it)
    unfold = {"gu": torch.cat([torch.ones(E, half, 1, device=dev), s2[:, :, None]], 1) / found.s1,
              "down": 1.0 / s2[:, None, :]}
    src_dtype = source_dtype(block.ckpt, names.module(0, "gate") + ".weight")
    a2 = found.a2.tolist()
    gu, dn = experts.gate_up_proj.detach(), original["down"]
    todo = [e for e in range(E) if mine is None or bool(mine[e])]
    for key, s, clip, param in (("gu", found.s_gu, found.clip_gu, experts.gate_up_proj),
                                ("down", found.s_dn, found.clip_dn, experts.down_proj)):
        parts = (("gate", slice(0, half)), ("up", slice(half, P))) if key == "gu" else (("down", slice(None)),)
        for c in _expert_chunks(len(todo), param[0].numel()):  # a chunk of this rank's experts at a time
            ids = todo[c]
            c = torch.tensor(ids, device=dev) if mine is not None else slice(ids[0], ids[-1] + 1)
            if key == "gu":
                w = gu[c].to(torch.float32, copy=True)
                w[:, half:, :] /= s2[c, :, None]  # up rows / s
            else:
                w = dn[c].float() * s2[c, None, :]  # down columns * s
            qp = choose_qparams_clipped(w, s.num_bits, s.group_size, s.symmetric, clip[c], scale_dtype(src_dtype))
            q = quantize(w, qp, s.num_bits)
            del w
            deq = dequantize(q, qp.scale, qp.zero_point)
            eff = {kind: deq[:, rows] * unfold[key][c, rows if key == "gu" else slice(None)] for kind, rows in parts}
            sq = ({kind: sqnr_db(original[key][c, rows], eff[kind], dim=(-2, -1)).tolist() for kind, rows in parts}
                  if dev.type != "cpu" else  # one transfer per chunk on a GPU, not one per expert
                  {kind: [float(sqnr_db(original[key][e, rows], eff[kind][j])) for j, e in enumerate(ids)]
                   for kind, rows in parts})
            del eff
            qh, sh = q.cpu(), qp.scale.cpu()  # emitted from the host (no-ops on the CPU)
            zh = None if qp.zero_point is None else qp.zero_point.cpu()
            for j, e in enumerate(ids):
                meta = {"method": "awq", "tokens": int(stats.counts[e]), "fallback": found.reasons[e],
                        "awq_alpha": round(found.a1, 3), "awq_down_alpha": round(float(a2[e]), 3),
                        "awq_clip": found.clipped[e] or "none"}
                for kind, rows in parts:
                    zp = None if zh is None else zh[j, rows]
                    emit(res, names.module(e, kind), qh[j, rows], QParams(sh[j, rows], zp), s, src_dtype,
                         {**meta, "sqnr_db": round(sq[kind][j], 4),
                          "sqnr_domain": "original weights (AWQ scales unfolded)"})
            param.data[c] = deq.to(param.dtype)
            del q, deq
