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

from ..errors import CalibrationError
from ..match.recipe import Recipe, WeightGroup
from ..read.checkpoint import Checkpoint
from .awq_pass import awq_experts
from .emit import LayerResult
from .gptq_pass import gptq_dense, gptq_experts
from .hessians import ExpertStats, LinearStats
from .names import disk_name, expert_names


# ---- the layer procedure ----------------------------------------------------------------------------
def _find_moe(layer: nn.Module):
    mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
    experts = getattr(mlp, "experts", None) if mlp is not None else None
    if experts is None or not hasattr(experts, "gate_up_proj"):
        return None
    shared = getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert", None)
    return mlp, experts, getattr(mlp, "gate", None), shared


def _targets(ckpt: Checkpoint, recipe: Recipe, idx: int, layer: nn.Module):
    """What a calibrated pass does to decoder layer `idx` (materialized or still on `meta`): (expert names,
    the routed experts' group or None, {disk module: (Linear, group)} of the dense calibrated targets)."""
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
    return names, egroup, dense


def quantize_layer(ckpt: Checkpoint, recipe: Recipe, step, log: Callable[[str], None] = lambda m: None) -> LayerResult:
    """Calibrate and quantize decoder layer `step.index` in place (weights replaced by their dequantized
    values); returns what convert must write. The caller forwards the step afterwards (true-sequential)."""
    idx, layer = step.index, step.layer
    res = LayerResult()
    names, egroup, dense = _targets(ckpt, recipe, idx, layer)
    moe = _find_moe(layer)
    if egroup is None and not dense:
        return res

    mlp = experts = router = shared = None
    stats = None
    if egroup is not None:
        mlp, experts, router, shared = moe
        stats = ExpertStats(experts, need_hessians=egroup.method == "gptq",
                            sample_tokens=egroup.options.sample_tokens, block=mlp if egroup.method == "awq" else None)
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
            gptq_dense(res, ckpt, disk, mod, g, lstats[disk])
        if egroup is not None:
            if egroup.method == "gptq":
                gptq_experts(res, ckpt, names, experts, egroup, stats)
            else:
                # the block's recorded outputs are its unquantized response unless a dense group above just
                # quantized a module inside it (a shared expert's down_proj): then it is measured again
                mlp_rel = next(n for n, m in layer.named_modules() if m is mlp) + "."
                inside = any(n.startswith(mlp_rel) for n, m in layer.named_modules()
                             if any(m is d for d, _ in dense.values()))
                awq_experts(res, ckpt, idx, names, mlp, experts, router, shared, layer, egroup, stats,
                            fp_out=None if inside else stats.block_outputs())
    return res


# ---- device memory of a layer's statistics and solves (calib/device.py plans with it) ------------------
def statistics_bytes(ckpt: Checkpoint, recipe: Recipe, idx: int, layer: nn.Module, device: torch.device,
                     compute_dtype: torch.dtype, call_tokens: int, lengths) -> dict[str, int]:
    """Estimated peak bytes, by component, of what `quantize_layer` holds on the device for layer `idx`
    besides the layer's weights and the forward (`layer` may be the meta skeleton). Mirrors the code: the
    expert Hessians (float32), the token samples, the Gram/solve working sets (GPTQ_CHUNK_BYTES-bounded
    solves, PAIR_BUDGET-bounded gathers), AWQ's float32 copies of the experts and its search blocks."""
    from .awq_pass import AWQ_TOKEN_CHUNK
    from .gptq_pass import chunk_experts, solve_dtype
    from .hessians import GRAM_CHUNK_BYTES, PAIR_BUDGET
    from ..quant.awq import CLIP_GRAM_BYTES

    names, egroup, dense = _targets(ckpt, recipe, idx, layer)
    out: dict[str, int] = {}
    sitem = torch.empty((), dtype=solve_dtype(device)).element_size()
    tokens = int(call_tokens)  # the most tokens one forward call gets (LayerExecutor.call_tokens)
    if egroup is not None:
        _, experts, router, _ = _find_moe(layer)
        e, p, h = (int(d) for d in experts.gate_up_proj.shape)
        i = int(experts.down_proj.shape[-1])
        k = int(getattr(router, "top_k", 0) or 8)
        s_tok = min(int(egroup.options.sample_tokens), max(1, int(sum(int(t) for t in lengths))))
        upcast = tokens * h * 4 if compute_dtype != torch.float32 else 0  # the hook's float32 copy of a batch
        if egroup.method == "gptq":
            out["hessians"] = (e * (h * h + i * i) + h * h) * 4
            out["samples"] = s_tok * (h * 4 + k * 12)
            out["gram"] = upcast + PAIR_BUDGET * (3 + (2 * p + 2 * i) // h) + 2 * GRAM_CHUNK_BYTES
            solve = 0
            for n_out, k_in in ((p, h), (h, i)):
                c = min(e, chunk_experts(k_in, device))
                solve = max(solve, c * (5 * k_in * k_in * sitem + 5 * n_out * k_in * 4))
            out["solve"] = solve
        else:  # awq
            out["samples"] = s_tok * (2 * h * 4 + k * 12)
            # float32 copies: the original gate/up and down, the scaled gate/up and down, fake-quantized
            # gate/up during the norm search; at the end the codes and dequantized weights
            out["awq_weights"] = e * ((4 * p * h + 2 * h * i) * 4 + p * h * 5)
            chunk = min(s_tok, AWQ_TOKEN_CHUNK)
            out["searches"] = max(8 * PAIR_BUDGET + 2 * CLIP_GRAM_BYTES,
                                  chunk * (h * 4 * (LIVE_TEMPORARIES_AWQ) + k * 2 * p * 4)) + upcast
    if dense:
        out["dense_hessians"] = sum(m.in_features * m.in_features * 4 for m, _ in dense.values())
        out["dense_solve"] = max(5 * m.in_features * m.in_features * sitem + 5 * m.out_features * m.in_features * 4
                                 for m, _ in dense.values())
    return out


LIVE_TEMPORARIES_AWQ = 6  # [tokens, hidden] float32 buffers of one norm-search forward chunk besides the MoE blocks
