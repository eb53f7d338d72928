"""What a calibrated pass produces for one decoder layer: the packed tensors of every module it
quantized (in the output format, pack/layout.py), the source tensors whose values it changed (AWQ's
folded scales), and each module's manifest metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..match.recipe import Scheme
from ..pack.int4 import pack_ints
from ..pack.layout import int4_module
from ..pack.names import Tensor
from ..quant.int4 import QParams
from ..read.checkpoint import Checkpoint


@dataclass
class LayerResult:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # final output tensors (packed)
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)  # replaced source tensors
    modules: dict[str, dict] = field(default_factory=dict)  # module -> manifest metadata
    # module -> {"input_scale": meta} (NVFP4 W4A4), added to `modules` after every rank's entries (spool.py)
    input_scales: dict[str, dict] = field(default_factory=dict)


def source_dtype(ckpt: Checkpoint, name: str) -> torch.dtype:
    return ckpt.info(name).dtype if name in ckpt.location else torch.bfloat16


def emit(res: LayerResult, module: str, q: torch.Tensor, qp: QParams, scheme: Scheme, src_dtype: torch.dtype,
         meta: dict) -> None:
    """Record one quantized module's output tensors (q [N, K] int, from a weight stored as `src_dtype`),
    exactly as convert writes them."""
    packed = pack_ints(q, scheme.num_bits)
    for name, t in int4_module(module, packed, qp.scale, qp.zero_point, tuple(q.shape), scheme, src_dtype):
        res.tensors[name] = t
    res.modules[module] = {"scheme": scheme.label, **meta}


def emit_tensors(res: LayerResult, module: str, tensors: list[tuple[str, torch.Tensor]], scheme: Scheme,
                 meta: dict) -> None:
    """Record one quantized module given its output tensors (name, tensor) in pack/layout.py's order (FP4:
    pack.layout.fp4_module)."""
    for name, t in tensors:
        res.tensors[name] = t.contiguous()
    res.modules[module] = {"scheme": scheme.label, **meta}



def _input_scale_meta(amax: float, tokens: int, source: str) -> dict:
    """A module's `input_scale` manifest record (NVFP4 W4A4): the amax its input_global_scale was computed from,
    the calibration tokens it saw, and where the amax came from (quant/fp4_act.py CALIBRATED / LAYER_MAX)."""
    from ..quant.fp4_act import LAYER_MAX

    meta = {"amax": float(amax), "tokens": int(tokens), "source": source}
    if source == LAYER_MAX:
        meta["reason"] = ("no calibration token was routed to this expert: the layer's largest input amax (its "
                          "coarsest calibrated scale; never NaN, Inf or 0)")
    return meta


def _add_input_scale(res: LayerResult, module: str, scale: torch.Tensor, meta: dict) -> None:
    res.tensors[Tensor.INPUT_GLOBAL_SCALE.of(module)] = scale.detach().float().reshape(1).clone()
    res.input_scales.setdefault(module, {})["input_scale"] = meta


def emit_expert_input_scales(res: LayerResult, names, obs, layer_idx: int) -> None:
    """The `input_global_scale` of every routed expert's gate, up and down of one layer from its
    ExpertInputAmax observer (calib/observers.py): gate and up share one input, hence one scale; an expert no
    calibration token reached gets the layer's largest amax (quant/fp4_act.py `expert_input_scales`)."""
    from ..errors import CalibrationError
    from ..quant.fp4_act import expert_input_scales

    try:
        gu, gu_amax, gu_src = expert_input_scales(obs.gate_up, obs.tokens)
        dn, dn_amax, dn_src = expert_input_scales(obs.down, obs.tokens)
    except ValueError as e:
        raise CalibrationError(f"decoder layer {layer_idx}: NVFP4 input scales: {e}",
                               hint="check the calibration data reaches this layer's experts") from None
    tokens = obs.tokens.tolist()
    for e in range(obs.E):
        for kind in ("gate", "up"):
            _add_input_scale(res, names.module(e, kind), gu[e], _input_scale_meta(gu_amax[e], tokens[e], gu_src[e]))
        _add_input_scale(res, names.module(e, "down"), dn[e], _input_scale_meta(dn_amax[e], tokens[e], dn_src[e]))


def emit_input_scale(res: LayerResult, module: str, amax: torch.Tensor, tokens: int) -> None:
    """A dense Linear's `input_global_scale` (NVFP4 W4A4) from the amax of its input over every token."""
    from ..errors import CalibrationError
    from ..quant.fp4_act import CALIBRATED, input_global_scale

    try:
        gs = input_global_scale(amax.reshape(1))
    except ValueError as e:
        raise CalibrationError(f"{module}: NVFP4 input scale: {e}") from None
    _add_input_scale(res, module, gs, _input_scale_meta(float(amax), tokens, CALIBRATED))
