"""Architectures as data: which model types quantkit knows, how each names its experts on disk, where a
multimodal wrapper keeps its text model, and what every command can do with each. Also the one reader
of config.json: `parse_config` reduces it to a validated `ModelSpec`, and `check_tensors` holds that
spec against the checkpoint's tensors (a config is hostile input: a field the tensors contradict, or
one beyond sane bounds, is a named error before anything is built).

Every command consults this registry: calibration (transformers builds the layers), the reference
runner, `plan`, `convert`'s fused-expert handling and `verify`. Its modules, one concern each:

    registry.py   the families (`Arch`, `ARCHITECTURES`, `ALIASES`, `WRAPPERS`) and a config's family
    config.py     config.json -> `ModelSpec` (`parse_config`), every field checked, and the sanity bounds
    check.py      the spec against the tensors (`validate`, `check_tensors`, `check_expert_shapes`)
    layout.py     how checkpoints and transformers name modules (and `fused_experts`)

Every name below is imported from here (`from ..arch import parse_config`).
"""

from __future__ import annotations

from .check import check_expert_shapes, check_tensors, validate
from .config import (FIELD_HINT, MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_INTERMEDIATE, MAX_LAYERS,
                     MAX_POSITIONS, MAX_ROUTED_EXPERTS, MAX_VOCAB, ModelSpec, parse_config)
from .layout import MIXTRAL_EXPERTS, QWEN_EXPERTS, ExpertNames, fused_experts
from .registry import (ALIASES, ARCHITECTURES, LAYER_INDEX, SUPPORTED_MODEL_TYPES, WRAPPERS, Arch, Wrapper, arch_for,
                       family, hf_module_name, layer_index, model_types, support_hint, text_config, traits,
                       wrapper_prefixes)

__all__ = ["ALIASES", "ARCHITECTURES", "Arch", "ExpertNames", "FIELD_HINT", "LAYER_INDEX", "MAX_EXPERTS",
           "MAX_HEAD_DIM", "MAX_HEADS", "MAX_HIDDEN", "MAX_INTERMEDIATE", "MAX_LAYERS", "MAX_POSITIONS",
           "MAX_ROUTED_EXPERTS", "MAX_VOCAB", "MIXTRAL_EXPERTS", "ModelSpec", "QWEN_EXPERTS", "SUPPORTED_MODEL_TYPES",
           "WRAPPERS", "Wrapper", "arch_for", "check_expert_shapes", "check_tensors", "family", "fused_experts",
           "hf_module_name", "layer_index", "model_types", "parse_config", "support_hint", "text_config", "traits",
           "validate", "wrapper_prefixes"]
