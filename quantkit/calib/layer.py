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
                            sample_tokens=egroup.options.sample_tokens)
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
                awq_experts(res, ckpt, idx, names, mlp, experts, router, shared, layer, egroup, stats)
    return res
