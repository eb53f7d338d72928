"""What a calibrated pass produces for one decoder layer: the packed tensors of every module it
quantized (in the output format, pack/layout.py), the source tensors whose values it changed (AWQ's
folded scales), and each module's manifest metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..match.recipe import Scheme
from ..pack.int4 import pack_int4
from ..pack.layout import int4_module
from ..quant.int4 import QParams
from ..read.checkpoint import Checkpoint


@dataclass
class LayerResult:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # final output tensors (packed)
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)  # replaced source tensors
    modules: dict[str, dict] = field(default_factory=dict)  # module -> manifest metadata


def source_dtype(ckpt: Checkpoint, name: str) -> torch.dtype:
    return ckpt.info(name).dtype if name in ckpt.location else torch.bfloat16


def emit(res: LayerResult, module: str, q: torch.Tensor, qp: QParams, scheme: Scheme, src_dtype: torch.dtype,
         meta: dict) -> None:
    """Record one quantized module's output tensors (q [N, K] int, from a weight stored as `src_dtype`),
    exactly as convert writes them."""
    for name, t in int4_module(module, pack_int4(q), qp.scale, qp.zero_point, tuple(q.shape), scheme, src_dtype):
        res.tensors[name] = t
    res.modules[module] = {"scheme": scheme.label, **meta}


def emit_tensors(res: LayerResult, module: str, tensors: dict[str, torch.Tensor], scheme: Scheme, meta: dict) -> None:
    """Record one quantized module given its output tensors by local name (FP4: weight_packed,
    weight_scale[, weight_global_scale]), in pack/layout.py's order."""
    for suffix, t in tensors.items():
        res.tensors[f"{module}.{suffix}"] = t.contiguous()
    res.modules[module] = {"scheme": scheme.label, **meta}

