"""AWQ for the routed experts of one decoder layer (quant/awq.py does the searches): a scale shared by every
expert's gate/up folded into the post-attention norm (router and shared expert compensated), per-expert
up -> down scales, clipping; then RTN with the found parameters, written back into the layer."""

from __future__ import annotations

import math

import torch

from ..errors import CalibrationError
from ..match.recipe import WeightGroup
from ..quant.awq import choose_qparams_clipped, fake_quant, search_clip, search_scales
from ..quant.int4 import QParams, dequantize, quantize, sqnr_db
from ..pack.layout import scale_dtype
from .emit import LayerResult, emit, source_dtype
from .hessians import PAIR_BUDGET, ExpertStats, coverage, routed_batches
from .names import disk_name

AWQ_TOKEN_CHUNK = 8192  # tokens per MoE forward inside the norm-scale search (bounds its temporaries)


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


def _awq_norm_scale(res, ckpt, idx, mlp, experts, router, shared, layer, g: WeightGroup, x: torch.Tensor,
                    n_grid: int):
    """(1) One per-channel scale s [H] for every routed expert's gate/up (and the shared expert's): the
    post-attention norm weight becomes norm / s, every reader of the norm output (experts, router, shared
    expert) is multiplied by s. The search loss is the MoE block output error against the unquantized block,
    with the routed experts' gate/up quantized in the scaled domain *and* the norm, router and shared
    expert exactly as they will be stored (rounded to their source dtype): a scale whose fold would perturb
    the router more than it helps the experts loses. s = 1 (plain RTN) is a candidate.

    Applies the chosen fold to the layer in place, records the changed source tensors as overrides and
    returns (effective scale s [H] (float32, exact for the stored norm), alpha)."""
    s_gu = g.scheme.for_in_features(x.shape[-1])
    dtype = experts.gate_up_proj.dtype
    norm = layer.post_attention_layernorm
    norm_name = disk_name(ckpt, idx, "post_attention_layernorm.weight")
    readers = []  # unquantized tensors that read the norm output: (module, on-disk name)
    if router is not None:
        readers.append((router, disk_name(ckpt, idx, "mlp.gate.weight")))
    if shared is not None:
        sname = "shared_experts" if hasattr(mlp, "shared_experts") else "shared_expert"
        for nm in ("gate_proj", "up_proj"):
            readers.append((getattr(shared, nm), disk_name(ckpt, idx, f"mlp.{sname}.{nm}.weight")))
    for _, name in readers:
        if name[: -len(".weight")] in res.modules:
            raise CalibrationError(f"{name[: -len('.weight')]}: quantized by a calibrated group, but it reads the "
                                   "post-attention norm that AWQ scales",
                                   hint="quantize it with method rtn, or leave it unquantized")
    norm_w = norm.weight.detach().float().clone()
    norm_dt = source_dtype(ckpt, norm_name)
    orig = [(m, name, m.weight.detach().float().clone(), source_dtype(ckpt, name)) for m, name in readers]
    gu = experts.gate_up_proj.detach().float().clone()  # [E, P, H]
    gu_orig = experts.gate_up_proj.data.clone()

    def fold(s):
        """The stored norm for scale s, the effective (exact) scale and the stored readers."""
        nw = _stored(norm_w / s, norm_dt)
        s_eff = torch.where((nw != 0) & (norm_w != 0), norm_w / nw.where(nw != 0, torch.ones_like(nw)),
                            torch.ones_like(nw))
        return nw, s_eff, [_stored(w * s_eff, dt) for _, _, w, dt in orig]

    fp_out = _mlp_out(mlp, x, dtype)
    x_mean = x.abs().mean(0)
    rows = [gu.reshape(-1, gu.shape[-1])] + [w for m, _, w, _ in orig if m is not router]
    w_mean = _group_w_mean(torch.cat(rows), s_gu.group_size)

    def block_loss(s):
        _, s_eff, stored = fold(s)
        for (m, _, _, _), w in zip(orig, stored):
            m.weight.data.copy_(w.to(m.weight.dtype))
        experts.gate_up_proj.data.copy_(fake_quant(gu * s_eff, s_gu.num_bits, s_gu.group_size, s_gu.symmetric)
                                        .to(dtype))
        return (_mlp_out(mlp, x / s_eff, dtype) - fp_out).square().mean()

    try:
        s1, a1, _ = search_scales(x_mean, w_mean, block_loss, n_grid)
    finally:
        experts.gate_up_proj.data.copy_(gu_orig)
        for m, _, w, _ in orig:
            m.weight.data.copy_(w.to(m.weight.dtype))
    nw, s_eff, stored = fold(s1)
    if bool((s_eff != 1).any()):
        norm.weight.data.copy_(nw.to(norm.weight.dtype))
        res.overrides[norm_name] = norm.weight.detach().clone()
        for (m, name, _, _), w in zip(orig, stored):
            m.weight.data.copy_(w.to(m.weight.dtype))
            res.overrides[name] = m.weight.detach().clone()
        experts.gate_up_proj.data.copy_((gu * s_eff).to(dtype))
    return s_eff, float(a1)


def _awq_expert_batches(stats: ExpertStats, x: torch.Tensor, low: torch.Tensor, fallback: str):
    """(expert ids [e], tokens [e, t, H], token weights [e, t]) for the per-expert searches: the tokens
    routed to each expert, weighted by the router's weight for that expert (its share of the block output),
    0 on padding. Experts below the coverage threshold (`low`) get all sampled tokens with weight 1
    (fallback all_tokens) or nothing (fallback rtn: no search)."""
    _, sidx = stats.samples()
    wts = stats.routing_weights()
    for ids, xe, mask, ws in routed_batches(x, sidx, stats.E, stats.H, weights=wts):
        keep = ~low[ids]
        if keep.any():
            yield ids[keep], xe[keep], (ws * mask)[keep]
    if fallback == "all_tokens" and low.any():
        ids = low.nonzero().flatten()
        per = max(1, PAIR_BUDGET // max(1, x.shape[0] * max(stats.P, stats.H) * 4))
        for i in range(0, len(ids), per):
            sel = ids[i:i + per]
            yield sel, x.expand(len(sel), *x.shape), torch.ones(len(sel), x.shape[0])


def _expert_out(xe, gu, dn, act_fn):
    """act(gate x) * (up x) -> down, batched: xe [e, t, H], gu [e, P, H], dn [e, H, I] -> [e, t, H]."""
    g_, u_ = torch.bmm(xe, gu.transpose(1, 2)).chunk(2, dim=-1)
    return torch.bmm(act_fn(g_) * u_, dn.transpose(1, 2))


def awq_experts(res: LayerResult, ckpt, idx, names, mlp, experts, router, shared, layer, g: WeightGroup,
                 stats: ExpertStats):
    """AWQ for a MoE block: (1) one scale s [H] shared by every routed expert's gate/up (and the shared
    expert's), searched on the MoE block output and folded into the post-attention norm (router and shared
    expert compensated, see `_awq_norm_scale`); (2) per-expert up->down scales folded into up_proj, searched
    on each expert's output on its routed tokens weighted by the router's weights; (3) clipping search per
    linear on the inputs it now sees, kept for an expert only where it lowers that expert's (weighted)
    output error; then RTN with the found clip ratios.

    Coverage (as for GPTQ, options min_tokens / fallback / stats): an expert with fewer sampled routed
    tokens than min_tokens searches (2) and (3) on all sampled tokens (fallback all_tokens) or skips them
    (fallback rtn: down scale 1, no clipping); the manifest records it."""
    n_grid = g.options.n_grid
    do_clip = g.options.clip
    do_down = g.options.scale_down
    E, P, H, I = stats.E, stats.P, stats.H, stats.I
    half = P // 2
    s_gu = g.scheme.for_in_features(H)
    s_dn = g.scheme.for_in_features(I)
    x, sidx = stats.samples()  # [T, H]: the MoE block's input (the post-attention norm output)
    original = {"gu": experts.gate_up_proj.detach().float().clone(), "down": experts.down_proj.detach().float().clone()}

    # (1) norm -> gate/up
    s1, a1 = _awq_norm_scale(res, ckpt, idx, mlp, experts, router, shared, layer, g, x, n_grid)
    gu = experts.gate_up_proj.detach().float().clone()  # = original * s1, [E, P, H]
    dn = original["down"].clone()  # [E, H, I]
    x_scaled = x / s1  # what the experts now see

    # coverage: counted on the sampled tokens the searches use
    low, min_tokens, fallback, mode = coverage(g.options, stats)
    sampled = torch.bincount(sidx.flatten(), minlength=E)[:E]
    if g.options.min_tokens is None:
        min_tokens = max(1, math.ceil(0.005 * x.shape[0]))
    if mode == "routed":
        low = sampled < min_tokens
    reasons: list[str | None] = [None] * E
    for e in low.nonzero().flatten().tolist():
        if mode == "all":
            reasons[e] = "stats: all tokens"
        else:
            reasons[e] = (f"{int(sampled[e])} routed tokens < min_tokens {min_tokens}: "
                          + ("down scale 1, no clipping" if fallback == "rtn" else "searched on all tokens"))

    # (2) per-expert up -> down scale and (3) clipping
    s2 = torch.ones(E, I)
    a2 = torch.full((E,), -1.0)
    clip_gu = torch.ones(E, P, H // (s_gu.group_size or H))
    clip_dn = torch.ones(E, H, I // (s_dn.group_size or I))
    clipped = [""] * E
    for ids, xe, wt in _awq_expert_batches(stats, x_scaled, low, fallback):
        gu_e, dn_e = gu[ids], dn[ids]  # [e, P, H], [e, H, I]
        g_, u_ = torch.bmm(xe, gu_e.transpose(1, 2)).chunk(2, dim=-1)
        he = experts.act_fn(g_) * u_  # [e, t, I]: down_proj inputs
        ref = torch.bmm(he, dn_e.transpose(1, 2))  # [e, t, H]
        w2 = wt.square()[..., None]  # each token's share of the block output error
        norm_ = wt.square().sum(1).clamp(min=1e-12)
        real = (wt > 0).float()
        cnt = real.sum(1).clamp(min=1)

        def expert_loss(s, he=he, dn_e=dn_e, ref=ref, w2=w2, norm_=norm_):
            dq = fake_quant(dn_e * s[:, None, :], s_dn.num_bits, s_dn.group_size, s_dn.symmetric) / s[:, None, :]
            return ((torch.bmm(he, dq.transpose(1, 2)) - ref).square() * w2).sum((1, 2)) / norm_

        if do_down:
            h_mean = (he.abs() * real[..., None]).sum(1) / cnt[:, None]
            best, a_best, _ = search_scales(h_mean, _group_w_mean(dn_e, s_dn.group_size), expert_loss, n_grid)
        else:
            best, a_best = torch.ones(len(ids), I), torch.full((len(ids),), -1.0)
        s2[ids], a2[ids] = best, a_best.float()
        if not do_clip:
            continue
        # the matrices as they will be quantized: up rows / s2, down columns * s2
        gu_s = torch.cat([gu_e[:, :half], gu_e[:, half:] / best[:, :, None]], 1)
        dn_s = dn_e * best[:, None, :]
        wx = xe * wt[..., None]  # token-weighted inputs: the per-linear errors count like the block output's
        r_gu = search_clip(gu_s, wx, s_gu.num_bits, s_gu.group_size, s_gu.symmetric)
        r_dn = search_clip(dn_s, (he / best[:, None, :]) * wt[..., None], s_dn.num_bits, s_dn.group_size,
                           s_dn.symmetric)
        # keep each clip only where it lowers the expert's output error (with everything quantized)
        q_gu = {c: fake_quant(gu_s, s_gu.num_bits, s_gu.group_size, s_gu.symmetric, r)
                for c, r in ((False, None), (True, r_gu))}
        q_dn = {c: fake_quant(dn_s, s_dn.num_bits, s_dn.group_size, s_dn.symmetric, r)
                for c, r in ((False, None), (True, r_dn))}
        best_err, choice = None, None
        for cg in (False, True):
            for cd in (False, True):
                err = ((_expert_out(xe, q_gu[cg], q_dn[cd], experts.act_fn) - ref).square() * w2).sum((1, 2))
                if best_err is None:
                    best_err, choice = err, torch.zeros(len(ids), 2, dtype=torch.bool)
                    continue
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                choice[better] = torch.tensor([cg, cd])
        for r, e in enumerate(ids.tolist()):
            if choice[r, 0]:
                clip_gu[e] = r_gu[r]
            if choice[r, 1]:
                clip_dn[e] = r_dn[r]
            clipped[e] = {(False, False): "none", (True, False): "gate_up", (False, True): "down",
                          (True, True): "gate_up+down"}[(bool(choice[r, 0]), bool(choice[r, 1]))]
    gu[:, half:, :] /= s2[:, :, None]  # up rows / s
    dn = dn * s2[:, None, :]  # down columns * s
    # to report SQNR against the original weights: effective weight = stored / (what was folded into it)
    unfold = {"gu": torch.cat([torch.ones(E, half, 1), s2[:, :, None]], 1) / s1, "down": 1.0 / s2[:, None, :]}

    src_dtype = source_dtype(ckpt, names.module(0, "gate") + ".weight")
    for key, w, s, clip, param in (("gu", gu, s_gu, clip_gu, experts.gate_up_proj),
                                   ("down", dn, s_dn, clip_dn, experts.down_proj)):
        qp = choose_qparams_clipped(w, s.num_bits, s.group_size, s.symmetric, clip, scale_dtype(src_dtype))
        q = quantize(w, qp, s.num_bits)
        deq = dequantize(q, qp.scale, qp.zero_point)
        parts = (("gate", slice(0, half)), ("up", slice(half, P))) if key == "gu" else (("down", slice(None)),)
        for e in range(E):
            meta = {"method": "awq", "tokens": int(stats.counts[e]), "fallback": reasons[e],
                    "awq_alpha": round(a1, 3), "awq_down_alpha": round(float(a2[e]), 3),
                    "awq_clip": clipped[e] or "none"}
            for kind, rows in parts:
                zp = None if qp.zero_point is None else qp.zero_point[e, rows]
                eff = deq[e, rows] * unfold[key][e][rows if key == "gu" else slice(None)]  # [N, K]
                emit(res, names.module(e, kind), q[e, rows], QParams(qp.scale[e, rows], zp), s, src_dtype,
                      {**meta, "sqnr_db": round(float(sqnr_db(original[key][e, rows], eff)), 4),
                       "sqnr_domain": "original weights (AWQ scales unfolded)"})
        param.data.copy_(deq.to(param.dtype))
