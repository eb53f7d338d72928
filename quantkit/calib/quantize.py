"""Calibrated weight quantization (GPTQ, AWQ), streamed layer by layer on the LayerExecutor.

For each decoder layer: collect statistics in one forward pass over the calibration tokens (per-expert
Hessians from the tokens the router sends to each expert, batched over experts; AWQ activation samples),
quantize, write the dequantized weights back into the layer and run it again, so that layer L+1
calibrates on the output of the *quantized* layer L (true-sequential). Peak memory: one layer's weights,
its Hessians and the calibration activations.

Results go to a spool directory, one safetensors file + one JSON file per layer:
- packed tensors under their final output names (`<module>.weight_packed`, `.weight_scale`, ...),
- overrides: source tensors whose values changed (AWQ folds its scales into the post-attention norm, the
  router and the shared experts), stored in the source dtype under the source name,
- per-module metadata (method, tokens seen, fallback and why, damping, SQNR).
`convert` then streams the checkpoint as usual, taking these tensors instead of recomputing them.

Expert coverage (recipe group options): an expert that received fewer than `min_tokens` routed tokens
(default: 0.5% of the layer's tokens, at least 1) falls back to a Hessian from all of the layer's tokens
(`fallback: all_tokens`, default) or to RTN (`fallback: rtn`); `stats: all` uses all tokens for every
expert. Every expert ends quantized, and the manifest says which fell back and why.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..io.checkpoint import Checkpoint
from ..io.safetensors import write_safetensors
from ..quant.awq import choose_qparams_clipped, fake_quant, search_clip, search_scales
from ..quant.gptq import gptq
from ..quant.int4 import QParams, dequantize, pack_int4, quantize, rtn, sqnr_db
from ..recipe import Recipe, Scheme, WeightGroup
from . import CalibrationError

# Legend: E = experts, T = tokens, H = hidden, I = expert intermediate, P = 2*I (gate+up rows)
PAIR_BUDGET = 1 << 26  # bytes of padded [E, T, *] activations processed at once when batching over experts


# ---- naming: in-memory layer modules <-> on-disk tensor names ----------------------------------------
@dataclass(frozen=True)
class ExpertNames:
    """Disk module names of expert e's projections, e.g. model.layers.3.mlp.experts.{e}.gate_proj."""

    prefix: str  # model.layers.L.mlp.experts (or block_sparse_moe.experts)
    gate: str
    up: str
    down: str

    def module(self, e: int, kind: str) -> str:
        return f"{self.prefix}.{e}.{getattr(self, kind)}"


def expert_names(ckpt: Checkpoint, layer_idx: int) -> ExpertNames | None:
    base = f"model.layers.{layer_idx}"
    if f"{base}.block_sparse_moe.experts.0.w1.weight" in ckpt.location:
        return ExpertNames(f"{base}.block_sparse_moe.experts", "w1", "w3", "w2")
    if (f"{base}.mlp.experts.0.gate_proj.weight" in ckpt.location
            or f"{base}.mlp.experts.gate_up_proj" in ckpt.location):
        return ExpertNames(f"{base}.mlp.experts", "gate_proj", "up_proj", "down_proj")
    return None


def disk_name(ckpt: Checkpoint, layer_idx: int, rel: str) -> str:
    """On-disk name of an in-memory layer tensor (`mlp.gate.weight` -> Mixtral's `block_sparse_moe.gate.weight`)."""
    for cand in (rel, rel.replace("mlp.", "block_sparse_moe.", 1)):
        name = f"model.layers.{layer_idx}.{cand}"
        if name in ckpt.location:
            return name
    raise CalibrationError(f"layer {layer_idx}: no on-disk tensor for {rel}")


# ---- results ----------------------------------------------------------------------------------------
@dataclass
class LayerResult:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # final output tensors (packed)
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)  # replaced source tensors
    modules: dict[str, dict] = field(default_factory=dict)  # module -> manifest metadata


def _scale_dtype(ckpt: Checkpoint, name: str) -> torch.dtype:
    dt = ckpt.info(name).dtype if name in ckpt.location else torch.bfloat16
    return dt if dt in (torch.bfloat16, torch.float16) else torch.bfloat16


def _emit(res: LayerResult, module: str, q: torch.Tensor, qp: QParams, scheme: Scheme, scale_dtype, meta: dict):
    """Record one quantized module's output tensors (pack-quantized layout, as convert writes them)."""
    n, k = q.shape
    res.tensors[f"{module}.weight_packed"] = pack_int4(q)
    res.tensors[f"{module}.weight_scale"] = qp.scale.to(scale_dtype)
    res.tensors[f"{module}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
    if qp.zero_point is not None:
        res.tensors[f"{module}.weight_zero_point"] = pack_int4(qp.zero_point.transpose(0, 1)).transpose(0, 1).contiguous()
    res.modules[module] = {"scheme": scheme.label, **meta}


# ---- statistics collection --------------------------------------------------------------------------
class ExpertStats:
    """Hooks `experts.forward(hidden [T, H], top_k_index [T, k], top_k_weights)` and accumulates, per expert,
    the routed-token Hessians of gate/up inputs and of down inputs, token counts, and (for AWQ / fallbacks)
    bounded token samples."""

    def __init__(self, experts: nn.Module, need_hessians: bool, sample_tokens: int):
        self.experts = experts
        e, p, h = experts.gate_up_proj.shape
        self.E, self.P, self.H, self.I = e, p, h, experts.down_proj.shape[-1]
        self.need_h = need_hessians
        self.counts = torch.zeros(e, dtype=torch.long)
        self.h_gu = torch.zeros(e, h, h) if need_hessians else None  # sums of x x^T (scaled at the end)
        self.h_down = torch.zeros(e, self.I, self.I) if need_hessians else None
        self.h_all = torch.zeros(h, h)
        self.total = 0
        self.sample_tokens = sample_tokens
        self.x_samples: list[torch.Tensor] = []  # [t, H] all tokens (subsampled) for AWQ / fallbacks
        self.idx_samples: list[torch.Tensor] = []
        self._n_samples = 0
        self.handle = experts.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        x, idx = args[0].detach().float(), args[1].detach()
        x = x.reshape(-1, self.H)
        idx = idx.reshape(x.shape[0], -1)
        self.total += x.shape[0]
        self.h_all += x.T @ x
        if self._n_samples < self.sample_tokens:
            take = min(self.sample_tokens - self._n_samples, x.shape[0])
            self.x_samples.append(x[:take].clone())
            self.idx_samples.append(idx[:take].clone())
            self._n_samples += take
        self.counts += torch.bincount(idx.flatten(), minlength=self.E)[: self.E]
        if self.need_h:
            for experts_ids, xs, mask in routed_batches(x, idx, self.E, self.H):
                xm = xs * mask[..., None]
                self.h_gu[experts_ids] += torch.bmm(xm.transpose(1, 2), xm)
                hd = self.down_inputs(experts_ids, xs) * mask[..., None]
                self.h_down[experts_ids] += torch.bmm(hd.transpose(1, 2), hd)

    def down_inputs(self, experts_ids: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """act(gate x) * up x for experts [e] and padded tokens xs [e, t, H] -> [e, t, I]."""
        gu = torch.bmm(xs, self.experts.gate_up_proj[experts_ids].float().transpose(1, 2))  # [e, t, P]
        g, u = gu.chunk(2, dim=-1)
        return self.experts.act_fn(g) * u

    def remove(self):
        self.handle.remove()

    def samples(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.x_samples), torch.cat(self.idx_samples)


def routed_batches(x: torch.Tensor, idx: torch.Tensor, num_experts: int, width: int, budget: int = PAIR_BUDGET):
    """Yield (expert ids [e], padded tokens [e, t, D], mask [e, t]) over chunks of experts: the tokens routed
    to each expert, gathered and zero-padded to the chunk's longest list, so that per-expert products are
    one batched matmul."""
    t, k = idx.shape
    flat = idx.flatten()
    token = torch.arange(t).repeat_interleave(k)
    order = torch.argsort(flat, stable=True)
    flat, token = flat[order], token[order]
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    starts = torch.cumsum(counts, 0) - counts
    present = counts.nonzero().flatten()
    i = 0
    while i < present.numel():
        # grow the chunk while the padded block stays within the budget
        j = i + 1
        longest = int(counts[present[i]])
        while j < present.numel():
            nl = max(longest, int(counts[present[j]]))
            if (j - i + 1) * nl * width * 4 > budget:
                break
            longest, j = nl, j + 1
        ids = present[i:j]
        xs = torch.zeros(len(ids), longest, width)
        mask = torch.zeros(len(ids), longest)
        for r, e in enumerate(ids.tolist()):
            c, s = int(counts[e]), int(starts[e])
            xs[r, :c] = x[token[s:s + c]]
            mask[r, :c] = 1
        yield ids, xs, mask
        i = j


class LinearStats:
    """Hessian of one nn.Linear's inputs (dense targets: attention, dense MLP, shared experts)."""

    def __init__(self, module: nn.Linear):
        self.h = torch.zeros(module.in_features, module.in_features)
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        x = args[0].detach().float().reshape(-1, self.h.shape[0])
        self.h += x.T @ x
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        return self.h * (2.0 / max(self.count, 1))

    def remove(self):
        self.handle.remove()


# ---- the layer procedure ----------------------------------------------------------------------------
def _find_moe(layer: nn.Module):
    mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
    experts = getattr(mlp, "experts", None) if mlp is not None else None
    if experts is None or not hasattr(experts, "gate_up_proj"):
        return None
    shared = getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert", None)
    return mlp, experts, getattr(mlp, "gate", None), shared


def _opt(group: WeightGroup, key: str, default):
    return group.option(key, default)


def quantize_layer(ckpt: Checkpoint, recipe: Recipe, step, log: Callable[[str], None] = lambda m: None) -> LayerResult:
    """Calibrate and quantize decoder layer `step.index` in place (weights replaced by their dequantized
    values); returns what convert must write. The caller forwards the step afterwards (true-sequential)."""
    idx, layer = step.index, step.layer
    res = LayerResult()
    names = expert_names(ckpt, idx)
    moe = _find_moe(layer)
    egroup = None
    if moe is not None and names is not None:
        egroup = recipe.match(names.module(0, "gate"))
        if egroup is not None and egroup.method == "rtn":
            egroup = None  # RTN needs no calibration: convert does it while streaming
    dense: dict[str, tuple[nn.Linear, WeightGroup]] = {}
    for rel, mod in layer.named_modules():
        if isinstance(mod, nn.Linear):
            try:
                disk = disk_name(ckpt, idx, rel + ".weight")[: -len(".weight")]
            except CalibrationError:
                continue
            g = recipe.match(disk)
            if g is not None and g.method != "rtn":
                if g.method == "awq":
                    raise CalibrationError(f"{disk}: AWQ is implemented for routed experts only",
                                           hint="use method gptq or rtn for non-expert modules")
                dense[disk] = (mod, g)
    if egroup is None and not dense:
        return res

    mlp = experts = router = shared = None
    stats = None
    if egroup is not None:
        mlp, experts, router, shared = moe
        stats = ExpertStats(experts, need_hessians=egroup.method == "gptq",
                            sample_tokens=int(_opt(egroup, "sample_tokens", 4096 if egroup.method == "gptq" else 2048)))
    lstats = {d: LinearStats(m) for d, (m, _) in dense.items()}
    awq_inputs: list[torch.Tensor] = []
    awq_handle = None
    if egroup is not None and egroup.method == "awq":
        cap = int(_opt(egroup, "sample_tokens", 2048))

        def grab(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            have = sum(t.shape[0] for t in awq_inputs)
            if have < cap:
                awq_inputs.append(x[: cap - have].float().clone())

        awq_handle = mlp.register_forward_pre_hook(grab)
    try:
        step.forward()  # one pass: all statistics of this layer
    finally:
        for s in lstats.values():
            s.remove()
        if stats is not None:
            stats.remove()
        if awq_handle is not None:
            awq_handle.remove()

    with torch.no_grad():
        for disk, (mod, g) in dense.items():
            _gptq_dense(res, ckpt, disk, mod, g, lstats[disk])
        if egroup is not None:
            if egroup.method == "gptq":
                _gptq_experts(res, ckpt, names, experts, egroup, stats)
            else:
                _awq_experts(res, ckpt, idx, names, mlp, experts, router, shared, layer, egroup, stats,
                             torch.cat(awq_inputs))
    return res


def _scheme(group: WeightGroup, k: int) -> Scheme:
    return group.scheme.for_in_features(k)


def _gptq_dense(res, ckpt, disk, mod: nn.Linear, g: WeightGroup, st: LinearStats):
    w = mod.weight.detach().float()
    s = _scheme(g, w.shape[1])
    r = gptq(w, st.hessian(), s.num_bits, s.group_size, s.symmetric, damp=float(_opt(g, "damp", 0.01)),
             actorder=bool(_opt(g, "actorder", False)), block_size=int(_opt(g, "block_size", 128)))
    deq = dequantize(r.q, r.qparams.scale, r.qparams.zero_point)
    _emit(res, disk, r.q, r.qparams, s, _scale_dtype(ckpt, disk + ".weight"),
          {"method": "gptq", "tokens": st.count, "damping": round(float(r.damping), 6), "fallback": r.fallback[0],
           "sqnr_db": round(float(sqnr_db(w, deq)), 4)})
    mod.weight.data.copy_(deq.to(mod.weight.dtype))


def _coverage(g: WeightGroup, stats: ExpertStats) -> tuple[torch.Tensor, int, str, str]:
    """Experts whose statistics come from all tokens, and the policy used."""
    min_tokens = _opt(g, "min_tokens", None)
    if min_tokens is None:
        min_tokens = max(1, math.ceil(0.005 * stats.total))
    fallback = str(_opt(g, "fallback", "all_tokens"))
    if fallback not in ("all_tokens", "rtn"):
        raise CalibrationError(f"groups.{g.name}.options.fallback must be all_tokens or rtn, got {fallback!r}")
    mode = str(_opt(g, "stats", "routed"))
    if mode not in ("routed", "all"):
        raise CalibrationError(f"groups.{g.name}.options.stats must be routed or all, got {mode!r}")
    low = stats.counts < int(min_tokens) if mode == "routed" else torch.ones(stats.E, dtype=torch.bool)
    return low, int(min_tokens), fallback, mode


def _all_token_down_hessians(stats: ExpertStats, ids: torch.Tensor) -> torch.Tensor:
    """Down-proj Hessians of experts `ids` from the sampled tokens of the layer sent through each of them."""
    x, _ = stats.samples()  # [t, H]
    out = torch.empty(len(ids), stats.I, stats.I)
    per = max(1, PAIR_BUDGET // max(1, x.shape[0] * max(stats.P, stats.I) * 4))
    for i in range(0, len(ids), per):
        sel = ids[i:i + per]
        hd = stats.down_inputs(sel, x.expand(len(sel), *x.shape))
        out[i:i + per] = torch.bmm(hd.transpose(1, 2), hd) * (2.0 / x.shape[0])
    return out


GPTQ_CHUNK_BYTES = 1 << 27  # float64 Hessian bytes factorized at once (the solve holds ~4 copies)


def _gptq_chunked(w: torch.Tensor, h: torch.Tensor, s: Scheme, **kw):
    """`gptq` over chunks of experts, so the float64 factorizations of a layer's Hessians never sit in
    memory all at once; the results are concatenated (each expert is independent)."""
    from ..quant.gptq import GPTQResult

    e, k = h.shape[0], h.shape[-1]
    per = max(1, GPTQ_CHUNK_BYTES // (k * k * 8))
    parts = [gptq(w[i:i + per], h[i:i + per], s.num_bits, s.group_size, s.symmetric, **kw) for i in range(0, e, per)]
    if len(parts) == 1:
        return parts[0]
    zp = None if parts[0].qparams.zero_point is None else torch.cat([p.qparams.zero_point for p in parts])
    return GPTQResult(torch.cat([p.q for p in parts]), QParams(torch.cat([p.qparams.scale for p in parts]), zp),
                      torch.cat([p.damping for p in parts]), [f for p in parts for f in p.fallback],
                      torch.cat([p.dead_columns for p in parts]))


def _gptq_experts(res, ckpt, names: ExpertNames, experts, g: WeightGroup, stats: ExpertStats):
    E = stats.E
    low, min_tokens, fallback, mode = _coverage(g, stats)
    counts = stats.counts.clamp(min=1).float()
    h_gu = stats.h_gu * (2.0 / counts)[:, None, None]
    h_down = stats.h_down * (2.0 / counts)[:, None, None]
    reasons = [None] * E
    use_rtn = torch.zeros(E, dtype=torch.bool)
    if low.any():
        ids = low.nonzero().flatten()
        if fallback == "rtn" and mode == "routed":
            use_rtn[ids] = True
        else:
            h_gu[ids] = stats.h_all * (2.0 / max(stats.total, 1))
            h_down[ids] = _all_token_down_hessians(stats, ids)
        for e in ids.tolist():
            reasons[e] = ("stats: all tokens" if mode == "all" else
                          f"{int(stats.counts[e])} routed tokens < min_tokens {min_tokens}: "
                          + ("RTN" if use_rtn[e] else "Hessian from all tokens"))
    damp = float(_opt(g, "damp", 0.01))
    actorder = bool(_opt(g, "actorder", False))
    block = int(_opt(g, "block_size", 128))
    gu_w = experts.gate_up_proj.detach().float()  # [E, P, H]
    dn_w = experts.down_proj.detach().float()  # [E, H, I]
    s_gu, s_dn = _scheme(g, gu_w.shape[-1]), _scheme(g, dn_w.shape[-1])
    out = {}
    for key, w, h, s in (("gu", gu_w, h_gu, s_gu), ("down", dn_w, h_down, s_dn)):
        r = _gptq_chunked(w, h, s, damp=damp, actorder=actorder, block_size=block)
        q, qp = r.q, r.qparams
        if use_rtn.any():
            rr = rtn(w[use_rtn], s.num_bits, s.group_size, s.symmetric)
            q = q.clone()
            q[use_rtn] = rr.q
            scale = qp.scale.clone()
            scale[use_rtn] = rr.qparams.scale
            zp = None
            if qp.zero_point is not None:
                zp = qp.zero_point.clone()
                zp[use_rtn] = rr.qparams.zero_point
            qp = QParams(scale, zp)
        out[key] = (q, qp, r)
    half = stats.P // 2
    scale_dtype = _scale_dtype(ckpt, names.module(0, "gate") + ".weight")
    for key, w, s, param in (("gu", gu_w, s_gu, experts.gate_up_proj), ("down", dn_w, s_dn, experts.down_proj)):
        q, qp, r = out[key]
        deq = dequantize(q, qp.scale, qp.zero_point)  # [E, N, K]
        for e in range(E):
            meta = {"method": "gptq" if not use_rtn[e] else "rtn", "tokens": int(stats.counts[e]),
                    "fallback": reasons[e] or r.fallback[e], "damping": round(float(r.damping[e]), 6)}
            if key == "gu":
                parts = (("gate", slice(0, half)), ("up", slice(half, stats.P)))
            else:
                parts = (("down", slice(None)),)
            for kind, rows in parts:
                zp = None if qp.zero_point is None else qp.zero_point[e, rows]
                _emit(res, names.module(e, kind), q[e, rows], QParams(qp.scale[e, rows], zp), s, scale_dtype,
                      {**meta, "sqnr_db": round(float(sqnr_db(w[e, rows], deq[e, rows])), 4)})
        param.data.copy_(deq.to(param.dtype))  # true-sequential: the next layer sees quantized outputs


def _awq_experts(res, ckpt, idx, names: ExpertNames, mlp, experts, router, shared, layer, g: WeightGroup,
                 stats: ExpertStats, x: torch.Tensor):
    """AWQ for a MoE block: (1) one scale s [H] shared by every routed expert's gate/up (and the shared
    expert's), searched on the MoE block output and folded into the post-attention norm (the router is
    compensated exactly); (2) per-expert up->down scales folded into up_proj; (3) clipping search; then
    RTN with the found clip ratios."""
    n_grid = int(_opt(g, "n_grid", 20))
    E, P, H, I = stats.E, stats.P, stats.H, stats.I
    half = P // 2
    s_gu = _scheme(g, H)
    s_dn = _scheme(g, I)
    gu = experts.gate_up_proj.detach().float().clone()  # [E, P, H]
    dn = experts.down_proj.detach().float().clone()  # [E, H, I]
    xs = x.to(experts.gate_up_proj.dtype)[None]  # [1, T, H]: MoE blocks take [batch, seq, hidden]
    norm = layer.post_attention_layernorm
    sh_gate = sh_up = None
    if shared is not None:
        sh_gate, sh_up = shared.gate_proj, shared.up_proj
    orig = {"gu": experts.gate_up_proj.data.clone()}
    if shared is not None:
        orig["sg"], orig["su"] = sh_gate.weight.data.clone(), sh_up.weight.data.clone()
    fp_out = mlp(xs).float()

    # (1) norm -> gate/up scale, loss = MoE block output error with gate/up quantized in the scaled domain
    rows = [gu.reshape(-1, H)]
    if shared is not None:
        rows += [sh_gate.weight.float(), sh_up.weight.float()]
    wcat = torch.cat(rows)
    gsz = s_gu.group_size or H
    wn = wcat.abs().reshape(-1, gsz)
    w_mean = (wn / wn.amax(-1, keepdim=True).clamp(min=1e-12)).reshape(wcat.shape).mean(0)  # [H]
    x_mean = x.abs().mean(0)

    def block_loss(s):
        experts.gate_up_proj.data.copy_((fake_quant(gu * s, s_gu.num_bits, s_gu.group_size, s_gu.symmetric) / s)
                                        .to(experts.gate_up_proj.dtype))
        return (mlp(xs).float() - fp_out).square().mean()

    # powers of two: folding 1/s into the (BF16) norm and s into the router / shared experts is then exact
    s1, a1, _ = search_scales(x_mean, w_mean, block_loss, n_grid, power_of_two=True)
    experts.gate_up_proj.data.copy_(orig["gu"])
    # fold: norm * (1/s), everything reading the norm output * s (exact in float; stored in the source dtype)
    norm.weight.data.copy_((norm.weight.float() / s1).to(norm.weight.dtype))
    gu = gu * s1
    experts.gate_up_proj.data.copy_(gu.to(experts.gate_up_proj.dtype))
    if router is not None:
        router.weight.data.copy_((router.weight.float() * s1).to(router.weight.dtype))
        res.overrides[disk_name(ckpt, idx, "mlp.gate.weight")] = router.weight.detach().clone()
    if shared is not None:
        for lin, nm in ((sh_gate, "gate_proj"), (sh_up, "up_proj")):
            lin.weight.data.copy_((lin.weight.float() * s1).to(lin.weight.dtype))
            sname = "shared_experts" if hasattr(mlp, "shared_experts") else "shared_expert"
            res.overrides[disk_name(ckpt, idx, f"mlp.{sname}.{nm}.weight")] = lin.weight.detach().clone()
    res.overrides[disk_name(ckpt, idx, "post_attention_layernorm.weight")] = norm.weight.detach().clone()
    x_scaled = x / s1  # what the experts now see

    # (2) per-expert up -> down scale, loss = each expert's output error on its routed tokens
    _, sidx = stats.samples()
    s2 = torch.ones(E, I)
    clip_gu = torch.ones(E, P, H // (s_gu.group_size or H))
    clip_dn = torch.ones(E, H, I // (s_dn.group_size or I))
    for ids, xe, mask in routed_batches(x_scaled, sidx, E, H):
        gu_e = gu[ids]  # [e, P, H]
        g_, u_ = torch.bmm(xe, gu_e.transpose(1, 2)).chunk(2, dim=-1)
        he = experts.act_fn(g_) * u_ * mask[..., None]  # [e, t, I]
        dn_e = dn[ids]  # [e, H, I]
        ref = torch.bmm(he, dn_e.transpose(1, 2))
        cnt = mask.sum(1).clamp(min=1)

        def expert_loss(s, he=he, dn_e=dn_e, ref=ref, cnt=cnt):
            dq = fake_quant(dn_e * s[:, None, :], s_dn.num_bits, s_dn.group_size, s_dn.symmetric) / s[:, None, :]
            return (torch.bmm(he, dq.transpose(1, 2)) - ref).square().sum((1, 2)) / cnt

        wn = dn_e.abs().reshape(len(ids), H, -1, s_dn.group_size or I)
        w_mean = (wn / wn.amax(-1, keepdim=True).clamp(min=1e-12)).reshape(len(ids), H, I).mean(1)  # [e, I]
        h_mean = he.abs().sum(1) / cnt[:, None]
        if bool(_opt(g, "scale_down", True)):
            best, _, _ = search_scales(h_mean, w_mean, expert_loss, n_grid)
        else:
            best = torch.ones(len(ids), I)
        s2[ids] = best
        # (3) clipping, on the inputs each matrix now sees
        if bool(_opt(g, "clip", True)):
            clip_gu[ids] = search_clip(gu_e, xe, s_gu.num_bits, s_gu.group_size, s_gu.symmetric, x_mask=mask)
            clip_dn[ids] = search_clip(dn_e * best[:, None, :], he / best[:, None, :], s_dn.num_bits,
                                       s_dn.group_size, s_dn.symmetric, x_mask=mask)
    gu[:, half:, :] /= s2[:, :, None]  # up rows / s
    dn = dn * s2[:, None, :]  # down columns * s
    # to report SQNR against the original weights: effective weight = stored / (what was folded into it)
    unfold = {"gu": torch.cat([torch.ones(E, half, 1), s2[:, :, None]], 1) / s1, "down": 1.0 / s2[:, None, :]}
    original = {"gu": orig["gu"].float(), "down": experts.down_proj.detach().float().clone()}

    scale_dtype = _scale_dtype(ckpt, names.module(0, "gate") + ".weight")
    for key, w, s, clip, param in (("gu", gu, s_gu, clip_gu, experts.gate_up_proj),
                                   ("down", dn, s_dn, clip_dn, experts.down_proj)):
        qp = choose_qparams_clipped(w, s.num_bits, s.group_size, s.symmetric, clip, scale_dtype)
        q = quantize(w, qp, s.num_bits)
        deq = dequantize(q, qp.scale, qp.zero_point)
        parts = (("gate", slice(0, half)), ("up", slice(half, P))) if key == "gu" else (("down", slice(None)),)
        for e in range(E):
            meta = {"method": "awq", "tokens": int(stats.counts[e]), "fallback": None,
                    "awq_alpha": round(float(a1), 3)}
            if int(stats.counts[e]) == 0:
                meta["fallback"] = "0 routed tokens: per-expert scale 1, clip search skipped"
            for kind, rows in parts:
                zp = None if qp.zero_point is None else qp.zero_point[e, rows]
                eff = deq[e, rows] * unfold[key][e][rows if key == "gu" else slice(None)]  # [N, K]
                _emit(res, names.module(e, kind), q[e, rows], QParams(qp.scale[e, rows], zp), s, scale_dtype,
                      {**meta, "sqnr_db": round(float(sqnr_db(original[key][e, rows], eff)), 4),
                       "sqnr_domain": "original weights (AWQ scales unfolded)"})
        param.data.copy_(deq.to(param.dtype))


# ---- the whole model ----------------------------------------------------------------------------------
def run_calibrated(src_dir, recipe: Recipe, samples, spool: Path, *, progress: Callable[[int, int], None] | None = None,
                   log: Callable[[str], None] = lambda m: None, dtype: torch.dtype = torch.float32) -> dict:
    """Quantize every calibrated group of `recipe` layer by layer; write the spool; return its index
    {"layers": [...], "modules": {module: meta}, "overrides": [names]}."""
    from .executor import LayerExecutor

    spool = Path(spool)
    spool.mkdir(parents=True, exist_ok=True)
    ex = LayerExecutor(src_dir, dtype=dtype, workdir=spool)
    ckpt = ex.ckpt
    index = {"layers": [], "modules": {}, "overrides": []}
    for step in ex.layers(samples):
        r = quantize_layer(ckpt, recipe, step, log)
        step.forward()  # true-sequential: the next layer calibrates on this layer's quantized output
        if r.tensors or r.overrides:
            name = f"layer-{step.index:05d}"
            tensors = {**{k: v.contiguous() for k, v in r.tensors.items()},
                       **{k: v.contiguous() for k, v in r.overrides.items()}}
            write_safetensors(spool / f"{name}.safetensors", dict(sorted(tensors.items())))
            meta = {"tensors": sorted(r.tensors), "overrides": sorted(r.overrides), "modules": r.modules}
            (spool / f"{name}.json").write_text(json.dumps(meta, sort_keys=True))
            index["layers"].append(name)
            index["modules"].update(r.modules)
            index["overrides"].extend(sorted(r.overrides))
        if progress:
            progress(step.index + 1, ex.num_layers)
    return index
