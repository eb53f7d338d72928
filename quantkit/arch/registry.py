"""The registry: which model types quantkit knows, how each names its experts on disk, where a multimodal
wrapper keeps its text model, and what every command can do with each (`Arch`, `ARCHITECTURES`, `ALIASES`,
`WRAPPERS`), and a config's family resolved from its model_type (`family`, `arch_for`, `text_config`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, UnsupportedArchitecture
from .layout import MIXTRAL_EXPERTS, QWEN_EXPERTS, ExpertNames


@dataclass(frozen=True)
class Arch:
    """One model family. `calibrate`: the calibration executor builds its layers with transformers;
    `runner`: the reference runner executes it; every known family can be planned and converted."""

    model_type: str  # transformers' model_type the layers are built as
    attention: str  # "gqa" (K/V per KV head) | "mla" (one latent per token)
    experts: ExpertNames | None  # None: a dense model
    calibrate: bool = True
    runner: bool = False
    # RoPE and routing as the family's transformers modeling file runs them (the reference runner reads these)
    partial_rotary: float = 1.0  # the default rope's partial_rotary_factor when config.json gives none
    rope_interleave: bool = False  # config.json rope_interleave (default true) selects the interleaved RoPE
    routing: str = "softmax"  # softmax top-k | "noaux_tc": sigmoid + correction bias, group-limited top-k
    routing_weights_in_act_dtype: bool = False  # the routing weights are rounded to the activation dtype
    qk_norm_whole: bool = False  # q/k norms span the whole projection (OLMoE), not each head (Qwen3, GLM)
    experts_key: str = "n_routed_experts"  # the config.json field counting the routed experts
    # config.json fields transformers' config class reads as one field (its attribute_map, and the spellings its
    # __post_init__ reroutes): each group is one field, quantkit's own spelling first
    aliases: tuple[tuple[str, ...], ...] = ()


_DEEPSEEK_ALIASES = (("n_routed_experts", "num_local_experts"), ("num_nextn_predict_layers", "num_mtp_layers"))
ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch("llama", "gqa", None),
    "qwen3": Arch("qwen3", "gqa", None),  # k_norm on each head before RoPE
    "qwen3_moe": Arch("qwen3_moe", "gqa", QWEN_EXPERTS, runner=True, routing_weights_in_act_dtype=True,
                      experts_key="num_experts", aliases=(("num_experts", "num_local_experts"),)),
    "mixtral": Arch("mixtral", "gqa", MIXTRAL_EXPERTS, runner=True, experts_key="num_local_experts",
                    aliases=(("num_local_experts", "num_experts"),)),
    "deepseek_v3": Arch("deepseek_v3", "mla", QWEN_EXPERTS, runner=True, rope_interleave=True, routing="noaux_tc",
                        aliases=_DEEPSEEK_ALIASES),
    # partial RoPE, optional qk norm
    "glm4_moe": Arch("glm4_moe", "gqa", QWEN_EXPERTS, runner=True, partial_rotary=0.5, routing="noaux_tc",
                     aliases=_DEEPSEEK_ALIASES),
    # MLA + DSA indexer (GLM-5); its RoPE is always the interleaved one (no config key; the runner does not run it)
    "glm_moe_dsa": Arch("glm_moe_dsa", "mla", QWEN_EXPERTS, routing="noaux_tc",
                        aliases=(("n_routed_experts", "num_local_experts", "num_experts"),)),
    # OLMoE: every layer MoE, no shared expert, q/k norms over the whole projection (not per head)
    "olmoe": Arch("olmoe", "gqa", QWEN_EXPERTS, qk_norm_whole=True, experts_key="num_experts",
                  aliases=(("num_experts", "num_local_experts"),)),
}
# Kimi K2's config.json says model_type "kimi_k2" (with remote code); the architecture is DeepSeek-V3's.
ALIASES = {"kimi_k2": "deepseek_v3"}


@dataclass(frozen=True)
class Wrapper:
    """A multimodal checkpoint whose text model sits in `config[text_key]`, its tensors under `prefix`."""

    text_key: str
    prefix: str
    default_inner: str  # the text model's model_type when its config omits it
    hf_text: str = ""  # where transformers' class holds the text model's `model.` (its decoder layers)


# Kimi K2.5 / K2.6: language_model.model.layers.*, language_model.lm_head, vision_tower.*, mm_projector.*;
# transformers' class names its text layers model.language_model.layers.*
WRAPPERS = {"kimi_k25": Wrapper("text_config", "language_model.", "deepseek_v3", "model.language_model.")}


def hf_module_name(module: str) -> str:
    """A wrapper's on-disk text module name (`language_model.model.layers...`) as transformers' class names
    it (`model.language_model.layers...`); other names unchanged."""
    for w in WRAPPERS.values():
        if w.hf_text and module.startswith(w.prefix + "model."):
            return w.hf_text + module.removeprefix(w.prefix + "model.")
    return module


def wrapper_prefixes() -> tuple[str, ...]:
    """The tensor-name prefixes of the wrappers' text models ("language_model.", ...)."""
    return tuple(w.prefix for w in WRAPPERS.values())
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES) + tuple(ALIASES) + tuple(WRAPPERS)
# The decoder-layer index in a tensor or module name ("model.layers.12.mlp..." -> 12): search, group 1.
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.")


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor or module name belongs to, or None."""
    m = LAYER_INDEX.search(name)
    return int(m[1]) if m else None


def traits(model_type: str) -> Arch | None:
    """The registry entry of a (text) model_type, aliases resolved; None when unknown."""
    return ARCHITECTURES.get(ALIASES.get(model_type, model_type))


def model_types(command: str) -> tuple[str, ...]:
    """The config.json model_type values `command` ("calibrate" | "runner") accepts: the registry's families
    with that trait, their aliases and, for calibration (the runner does not unwrap), the wrappers around them."""
    ok = [k for k, a in ARCHITECTURES.items() if getattr(a, command)]
    ok += [k for k, v in ALIASES.items() if v in ok]
    if command == "calibrate":
        ok += [k for k, w in WRAPPERS.items() if ALIASES.get(w.default_inner, w.default_inner) in ok]
    return tuple(ok)


def support_hint(command: str) -> str:
    """The hint of an UnsupportedArchitecture ("calibrate") or UnsupportedModel ("runner") about the model
    type: what the registry supports (errors.py cannot import this module, so raisers pass it)."""
    if command == "calibrate":
        return (f"calibration supports model_type {', '.join(model_types('calibrate'))}; RTN conversion "
                "(`quantkit convert --recipe int4-experts-rtn`) needs no calibration")
    return (f"the runner supports model_type {', '.join(model_types('runner'))}; run other models with "
            "transformers or an inference engine")


def text_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """(the text model's config, its tensor-name prefix): the config itself and "" unless it is a wrapper."""
    mt = config.get("model_type") if isinstance(config, Mapping) else None
    w = WRAPPERS.get(mt) if isinstance(mt, str) else None
    if w is None:
        return config, ""
    inner = config.get(w.text_key)
    if not isinstance(inner, Mapping):
        raise ConfigError(f"{config.get('model_type')} config.json has no {w.text_key} object")
    return inner, w.prefix


def family(config: Mapping[str, Any]) -> str:
    """The registry key of a config (aliases and wrappers resolved); ConfigError when unknown."""
    cfg, prefix = text_config(config)
    mt = cfg.get("model_type")
    if mt is None and prefix:
        mt = WRAPPERS[config["model_type"]].default_inner
    name = ALIASES.get(mt, mt) if isinstance(mt, str) else None
    if name not in ARCHITECTURES:
        outer = config.get("model_type") if isinstance(config, Mapping) else None
        raise ConfigError(f"model_type {str(outer or mt or '(missing)')[:40]!r} is not supported",
                          hint=f"supported model_type values: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return name


def arch_for(config: Mapping[str, Any], command: str | None = None) -> Arch:
    """The Arch of a config, checked for `command` ("calibrate" | "runner"); UnsupportedArchitecture else."""
    try:
        a = ARCHITECTURES[family(config)]
    except ConfigError as e:
        if command is None:
            raise
        raise UnsupportedArchitecture(f"{command}: {e.message}", hint=support_hint(command)) from None
    if command == "calibrate" and not a.calibrate:
        raise UnsupportedArchitecture(f"calibration does not support model_type {config.get('model_type')!r} yet",
                                      hint=support_hint(command))
    return a
