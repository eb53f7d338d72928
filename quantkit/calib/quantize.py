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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..io.checkpoint import Checkpoint
from ..io.safetensors import write_safetensors
from ..io.writer import fsync_path, write_json_atomic
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
        self.w_samples: list[torch.Tensor] = []  # [t, k] the router's weights of those tokens' top-k experts
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
            wts = args[2].detach().reshape(x.shape[0], -1)[:take].float() if len(args) > 2 else None
            self.w_samples.append(wts.clone() if wts is not None and wts.shape == idx[:take].shape
                                  else torch.ones(take, idx.shape[1]))
            self._n_samples += take
        self.counts += torch.bincount(idx.flatten(), minlength=self.E)[: self.E]
        if self.need_h:
            per = max(1, GRAM_CHUNK_BYTES // (max(self.H, self.P) * self.H * 4))  # bounds gathered weights too
            for experts_ids, xs, mask in routed_batches(x, idx, self.E, self.H):
                for a in range(0, len(experts_ids), per):
                    ids, xa, ma = experts_ids[a:a + per], xs[a:a + per], mask[a:a + per, :, None]
                    _add_gram(self.h_gu, ids, xa * ma)
                    _add_gram(self.h_down, ids, self.down_inputs(ids, xa) * ma)

    def down_inputs(self, experts_ids: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """act(gate x) * up x for experts [e] and padded tokens xs [e, t, H] -> [e, t, I]."""
        gu = torch.bmm(xs, self.experts.gate_up_proj[experts_ids].float().transpose(1, 2))  # [e, t, P]
        g, u = gu.chunk(2, dim=-1)
        return self.experts.act_fn(g) * u

    def remove(self):
        self.handle.remove()

    def samples(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.x_samples), torch.cat(self.idx_samples)

    def routing_weights(self) -> torch.Tensor:
        """[t, k] router weights of the sampled tokens (aligned with `samples()`)."""
        return torch.cat(self.w_samples)


GRAM_CHUNK_BYTES = 1 << 25  # [e, D, D] Gram products formed at once when accumulating expert Hessians


def _add_gram(h: torch.Tensor, ids: torch.Tensor, xs: torch.Tensor) -> None:
    """h[ids[i]] += xs[i]^T xs[i], a few experts at a time, accumulated in place (no gathered copy of h)."""
    d = xs.shape[-1]
    per = max(1, GRAM_CHUNK_BYTES // (d * d * 4))
    for a in range(0, len(ids), per):
        xa = xs[a:a + per]
        h.index_add_(0, ids[a:a + per], torch.bmm(xa.transpose(1, 2), xa))


def routed_batches(x: torch.Tensor, idx: torch.Tensor, num_experts: int, width: int, budget: int = PAIR_BUDGET,
                   weights: torch.Tensor | None = None):
    """Yield (expert ids [e], padded tokens [e, t, D], mask [e, t]) over chunks of experts: the tokens routed
    to each expert, gathered and zero-padded to the chunk's longest list, so that per-expert products are
    one batched matmul. With `weights` [T, k] (the router's top-k weights), each item also carries the
    weight of each gathered token for that expert: (ids, tokens, mask, weights [e, t], 0 on padding)."""
    t, k = idx.shape
    flat = idx.flatten()
    token = torch.arange(t).repeat_interleave(k)
    order = torch.argsort(flat, stable=True)
    flat, token = flat[order], token[order]
    slot_w = None if weights is None else weights.reshape(-1).float()[order]
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
        ws = None if slot_w is None else torch.zeros(len(ids), longest)
        for r, e in enumerate(ids.tolist()):
            c, s = int(counts[e]), int(starts[e])
            xs[r, :c] = x[token[s:s + c]]
            mask[r, :c] = 1
            if ws is not None:
                ws[r, :c] = slot_w[s:s + c]
        yield (ids, xs, mask) if ws is None else (ids, xs, mask, ws)
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
        default_sample = 4096 if egroup.method == "gptq" else AWQ_SAMPLE_TOKENS
        stats = ExpertStats(experts, need_hessians=egroup.method == "gptq",
                            sample_tokens=int(_opt(egroup, "sample_tokens", default_sample)))
    lstats = {d: LinearStats(m) for d, (m, _) in dense.items()}
    try:
        step.forward()  # one pass: all statistics of this layer
    finally:
        for s in lstats.values():
            s.remove()
        if stats is not None:
            stats.remove()

    with torch.no_grad():
        for disk, (mod, g) in dense.items():
            _gptq_dense(res, ckpt, disk, mod, g, lstats[disk])
        if egroup is not None:
            if egroup.method == "gptq":
                _gptq_experts(res, ckpt, names, experts, egroup, stats)
            else:
                _awq_experts(res, ckpt, idx, names, mlp, experts, router, shared, layer, egroup, stats)
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


# Experts solved at once by `_gptq_experts`: their float64 Hessians take at most this many bytes (the
# solve holds ~5 float64 copies of them). Small: batching more experts gains little (the factorizations
# are compute-bound) and a layer's peak memory is dominated by this buffer otherwise.
GPTQ_CHUNK_BYTES = 1 << 24


def _gptq_experts(res, ckpt, names: ExpertNames, experts, g: WeightGroup, stats: ExpertStats):
    """GPTQ for every expert of a layer, a few experts at a time: weights are converted to float32,
    solved, dequantized and written back (true-sequential: the next layer sees quantized outputs) one
    chunk at a time, so besides the layer's Hessians only one chunk's working set is ever in memory."""
    E = stats.E
    low, min_tokens, fallback, mode = _coverage(g, stats)
    counts = stats.counts.clamp(min=1).float()
    # the sums become 2/n-scaled Hessians in place: the statistics are not used after this
    h_gu = stats.h_gu.mul_((2.0 / counts)[:, None, None])
    h_down = stats.h_down.mul_((2.0 / counts)[:, None, None])
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
    kw = dict(damp=float(_opt(g, "damp", 0.01)), actorder=bool(_opt(g, "actorder", False)),
              block_size=int(_opt(g, "block_size", 128)))
    half = stats.P // 2
    scale_dtype = _scale_dtype(ckpt, names.module(0, "gate") + ".weight")
    for key, param, h in (("gu", experts.gate_up_proj, h_gu), ("down", experts.down_proj, h_down)):
        k = param.shape[-1]
        s = _scheme(g, k)
        parts = (("gate", slice(0, half)), ("up", slice(half, stats.P))) if key == "gu" else (("down", slice(None)),)
        per = max(1, GPTQ_CHUNK_BYTES // (k * k * 8))
        for i0 in range(0, E, per):
            i1 = min(E, i0 + per)
            w = param.data[i0:i1].float()  # [c, N, K]
            r = gptq(w, h[i0:i1], s.num_bits, s.group_size, s.symmetric, **kw)
            q, qp = r.q, r.qparams
            sel = use_rtn[i0:i1]
            if sel.any():
                rr = rtn(w[sel], s.num_bits, s.group_size, s.symmetric)
                q[sel] = rr.q
                qp.scale[sel] = rr.qparams.scale
                if qp.zero_point is not None:
                    qp.zero_point[sel] = rr.qparams.zero_point
            deq = dequantize(q, qp.scale, qp.zero_point)  # [c, N, K]
            for j, e in enumerate(range(i0, i1)):
                meta = {"method": "gptq" if not use_rtn[e] else "rtn", "tokens": int(stats.counts[e]),
                        "fallback": reasons[e] or r.fallback[j], "damping": round(float(r.damping[j]), 6)}
                for kind, rows in parts:
                    zp = None if qp.zero_point is None else qp.zero_point[j, rows]
                    _emit(res, names.module(e, kind), q[j, rows], QParams(qp.scale[j, rows], zp), s, scale_dtype,
                          {**meta, "sqnr_db": round(float(sqnr_db(w[j, rows], deq[j, rows])), 4)})
            param.data[i0:i1].copy_(deq.to(param.dtype))
            del w, r, q, qp, deq


AWQ_SAMPLE_TOKENS = 8192  # calibration tokens per MoE layer the AWQ searches use (option `sample_tokens`)
AWQ_TOKEN_CHUNK = 8192  # tokens per MoE forward inside the norm-scale search (bounds its temporaries)


def _stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as it will be written in `dtype` (the tensor's source dtype), back in float32."""
    return t.to(dtype).float() if dtype.is_floating_point else t.float()


def _source_dtype(ckpt: Checkpoint, name: str) -> torch.dtype:
    return ckpt.info(name).dtype if name in ckpt.location else torch.bfloat16


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
    s_gu = _scheme(g, x.shape[-1])
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
    norm_dt = _source_dtype(ckpt, norm_name)
    orig = [(m, name, m.weight.detach().float().clone(), _source_dtype(ckpt, name)) for m, name in readers]
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


def _awq_experts(res, ckpt, idx, names: ExpertNames, mlp, experts, router, shared, layer, g: WeightGroup,
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
    n_grid = int(_opt(g, "n_grid", 20))
    do_clip = bool(_opt(g, "clip", True))
    do_down = bool(_opt(g, "scale_down", True))
    E, P, H, I = stats.E, stats.P, stats.H, stats.I
    half = P // 2
    s_gu = _scheme(g, H)
    s_dn = _scheme(g, I)
    x, sidx = stats.samples()  # [T, H]: the MoE block's input (the post-attention norm output)
    original = {"gu": experts.gate_up_proj.detach().float().clone(), "down": experts.down_proj.detach().float().clone()}

    # (1) norm -> gate/up
    s1, a1 = _awq_norm_scale(res, ckpt, idx, mlp, experts, router, shared, layer, g, x, n_grid)
    gu = experts.gate_up_proj.detach().float().clone()  # = original * s1, [E, P, H]
    dn = original["down"].clone()  # [E, H, I]
    x_scaled = x / s1  # what the experts now see

    # coverage: counted on the sampled tokens the searches use
    low, min_tokens, fallback, mode = _coverage(g, stats)
    sampled = torch.bincount(sidx.flatten(), minlength=E)[:E]
    if _opt(g, "min_tokens", None) is None:
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

    scale_dtype = _scale_dtype(ckpt, names.module(0, "gate") + ".weight")
    for key, w, s, clip, param in (("gu", gu, s_gu, clip_gu, experts.gate_up_proj),
                                   ("down", dn, s_dn, clip_dn, experts.down_proj)):
        qp = choose_qparams_clipped(w, s.num_bits, s.group_size, s.symmetric, clip, scale_dtype)
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
                _emit(res, names.module(e, kind), q[e, rows], QParams(qp.scale[e, rows], zp), s, scale_dtype,
                      {**meta, "sqnr_db": round(float(sqnr_db(original[key][e, rows], eff)), 4),
                       "sqnr_domain": "original weights (AWQ scales unfolded)"})
        param.data.copy_(deq.to(param.dtype))


# ---- the whole model ----------------------------------------------------------------------------------
PROGRESS_NAME = "progress.json"  # in the spool: how far an interrupted pass got


def _read_progress(spool: Path, num_layers: int, lengths: list[int], hidden: int, dtype: torch.dtype):
    """The progress record of an interrupted pass over the same samples, if whole and consistent (anything
    else, torn or foreign, means starting over): (next layer, index so far, activation file)."""
    try:
        rec = json.loads((spool / PROGRESS_NAME).read_text())
        nxt, index, name = rec["next_layer"], rec["index"], rec["activations"]
        layers = index["layers"]
        ok = (isinstance(nxt, int) and 0 < nxt < num_layers and rec["lengths"] == lengths
              and rec["hidden"] == hidden and rec["dtype"] == str(dtype)
              and name == f"activations-{nxt:05d}.bin" and (spool / name).is_file()
              and isinstance(index["modules"], dict) and isinstance(index["overrides"], list)
              and isinstance(layers, list) and all(isinstance(n, str) and re.fullmatch(r"layer-\d{5}", n)
                                                   and int(n[6:]) < nxt for n in layers)
              and all((spool / f"{n}.json").is_file() and (spool / f"{n}.safetensors").is_file() for n in layers))
        act = spool / name
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (nxt, index, act) if ok else None


def run_calibrated(src_dir, recipe: Recipe, samples, spool: Path, *, progress: Callable[[int, int], None] | None = None,
                   log: Callable[[str], None] = lambda m: None, dtype: torch.dtype = torch.float32) -> dict:
    """Quantize every calibrated group of `recipe` layer by layer; write the spool; return its index
    {"layers": [...], "modules": {module: meta}, "overrides": [names]}.

    Resumable per layer: after each layer the spool gets that layer's results (fsynced), then the next
    layer's input activations (the quantized layer's outputs, written whole or not at all), then a progress
    record naming both. A pass that finds a consistent record in `spool` continues at that layer with
    those activations, and ends with the same results as an uninterrupted pass (the pass is deterministic)."""
    from .executor import LayerExecutor

    spool = Path(spool)
    spool.mkdir(parents=True, exist_ok=True)
    ex = LayerExecutor(src_dir, dtype=dtype, workdir=spool)
    ckpt = ex.ckpt
    lengths = [int(len(x)) for x in samples]
    index = {"layers": [], "modules": {}, "overrides": []}
    start, inputs = 0, samples
    found = _read_progress(spool, ex.num_layers, lengths, ex.hidden_size, dtype)
    if found is not None:
        try:
            inputs = ex.restore(found[2], lengths)
        except (OSError, ValueError):
            pass  # activations that do not fit the samples: start over
        else:
            start, index = found[0], found[1]
            log(f"resuming calibration at layer {start} of {ex.num_layers}")
    for step in ex.layers(inputs, start=start):
        r = quantize_layer(ckpt, recipe, step, log)
        step.forward()  # true-sequential: the next layer calibrates on this layer's quantized output
        if r.tensors or r.overrides:
            name = f"layer-{step.index:05d}"
            tensors = {**{k: v.contiguous() for k, v in r.tensors.items()},
                       **{k: v.contiguous() for k, v in r.overrides.items()}}
            write_safetensors(spool / f"{name}.safetensors", dict(sorted(tensors.items())))
            meta = {"tensors": sorted(r.tensors), "overrides": sorted(r.overrides), "modules": r.modules}
            (spool / f"{name}.json").write_text(json.dumps(meta, sort_keys=True))
            fsync_path(spool / f"{name}.safetensors")
            fsync_path(spool / f"{name}.json")
            index["layers"].append(name)
            index["modules"].update(r.modules)
            index["overrides"].extend(sorted(r.overrides))
        if step.index + 1 < ex.num_layers:
            act = f"activations-{step.index + 1:05d}.bin"
            step.outputs.save(spool / act)
            write_json_atomic(spool / PROGRESS_NAME, {"next_layer": step.index + 1, "activations": act,
                                                      "lengths": lengths, "hidden": ex.hidden_size,
                                                      "dtype": str(dtype), "index": index})
            for old in spool.glob("activations-*.bin"):
                if old.name != act:
                    old.unlink(missing_ok=True)
        if progress:
            progress(step.index + 1, ex.num_layers)
    for p in [spool / PROGRESS_NAME, *spool.glob("activations-*"), *spool.glob(".activations-*")]:
        p.unlink(missing_ok=True)
    return index
