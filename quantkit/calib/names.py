"""Names of a decoder layer's modules on disk (the registry's expert naming, arch.py) for the in-memory
modules transformers builds: `mlp.gate.weight` is Mixtral's `block_sparse_moe.gate.weight` on disk, and a
multimodal wrapper's text layers sit under its prefix (Kimi K2.5: `language_model.model.layers.L.`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..arch import arch_for, text_config
from ..arch.layout import EXPERTS, FUSED_GATE_UP, HF_BLOCK, LayerNames
from ..errors import CalibrationError
from ..pack.names import Tensor
from ..read.checkpoint import Checkpoint


@dataclass(frozen=True)
class ExpertNames:
    """Disk module names of expert e's projections, e.g. model.layers.3.mlp.experts.{e}.gate_proj."""

    prefix: str  # [language_model.]model.layers.L.mlp.experts (or block_sparse_moe.experts)
    gate: str
    up: str
    down: str

    def module(self, e: int, kind: str) -> str:
        return f"{self.prefix}.{e}.{getattr(self, kind)}"


def expert_names(ckpt: Checkpoint, layer_idx: int) -> ExpertNames | None:
    """The routed experts of layer `layer_idx` as the registry names them (arch.py), if it has any on disk as
    float (or block-FP8) or packed (INT4 / FP4, `weight_packed`: Kimi K2.x releases) weights. Whether packed
    experts need calibrating depends on the recipe (INT4 -> INT4 is passed through): calib/layer.py decides."""
    names = arch_for(ckpt.config).experts
    if names is None:
        return None
    prefix = f"{LayerNames(text_config(ckpt.config)[1], layer_idx).layer}.{names.block}.{EXPERTS}"
    if any(n in ckpt.location for n in (f"{prefix}.0.{names.gate}.weight", f"{prefix}.{FUSED_GATE_UP}",
                                         Tensor.PACKED.of(f"{prefix}.0.{names.gate}"))):
        return ExpertNames(prefix, names.gate, names.up, names.down)
    return None


def disk_name(ckpt: Checkpoint, layer_idx: int, rel: str) -> str:
    """On-disk name of an in-memory layer tensor (`mlp.gate.weight` -> Mixtral's `block_sparse_moe.gate.weight`)."""
    names = arch_for(ckpt.config).experts
    block = names.block if names is not None else HF_BLOCK
    layer = LayerNames(text_config(ckpt.config)[1], layer_idx).layer
    for cand in (rel, rel.replace(f"{HF_BLOCK}.", f"{block}.", 1)):
        name = f"{layer}.{cand}"
        if name in ckpt.location:
            return name
    raise CalibrationError(f"layer {layer_idx}: no on-disk tensor for {rel}")
