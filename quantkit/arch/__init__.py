"""Architectures as data: which model types quantkit knows, how each names its experts on disk, where a
multimodal wrapper keeps its text model, and what every command can do with each. Also the one reader
of config.json: `parse_config` reduces it to a validated `ModelSpec`, and `check_tensors` holds that
spec against the checkpoint's tensors (a config is hostile input: a field the tensors contradict, or
one beyond sane bounds, is a named error before anything is built).

Every command consults this registry: calibration (transformers builds the layers), the reference
runner, `plan`, `convert`'s fused-expert handling and `verify`.

Legend: D = hidden_size, V = vocab_size, H = attention heads, KV = key/value heads, hd = head_dim,
I = dense intermediate, Im = expert intermediate, E = routed experts, L = decoder layers (no MTP).
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, ConfigMismatch, UnsupportedArchitecture
from .layout import MIXTRAL_EXPERTS, QWEN_EXPERTS, ExpertNames  # noqa: F401 (the module names: arch/layout.py)
from .layout import (ATTN, DENSE_MLP, EXPERT_BLOCKS, EXPERTS, K, K_NORM, KV_A, KV_A_NORM, KV_B, LAYERS, O, Q, Q_A,
                     Q_A_NORM, Q_B, Q_NORM, ROUTER_MODULES, SHARED_EXPERT_PREFIX, SHARED_EXPERTS, V, LayerNames,
                     expert_parts, expert_role)


# ---- the registry ------------------------------------------------------------------------------------


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

# The hint of a config.json field of the wrong type or shape: transformers' own config classes never write one.
FIELD_HINT = ("transformers writes this field as the model's config class defines it: this config.json was edited "
              "or is corrupt; compare it with the model's own on the hub")

# first_k_dense_replace when config.json gives none (transformers' defaults; the other MoE families': 3)
_FIRST_DENSE = {"glm4_moe": 1}

# Sane bounds on what a config may claim (the largest real values are orders of magnitude below).
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 17
MAX_VOCAB = 1 << 23
MAX_EXPERTS = 1 << 14
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 12  # one attention head's width (real: 64 to 256; MLA's parts and ranks: 512)
MAX_INTERMEDIATE = 1 << 20  # a dense MLP's or one expert's width (real: at most ~53k)
MAX_POSITIONS = 1 << 30  # max_position_embeddings and RoPE's original context (real: at most ~10M)
# routed experts over every MoE layer, MTP included: what `plan` enumerates one by one (Kimi K2: 23,040)
MAX_ROUTED_EXPERTS = 1 << 17


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


# ---- config.json -> ModelSpec -------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """What quantkit needs from a config.json, normalized across architectures."""

    model_type: str  # as written in config.json (kimi_k2, kimi_k25, deepseek_v3, ...)
    arch: str  # registry key: deepseek_v3 | glm4_moe | glm_moe_dsa | qwen3_moe | mixtral | llama | qwen3
    prefix: str  # "" or "language_model." (Kimi K2.5 nests its text model)
    dtype: str  # safetensors dtype of unquantized tensors, e.g. "BF16"
    vocab_size: int
    hidden_size: int
    num_layers: int  # decoder layers that run in the forward pass (and cache KV)
    mtp_layers: int  # MTP layers stored after them (num_nextn_predict_layers)
    moe: tuple[bool, ...]  # per layer, MTP included: MoE block (True) or dense MLP
    intermediate_size: int  # I (dense MLP)
    moe_intermediate_size: int  # Im (one routed expert)
    num_experts: int  # E
    experts_per_tok: int
    shared_intermediate: int  # width of the fused shared expert MLP, 0 = none
    attention: str  # "gqa" (MHA/GQA) or "mla"
    num_heads: int
    num_kv_heads: int  # GQA: KV heads; MLA: 1 (one latent per token)
    head_dim: int
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    indexer: tuple[bool, ...] = ()  # per layer, MTP included: has a DSA indexer (glm_moe_dsa)
    index_n_heads: int = 0
    index_head_dim: int = 0
    tie_word_embeddings: bool = False
    router_bias: bool = False  # mlp.gate.e_score_correction_bias (noaux_tc routing)
    mtp_embeddings: bool = False  # MTP layers store their own embed_tokens / shared_head.head
    # routing, as the modeling files define it
    scoring: str = "softmax"  # softmax | sigmoid (DeepSeek/GLM: + correction bias, group-limited top-k)
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    quantization: Mapping[str, Any] | None = field(default=None, compare=False)
    text: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the text model's config

    @property
    def source_format(self) -> str:
        q = self.quantization
        if not q:
            return self.dtype.lower()
        if q.get("quant_method") == "fp8":
            return "fp8-block"
        return str(q.get("quant_method"))

    @property
    def experts(self) -> ExpertNames | None:
        return ARCHITECTURES[self.arch].experts if self.num_experts else None

    @property
    def qk_norm_widths(self) -> tuple[int, int]:
        """The widths of the q and k norm weights (when `qk_norm`): one head's, or the whole projection's."""
        if ARCHITECTURES[self.arch].qk_norm_whole:
            return self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.head_dim, self.head_dim


_TORCH_DTYPE = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32"}


class _Shown(reprlib.Repr):
    """Values in error messages: one line, a few dozen characters, huge integers by their size."""

    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxlist, self.maxdict, self.maxstring, self.maxother = 2, 4, 4, 40, 40

    def repr_int(self, x, level):
        if x.bit_length() > 64:
            return f"<a {'negative ' if x < 0 else ''}{x.bit_length()}-bit integer>"
        return int.__repr__(x)

    def repr_bool(self, x, level):
        return "true" if x else "false"  # as config.json spells it


_SHOWN = _Shown()


def _show(v: Any) -> str:
    """A config.json value as an error message shows it (JSON's true/false/null, strings quoted and cut)."""
    return "null" if v is None else _SHOWN.repr(v)


def _bad(key: str, v: Any, what: str) -> ConfigError:
    """The error of a field whose value is not `what` ("a positive integer", ...)."""
    return ConfigError(f"config.json {key!r} must be {what}, got {_show(v)}", hint=FIELD_HINT)


def _get(cfg: Mapping, key: str, default: Any = ...) -> Any:
    v = cfg.get(key, default)
    if v is ... or (v is None and default is ...):
        raise ConfigError(f"config.json has no {key!r}", hint="pass the model's own config.json (as on the hub)")
    return default if v is None else v  # null stands for the default, as transformers' configs read it


def _int(cfg: Mapping, key: str, default: Any = ..., upper: int | None = None, lo: int = 1, label: str = "") -> int:
    """An integer field in [lo, upper] (JSON true/false are not integers); null or absent: `default`. `label`:
    where the field sits, for the message ("rope_scaling.")."""
    v = _get(cfg, key, default)
    if v is None and default is None:
        return None
    key = label + key
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(key, v, "an integer")
    if v < lo:
        e = _bad(key, v, "a positive integer" if lo == 1 else f"an integer >= {lo}")
        e.field, e.value = key, _show(v)
        raise e
    if upper is not None and v > upper:
        e = ConfigError(f"config.json {key!r} = {_show(v)} is beyond any real model (at most {upper})",
                        hint="the config.json is corrupt or does not belong to these shards")
        e.field, e.value = key, _show(v)
        raise e
    return v


def _int_list(cfg: Mapping, key: str, upper: int) -> list[int]:
    """A list of layer indices (e.g. qwen3_moe's mlp_only_layers); null or absent is empty."""
    v = cfg.get(key)
    if v is None:
        return []
    if not isinstance(v, list) or any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < upper
                                       for x in v):
        raise ConfigError(f"config.json {key!r} must list layer indices below {upper}, got {_show(v)}",
                          hint=FIELD_HINT)
    return v


def _num(cfg: Mapping, key: str, default: float | None, *, positive: bool = True, upper: float | None = None,
         label: str = "") -> float:
    """A finite number (positive unless `positive` is false; at most `upper`); null or absent: `default`.
    Python's json reads NaN and Infinity literals, and 1e999 as infinity: all refused here."""
    v = cfg.get(key)
    if v is None:
        return default
    key = label + key
    what = "a positive finite number" if positive else "a finite number"
    if upper is not None:
        what += f" at most {upper:g}"
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _bad(key, v, what)
    x = float(v) if isinstance(v, float) or abs(v) < 1 << 1000 else math.inf
    if not math.isfinite(x) or (positive and x <= 0) or (upper is not None and x > upper):
        raise _bad(key, v, what)
    return x


def _bool(cfg: Mapping, key: str, default: bool) -> bool:
    """A JSON true/false field (an integer or a string is refused: bool("false") is True); null: `default`."""
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, v, "true or false")
    return v


def _str(cfg: Mapping, key: str, default: str | None, choices: tuple[str, ...] | None = None,
         label: str = "") -> str | None:
    """A string field (one of `choices` when given); null or absent: `default`."""
    v = cfg.get(key)
    if v is None:
        return default
    key = label + key
    if not isinstance(v, str) or len(v) > 200 or (choices is not None and v not in choices):
        raise _bad(key, v, "a string" if choices is None else "one of " + ", ".join(map(repr, choices)))
    return v


def _rope(cfg: Mapping) -> None:
    """RoPE's numbers (rope_theta, rope_parameters / rope_scaling, partial_rotary_factor) and the other
    floats the layers compute with: each finite and in range (the runner, calibration's transformers layers
    and export compute with them)."""
    _num(cfg, "rope_theta", None)
    rps = [cfg.get(k) for k in ("rope_parameters", "rope_scaling") if isinstance(cfg.get(k), Mapping)]
    if "rope_theta" in cfg and cfg["rope_theta"] is None and not any(rp.get("rope_theta") is not None for rp in rps):
        raise _bad("rope_theta", None, "a positive finite number")  # transformers computes RoPE with it: no default
    _num(cfg, "rms_norm_eps", None)
    _num(cfg, "partial_rotary_factor", None, upper=1.0)
    _int(cfg, "max_position_embeddings", None, upper=MAX_POSITIONS)
    _int(cfg, "original_max_position_embeddings", None, upper=MAX_POSITIONS)
    for key in ("rope_parameters", "rope_scaling"):
        rp = cfg.get(key)
        if rp is None:
            continue
        if not isinstance(rp, Mapping):
            raise _bad(key, rp, "an object")
        # transformers 5 may key the parameters by layer type ({"full_attention": {...}, ...})
        for name, sub in [("", rp)] + [(f"{k}.", v) for k, v in rp.items() if isinstance(v, Mapping)]:
            at = f"{key}.{name}"
            if sub is not rp and any(isinstance(v, Mapping) for v in sub.values()):
                raise _bad(key, rp, "an object of RoPE parameters")
            for t in ("rope_type", "type"):
                _str(sub, t, None, label=at)
            for f in ("rope_theta", "factor"):
                _num(sub, f, None, label=at)
            if "rope_theta" in sub and sub["rope_theta"] is None:
                raise _bad(f"{at}rope_theta", None, "a positive finite number")
            _num(sub, "partial_rotary_factor", None, upper=1.0, label=at)
            for f in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow", "low_freq_factor",
                      "high_freq_factor"):
                _num(sub, f, None, positive=False, label=at)
            _int(sub, "original_max_position_embeddings", None, upper=MAX_POSITIONS, label=at)


def _partial_rotary(cfg: Mapping, arch: str) -> float:
    """The fraction of a GQA head RoPE rotates: rope_parameters' or the config's partial_rotary_factor, else
    the family's default."""
    for key in ("rope_parameters", "rope_scaling"):
        rp = cfg.get(key)
        if isinstance(rp, Mapping) and rp.get("partial_rotary_factor") is not None:
            return float(rp["partial_rotary_factor"])
    p = cfg.get("partial_rotary_factor")
    return ARCHITECTURES[arch].partial_rotary if p is None else float(p)


def _dtype_of(cfg: Mapping) -> str:
    d = _str(cfg, "torch_dtype", None) or _str(cfg, "dtype", None) or "bfloat16"
    return _TORCH_DTYPE.get(str(d).replace("torch.", ""), "BF16")


def _indexer_types(cfg: Mapping, n: int) -> list[str]:
    """glm_moe_dsa: which layers run their own indexer ("full") or reuse the previous one ("shared").
    Same derivation as transformers' GlmMoeDsaConfig."""
    t = cfg.get("indexer_types")
    if t is None and cfg.get("index_topk_pattern") is not None:
        p = cfg["index_topk_pattern"]
        t = [{"F": "full", "S": "shared"}.get(c) for c in p] if isinstance(p, str) else p
    if t is None:
        freq = max(_int(cfg, "index_topk_freq", 1, upper=MAX_LAYERS, lo=0), 1)
        off = _int(cfg, "index_skip_topk_offset", 2, upper=MAX_LAYERS, lo=0)
        t = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if not isinstance(t, list) or len(t) < n or any(not isinstance(x, str) or x not in ("full", "shared") for x in t):
        raise ConfigError(f"config.json indexer_types must list 'full'/'shared' for all {n} layers", hint=FIELD_HINT)
    return list(t)


def parse_config(config: Mapping[str, Any]) -> ModelSpec:
    """A `ModelSpec` from a config.json dict; ConfigError for unsupported, incomplete or absurd configs
    (the error's `field` names the key). Every field read is checked for its type (JSON true/false is not an
    integer, nor an integer a boolean) and range (widths, heads, layers and ranks positive, floats finite), and
    the fields against each other (top-k within the experts, heads in whole KV groups, DeepSeek's group-limited
    routing, RoPE's rotated width even), so no later stage divides by zero, overflows or builds a layer that
    cannot run."""
    if not isinstance(config, Mapping):
        raise ConfigError("config.json must be a JSON object")
    model_type = config.get("model_type") or ""
    if not isinstance(model_type, str):
        raise ConfigError(f"config.json 'model_type' must be a string, got {_show(model_type)}", hint=FIELD_HINT)
    cfg, prefix = text_config(config)
    spec = _parse(config, cfg, prefix, model_type)
    _consistent(spec, cfg)
    return spec


def _parse(config: Mapping[str, Any], cfg: Mapping[str, Any], prefix: str, model_type: str) -> ModelSpec:
    """Each field, read and checked on its own (`_consistent` then holds them against each other)."""
    arch = family(config)
    gqa_family = ARCHITECTURES[arch].attention == "gqa"
    _aliases_agree(arch, cfg)
    quant = config.get("quantization_config") or cfg.get("quantization_config")
    if quant is not None and not isinstance(quant, Mapping):
        raise ConfigError("config.json quantization_config must be an object", hint=FIELD_HINT)

    D, L = _int(cfg, "hidden_size", upper=MAX_HIDDEN), _int(cfg, "num_hidden_layers", upper=MAX_LAYERS)
    V, H = _int(cfg, "vocab_size", upper=MAX_VOCAB), _int(cfg, "num_attention_heads", upper=MAX_HEADS)
    kv_heads = _int(cfg, "num_key_value_heads", H, upper=MAX_HEADS)  # null: one KV head per head (transformers)
    if H % kv_heads:
        raise ConfigError(f"config.json num_attention_heads {H} is not a multiple of num_key_value_heads {kv_heads}",
                          hint=FIELD_HINT)
    _rope(cfg)
    _str(cfg, "hidden_act", None)  # transformers looks it up by name
    if cfg.get("head_dim") is not None:
        head_dim = _int(cfg, "head_dim", upper=MAX_HEAD_DIM)
    elif gqa_family and D % H:
        raise ConfigError(f"config.json hidden_size {D} is not a multiple of num_attention_heads {H}, and no head_dim "
                          "is given", hint=FIELD_HINT)
    else:
        head_dim = max(D // H, 1)  # MLA families: transformers sets head_dim itself (the RoPE part), unused here
        if head_dim > MAX_HEAD_DIM and gqa_family:
            raise ConfigError(f"config.json hidden_size {D} / num_attention_heads {H} = head_dim {head_dim} is beyond "
                              f"any real model (at most {MAX_HEAD_DIM})", hint=FIELD_HINT)
    if gqa_family:
        partial = _partial_rotary(cfg, arch)
        rot = int(head_dim * partial)
        if rot < 2 or rot % 2:
            raise ConfigError(f"config.json head_dim {head_dim} with partial_rotary_factor {partial:g} rotates {rot} "
                              "dimensions; RoPE rotates pairs (an even number, at least 2)", hint=FIELD_HINT)
    mtp = _int(cfg, _key(arch, cfg, "num_nextn_predict_layers"), 0, upper=MAX_LAYERS, lo=0) \
        if arch in ("deepseek_v3", "glm4_moe", "glm_moe_dsa") else 0
    n_all = L + mtp
    common = dict(model_type=model_type, arch=arch, prefix=prefix, dtype=_dtype_of(cfg), vocab_size=V,
                  hidden_size=D, num_layers=L, mtp_layers=mtp, num_heads=H,
                  tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False), quantization=quant, text=cfg)
    top_k = lambda: _int(cfg, "num_experts_per_tok", upper=MAX_EXPERTS, lo=0)  # noqa: E731 (held to E below)
    width = lambda key: _int(cfg, key, upper=MAX_INTERMEDIATE)  # noqa: E731

    if arch in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        E = _int(cfg, _key(arch, cfg, "n_routed_experts"), upper=MAX_EXPERTS, lo=0)
        default_dense = _FIRST_DENSE.get(arch, 3)
        first_dense = min(default_dense, L)
        if cfg.get("first_k_dense_replace") is not None:
            first_dense = _int(cfg, "first_k_dense_replace", lo=0)
            if first_dense > L:
                raise ConfigError(f"config.json first_k_dense_replace {_show(first_dense)} is more than "
                                  f"num_hidden_layers {L}", hint=FIELD_HINT)
        if arch == "glm_moe_dsa":
            types = cfg.get("mlp_layer_types") or ["dense"] * first_dense + ["sparse"] * (L - first_dense)
            if not isinstance(types, list) or len(types) < L or any(t not in ("dense", "sparse") for t in types[:L]):
                raise ConfigError(f"config.json mlp_layer_types must list 'dense'/'sparse' for all {L} layers, got "
                                  f"{_show(types)}", hint=FIELD_HINT)
            moe = tuple(t == "sparse" for t in types[:L]) + (True,) * mtp  # the MTP layer is an MoE layer
        else:
            freq = _int(cfg, "moe_layer_freq", 1, upper=MAX_LAYERS, lo=0) or 1
            moe = tuple(i >= first_dense and i % freq == 0 for i in range(n_all))
        inter, moe_inter = width("intermediate_size"), width("moe_intermediate_size")
        _str(cfg, "topk_method", None)
        moe_common = dict(moe=moe, intermediate_size=inter, moe_intermediate_size=moe_inter, num_experts=E,
                          experts_per_tok=top_k(),
                          shared_intermediate=moe_inter * _int(cfg, "n_shared_experts", 0, upper=MAX_EXPERTS, lo=0),
                          router_bias=True, mtp_embeddings=arch in ("deepseek_v3", "glm4_moe"),
                          scoring=_str(cfg, "scoring_func", "sigmoid", ("sigmoid", "softmax")),
                          norm_topk_prob=_bool(cfg, "norm_topk_prob", True),
                          n_group=_int(cfg, "n_group", 1, upper=MAX_EXPERTS),
                          topk_group=_int(cfg, "topk_group", 1, upper=MAX_EXPERTS),
                          routed_scaling_factor=_num(cfg, "routed_scaling_factor", 1.0))
        bias = _bool(cfg, "attention_bias", False)
        if arch == "glm4_moe":  # GQA; attention_bias adds q/k/v biases only (o_proj has none)
            return ModelSpec(**common, **moe_common, attention="gqa", num_kv_heads=kv_heads, head_dim=head_dim,
                             qkv_bias=bias, qk_norm=_bool(cfg, "use_qk_norm", False))
        nope, rope = _int(cfg, "qk_nope_head_dim", upper=MAX_HEAD_DIM), _int(cfg, "qk_rope_head_dim", upper=MAX_HEAD_DIM)
        if rope % 2:
            raise ConfigError(f"config.json qk_rope_head_dim {rope} must be even (RoPE rotates pairs)", hint=FIELD_HINT)
        mla = dict(attention="mla", num_kv_heads=1, head_dim=nope + rope,
                   q_lora_rank=_int(cfg, "q_lora_rank", None, upper=MAX_HIDDEN),  # null: one q_proj (V2-Lite)
                   kv_lora_rank=_int(cfg, "kv_lora_rank", upper=MAX_HIDDEN), qk_rope_head_dim=rope,
                   qk_nope_head_dim=nope, v_head_dim=_int(cfg, "v_head_dim", upper=MAX_HEAD_DIM), qkv_bias=bias,
                   o_bias=bias)
        if arch == "glm_moe_dsa":
            if not mla["q_lora_rank"]:
                raise ConfigError("glm_moe_dsa config.json needs q_lora_rank (the indexer reads the q latent)")
            types = _indexer_types(cfg, L)
            # The MTP layer of GLM-5 ships its own indexer (model.layers.78.self_attn.indexer.*).
            indexer = tuple(t == "full" for t in types[:L]) + (True,) * mtp
            index_dim = _int(cfg, "index_head_dim", upper=MAX_HEAD_DIM)
            if index_dim < rope:
                raise ConfigError(f"config.json index_head_dim {index_dim} is less than qk_rope_head_dim {rope} (the "
                                  "indexer rotates that many of its dimensions)", hint=FIELD_HINT)
            _int(cfg, "index_topk", 2048, upper=MAX_POSITIONS)
            return ModelSpec(**common, **moe_common, **mla, indexer=indexer,
                             index_n_heads=_int(cfg, "index_n_heads", upper=MAX_HEADS), index_head_dim=index_dim)
        return ModelSpec(**common, **moe_common, **mla)

    gqa = dict(attention="gqa", num_kv_heads=kv_heads, head_dim=head_dim)
    if arch == "qwen3_moe":
        E = _int(cfg, _experts_key(arch, cfg), upper=MAX_EXPERTS, lo=0)  # 0: every layer dense (transformers)
        step = _int(cfg, "decoder_sparse_step", 1, upper=MAX_LAYERS)
        only = set(_int_list(cfg, "mlp_only_layers", MAX_LAYERS))
        moe = tuple(i not in only and E > 0 and (i + 1) % step == 0 for i in range(L))
        bias = _bool(cfg, "attention_bias", False)
        _bool(cfg, "use_sliding_window", False)
        return ModelSpec(**common, **gqa, moe=moe, intermediate_size=width("intermediate_size"),
                         moe_intermediate_size=width("moe_intermediate_size"), num_experts=E,
                         experts_per_tok=top_k(), shared_intermediate=0, qkv_bias=bias, o_bias=bias, qk_norm=True,
                         norm_topk_prob=_bool(cfg, "norm_topk_prob", False))
    if arch == "olmoe":  # intermediate_size is the routed expert's width; no dense MLP
        inter = width("intermediate_size")
        bias = _bool(cfg, "attention_bias", False)
        _num(cfg, "clip_qkv", None)  # null: no clipping
        return ModelSpec(**common, **gqa, moe=(True,) * L, intermediate_size=inter, moe_intermediate_size=inter,
                         num_experts=_int(cfg, _experts_key(arch, cfg), upper=MAX_EXPERTS, lo=0),
                         experts_per_tok=top_k(), shared_intermediate=0, qkv_bias=bias, o_bias=bias, qk_norm=True,
                         norm_topk_prob=_bool(cfg, "norm_topk_prob", False))
    if arch == "mixtral":
        inter = width("intermediate_size")
        return ModelSpec(**common, **gqa, moe=(True,) * L, intermediate_size=inter, moe_intermediate_size=inter,
                         num_experts=_int(cfg, _experts_key(arch, cfg), upper=MAX_EXPERTS, lo=0),
                         experts_per_tok=top_k(), shared_intermediate=0, norm_topk_prob=True)
    bias = _bool(cfg, "attention_bias", False)  # llama, qwen3 (dense)
    return ModelSpec(**common, **gqa, moe=(False,) * L, intermediate_size=width("intermediate_size"),
                     moe_intermediate_size=0, num_experts=0, experts_per_tok=0, shared_intermediate=0,
                     qkv_bias=bias, o_bias=bias, qk_norm=arch == "qwen3",
                     mlp_bias=_bool(cfg, "mlp_bias", False) and arch == "llama")


def _experts_key(arch: str, cfg: Mapping[str, Any]) -> str:
    """The config field counting the routed experts, as this config spells it (qwen3_moe: transformers 5 writes
    num_local_experts; glm_moe_dsa reads num_experts too)."""
    return _key(arch, cfg, ARCHITECTURES[arch].experts_key)


def _key(arch: str, cfg: Mapping[str, Any], key: str) -> str:
    """How config.json spells field `key`: `key` itself, else the first name transformers' config class reads as
    the same field (`Arch.aliases`) that the config gives; `key` when it gives none."""
    group = next((g for g in ARCHITECTURES[arch].aliases if key in g), ())
    return next((k for k in (key, *group) if cfg.get(k) is not None), key)


def _aliases_agree(arch: str, cfg: Mapping[str, Any]) -> None:
    """Two spellings of one field (n_routed_experts and num_local_experts) must give the same value:
    transformers keeps whichever comes last in the file, so engines may read either."""
    for group in ARCHITECTURES[arch].aliases:
        given = [(k, cfg[k]) for k in group if cfg.get(k) is not None]
        if any(v != given[0][1] or type(v) is not type(given[0][1]) for _, v in given[1:]):
            shown = " and ".join(f"{k} = {_show(v)}" for k, v in given)
            raise ConfigError(f"config.json gives {shown}: one field to transformers, which keeps whichever comes "
                              "last", hint=FIELD_HINT)


def _consistent(spec: ModelSpec, cfg: Mapping[str, Any]) -> None:
    """The fields of a parsed config against each other: the routed experts and top-k of MoE layers, and
    DeepSeek/GLM group-limited routing (transformers' router takes the best 2 of each group, then `topk_group`
    groups, then top-k of their experts)."""
    n_moe = sum(spec.moe)
    if not n_moe:
        return
    E, k, key = spec.num_experts, spec.experts_per_tok, _experts_key(spec.arch, cfg)
    if E < 1:
        raise ConfigError(f"config.json {key} is 0, yet {n_moe} layer(s) are MoE layers", hint=FIELD_HINT)
    if not 1 <= k <= E:
        raise ConfigError(f"config.json num_experts_per_tok {k} must be between 1 and the {E} routed experts ({key})",
                          hint=FIELD_HINT)
    if E * n_moe > MAX_ROUTED_EXPERTS:
        e = ConfigError(f"config.json {key} = {E} over {n_moe} MoE layers is {E * n_moe} routed experts, beyond any "
                        f"real model (at most {MAX_ROUTED_EXPERTS})",
                        hint="the config.json is corrupt or does not belong to these shards")
        e.field, e.value = key, E
        raise e
    if ARCHITECTURES[spec.arch].routing == "noaux_tc":
        G, TG = spec.n_group, spec.topk_group
        if E % G or E // G < 2:
            raise ConfigError(f"config.json {key} {E} must split into n_group {G} groups of at least 2 experts each",
                              hint=FIELD_HINT)
        if TG > G:
            raise ConfigError(f"config.json topk_group {TG} is more than n_group {G}", hint=FIELD_HINT)
        if k > TG * (E // G):
            raise ConfigError(f"config.json num_experts_per_tok {k} is more than the {TG * (E // G)} experts of the "
                              f"topk_group {TG} groups routing chooses ({E // G} experts each)", hint=FIELD_HINT)


# ---- the config against the tensors ------------------------------------------------------------------
def _expert_rx(p: str) -> re.Pattern:
    """Per-expert tensors of a checkpoint whose text model sits under prefix `p`: groups layer, expert."""
    return re.compile(re.escape(p) + r"model\.layers\.(\d{1,9})\.(?:mlp|block_sparse_moe)\.experts\.(\d{1,9})\.")


def check_tensors(spec: ModelSpec, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Hold `spec` against a checkpoint's tensors (name -> shape): the embedding's vocab and hidden size, the
    number of decoder layers, the routed experts of each MoE layer and their widths, and in each layer the shards
    hold: the dense/MoE layout (an MoE layer holds routed experts and a router, a dense one a dense MLP and
    neither), the shared expert, the dense MLP's width and every attention projection (`_check_layer`). Raises
    ConfigMismatch naming the config field and the tensor that disagree. Shapes are read from `<module>.weight`
    tensors (dense or FP8); a module stored in another form counts only as present. Layers beyond `num_layers`
    are allowed only as MTP layers; tensors of other modalities (wrappers) are not looked at. One pass over the
    names (Kimi K2: ~10^5)."""
    p = spec.prefix
    emb = shapes.get(f"{p}model.embed_tokens.weight")
    if emb is not None and len(emb) == 2:
        if emb[1] != spec.hidden_size:
            _mismatch("hidden_size", spec.hidden_size, f"{p}model.embed_tokens.weight", emb)
        if emb[0] != spec.vocab_size:
            _mismatch("vocab_size", spec.vocab_size, f"{p}model.embed_tokens.weight", emb)
    layers: set[int] = set()
    experts: dict[int, set[int]] = {}
    fused: dict[int, int] = {}
    routed: dict[int, str] = {}  # layer -> the first routed-expert tensor it holds
    held: dict[int, dict[str, tuple[int, ...] | None]] = {}  # layer -> module -> its .weight shape (None: absent)
    expert_weights: dict[str, tuple[int, ...]] = {}
    ex = _expert_rx(p)
    fx = re.compile(re.escape(p) + r"model\.layers\.(\d{1,9})\.mlp\.experts\.(?:gate_up_proj|down_proj)$")
    head, routed_part = f"{p}{LAYERS}.", f".{EXPERTS}."
    for name, shape in shapes.items():
        if not name.startswith(head):
            continue
        idx = layer_index(name)
        if idx is None:  # e.g. a 5,000-digit "index": not a decoder layer of any model
            shown = name if len(name) <= 80 else name[:77] + "..."
            raise ConfigMismatch(f"tensor {shown!r} is under model.layers. without a decoder-layer index "
                                 f"(at most 9 digits)")
        layers.add(idx)
        if routed_part in name:
            routed.setdefault(idx, name)
            e = ex.match(name)
            if e:
                experts.setdefault(int(e[1]), set()).add(int(e[2]))
                if name.endswith(".weight"):
                    expert_weights[name] = shape
            f = fx.match(name)
            if f and len(shape) == 3:
                fused[int(f[1])] = shape[0]
            continue
        module, _, leaf = name.rpartition(".")
        mods = held.setdefault(idx, {})
        if leaf == "weight":
            mods[module] = tuple(shape)
        else:
            mods.setdefault(module, None)
    if layers:
        top = max(layers)
        if top >= spec.num_layers + spec.mtp_layers:
            _mismatch("num_hidden_layers", spec.num_layers, f"{p}model.layers.{top}.*", None,
                      f"the shards hold layer {top}")
        gap = next((i for i in range(spec.num_layers) if i not in layers), None)  # O(layers on disk)
        if gap is not None:
            _mismatch("num_hidden_layers", spec.num_layers, f"{p}model.layers.{gap}.*", None,
                      f"the shards hold no layer {gap}")
    key = _experts_key(spec.arch, spec.text)
    for layer in sorted(set(experts) | set(fused)):
        ids = experts.get(layer, set())
        count = fused.get(layer, max(ids) + 1 if ids else 0)
        if count != spec.num_experts or (ids and len(ids) != count):
            _mismatch(key, spec.num_experts, f"{p}model.layers.{layer}.*.experts.*", None,
                      f"layer {layer} stores {count if not ids or len(ids) == count else len(ids)} routed experts")
    check_expert_shapes(spec, expert_weights)
    for i in sorted(layers):
        _check_layer(spec, i, held.get(i, {}), routed.get(i))


def _held(mods: Mapping[str, tuple[int, ...] | None], module: str) -> str:
    """The tensor to name for a module the shards hold: its weight, or all of it when stored in another form."""
    return f"{module}.weight" if mods.get(module) is not None else f"{module}.*"


def _check_shape(mods: Mapping[str, tuple[int, ...] | None], module: str, want: tuple[int, ...],
                 fields: tuple[tuple[str, Any], ...], formula: str) -> None:
    """`module`'s weight, when the shards hold it as `.weight`, against `want`; a dimension that differs names
    its field (`fields[d]`: config key, value). `formula`: how the config implies `want`, for the message."""
    shape = mods.get(module)
    if shape is None or len(shape) != len(want) or shape == want:
        return
    d = next(k for k in range(len(want)) if shape[k] != want[k])
    _mismatch(fields[d][0], fields[d][1], f"{module}.weight", shape,
              f"shape {list(shape)}, the config implies {list(want)} = [{formula}]")


def _layout_field(spec: ModelSpec, i: int) -> tuple[str, Any]:
    """(config key, value as shown) of the field that makes layer `i` an MoE layer or a dense one."""
    cfg, a = spec.text, spec.arch
    if i >= spec.num_layers:
        return _key(a, cfg, "num_nextn_predict_layers"), spec.mtp_layers
    if ARCHITECTURES[a].experts is None:
        return "model_type", _show(spec.model_type)
    if a in ("mixtral", "olmoe") or not spec.num_experts:
        return _experts_key(a, cfg), spec.num_experts
    if a == "qwen3_moe":
        only = _int_list(cfg, "mlp_only_layers", MAX_LAYERS)
        if i in only or (spec.moe[i] and only):
            return "mlp_only_layers", _show(only)
        return "decoder_sparse_step", cfg.get("decoder_sparse_step") or 1
    if a == "glm_moe_dsa" and cfg.get("mlp_layer_types"):
        return "mlp_layer_types", _show(cfg["mlp_layer_types"])
    first = cfg.get("first_k_dense_replace")
    first = min(_FIRST_DENSE.get(a, 3), spec.num_layers) if first is None else first
    freq = (cfg.get("moe_layer_freq") or 1) if a == "deepseek_v3" else 1
    if i >= first and freq > 1:
        return "moe_layer_freq", freq
    return "first_k_dense_replace", first


def _check_layer(spec: ModelSpec, i: int, mods: Mapping[str, tuple[int, ...] | None], routed: str | None) -> None:
    """Decoder layer `i` as the shards hold it (`mods`: its modules other than routed experts -> their weight's
    shape; `routed`: a routed-expert tensor it holds, or None) against the spec: attention, then its MLP."""
    if i >= len(spec.moe):
        return
    ln = LayerNames(spec.prefix, i, ARCHITECTURES[spec.arch].experts or QWEN_EXPERTS)
    if spec.attention == "mla":
        _check_mla(spec, ln, mods)
    else:
        _check_gqa(spec, ln, mods)
    D, I = spec.hidden_size, spec.intermediate_size
    dense = [f"{ln.dense_mlp}.{proj}" for proj in (DENSE_MLP.gate, DENSE_MLP.up, DENSE_MLP.down)]
    routers = [m for m in (f"{ln.layer}.{r}" for r in ROUTER_MODULES) if m in mods]
    shared_at = tuple(f"{ln.layer}.{b}.{SHARED_EXPERT_PREFIX}" for b in EXPERT_BLOCKS)
    shared = next((m for m in mods if m.startswith(shared_at)), None)
    field_, value = _layout_field(spec, i)
    if not spec.moe[i]:
        found = routed or (f"{routers[0]}.*" if routers else None) or (_held(mods, shared) if shared else None)
        if found:
            what = "routed experts" if routed else "a router" if routers else "a shared expert"
            _mismatch(field_, value, found, None, f"the config makes layer {i} dense; the shards hold {what} there")
        for module in dense:
            if module not in mods:
                _mismatch(field_, value, f"{module}.weight", None,
                          f"the config makes layer {i} dense; the shards hold no {module.rsplit('.', 1)[1]} there")
        for module, want, fields in zip(dense, ((I, D), (I, D), (D, I)), (("intermediate_size", "hidden_size"),) * 2
                                        + (("hidden_size", "intermediate_size"),)):
            _check_shape(mods, module, want, tuple((f, getattr(spec, f)) for f in fields),
                         ", ".join(fields))
        return
    if routed is None:
        found = next((m for m in dense if m in mods), None)
        _mismatch(field_, value, _held(mods, found) if found else f"{ln.mlp}.{EXPERTS}.*", None,
                  f"the config makes layer {i} an MoE layer; the shards hold "
                  f"{'a dense MLP' if found else 'no routed experts'} there")
    if not routers:
        raise ConfigMismatch(f"layer {i} holds routed experts but no router ({ln.router}.weight): the shards are "
                             "incomplete")
    key = _experts_key(spec.arch, spec.text)
    _check_shape(mods, routers[0], (spec.num_experts, D), ((key, spec.num_experts), ("hidden_size", D)),
                 f"{key}, hidden_size")
    S = spec.shared_intermediate
    n_shared = ("n_shared_experts", spec.text.get("n_shared_experts") or 0) \
        if spec.arch in ("deepseek_v3", "glm4_moe", "glm_moe_dsa") else ("model_type", _show(spec.model_type))
    if S and shared is None:
        _mismatch(*n_shared, f"{ln.shared}.*", None,
                  f"the config gives layer {i} a shared expert {S} wide; the shards hold none")
    if not S and shared is not None:
        _mismatch(*n_shared, _held(mods, shared), None, f"the config gives layer {i} no shared expert; the shards "
                                                        "hold one")
    if S:
        for proj, want in ((DENSE_MLP.gate, (S, D)), (DENSE_MLP.up, (S, D)), (DENSE_MLP.down, (D, S))):
            dims = (n_shared, ("hidden_size", D)) if want[0] == S else (("hidden_size", D), n_shared)
            _check_shape(mods, f"{ln.shared}.{proj}", want, dims,
                         ", ".join("n_shared_experts x moe_intermediate_size" if w == S else "hidden_size"
                                   for w in want))


def _check_gqa(spec: ModelSpec, ln: LayerNames, mods: Mapping[str, tuple[int, ...] | None]) -> None:
    """q/k/v/o_proj [H*hd, D], [KV*hd, D], [KV*hd, D], [D, H*hd] and the q/k norms' widths."""
    H, KV, hd, D = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    explicit = spec.text.get("head_dim") is not None
    hd_is = "head_dim" if explicit else "head_dim (hidden_size / num_attention_heads)"
    heads, kv, hidden = ("num_attention_heads", H), ("num_key_value_heads", KV), ("hidden_size", D)
    if spec.qk_norm:
        qw, kw = spec.qk_norm_widths
        if ARCHITECTURES[spec.arch].qk_norm_whole:
            norms = ((Q_NORM, qw, heads, f"num_attention_heads x {hd_is}"),
                     (K_NORM, kw, kv, f"num_key_value_heads x {hd_is}"))
        else:
            f = ("head_dim", hd) if explicit else heads
            norms = ((Q_NORM, qw, f, hd_is), (K_NORM, kw, f, hd_is))
        for proj, want, f, formula in norms:
            _check_shape(mods, ln.att(proj), (want,), (f,), formula)
    for proj, want, fields, formula in (
            (Q, (H * hd, D), (heads, hidden), f"num_attention_heads x {hd_is}, hidden_size"),
            (K, (KV * hd, D), (kv, hidden), f"num_key_value_heads x {hd_is}, hidden_size"),
            (V, (KV * hd, D), (kv, hidden), f"num_key_value_heads x {hd_is}, hidden_size"),
            (O, (D, H * hd), (hidden, heads), f"hidden_size, num_attention_heads x {hd_is}")):
        _check_shape(mods, ln.att(proj), want, fields, formula)


def _check_mla(spec: ModelSpec, ln: LayerNames, mods: Mapping[str, tuple[int, ...] | None]) -> None:
    """MLA's projections: q_a_proj [rq, D], q_a_layernorm [rq], q_b_proj [H*(nope+rope), rq] (or one q_proj
    [H*(nope+rope), D] when q_lora_rank is null), kv_a_layernorm [rkv], kv_a_proj_with_mqa [rkv+rope, D],
    kv_b_proj [H*(nope+v), rkv], o_proj [D, H*v]. Which of heads, nope and v is wrong is solved from the three
    projections that share them, when all three are stored as weights."""
    H, D, rq, rkv = spec.num_heads, spec.hidden_size, spec.q_lora_rank, spec.kv_lora_rank
    nope, rope, v = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    a = ln.att
    q_rank = ("q_lora_rank", "null" if rq is None else rq)
    if rq is None and a(Q_A) in mods:
        _mismatch(*q_rank, _held(mods, a(Q_A)), None, "the config has one q_proj and no q latent; the shards hold "
                                                      "q_a_proj")
    if rq is not None and a(Q_A) not in mods:
        _mismatch(*q_rank, f"{a(Q_A)}.weight", None, f"the shards hold no q_a_proj"
                                                      f"{' but a q_proj' if a(Q) in mods else ''}")
    hidden, kv_rank, rope_f = ("hidden_size", D), ("kv_lora_rank", rkv), ("qk_rope_head_dim", rope)
    if rq is not None:
        _check_shape(mods, a(Q_A), (rq, D), (q_rank, hidden), "q_lora_rank, hidden_size")
        _check_shape(mods, a(Q_A_NORM), (rq,), (q_rank,), "q_lora_rank")
    _check_shape(mods, a(KV_A_NORM), (rkv,), (kv_rank,), "kv_lora_rank")
    _check_shape(mods, a(KV_A), (rkv + rope, D), (rope_f if mods.get(a(KV_A_NORM)) else kv_rank, hidden),
                 "kv_lora_rank + qk_rope_head_dim, hidden_size")
    q_out = mods.get(a(Q_B) if rq is not None else a(Q))
    kvb, o = mods.get(a(KV_B)), mods.get(a(O))
    culprit = ("num_attention_heads", H)
    if q_out and kvb and o and len(q_out) == len(kvb) == len(o) == 2:
        hr = o[1] + q_out[0] - kvb[0]  # H*v + H*(nope+rope) - H*(nope+v) = H*rope
        if hr % rope == 0 and hr // rope == H:
            culprit = ("v_head_dim", v) if o[1] != H * v else ("qk_nope_head_dim", nope)
    q_formula = "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)"
    if rq is not None:
        _check_shape(mods, a(Q_B), (H * (nope + rope), rq), (culprit, q_rank), f"{q_formula}, q_lora_rank")
    else:
        _check_shape(mods, a(Q), (H * (nope + rope), D), (culprit, hidden), f"{q_formula}, hidden_size")
    _check_shape(mods, a(KV_B), (H * (nope + v), rkv), (culprit, kv_rank),
                 "num_attention_heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank")
    _check_shape(mods, a(O), (D, H * v), (hidden, culprit), "hidden_size, num_attention_heads x v_head_dim")


def check_expert_shapes(spec: ModelSpec, weights: Mapping[str, tuple[int, ...]]) -> None:
    """Each routed expert's weight (module + ".weight" -> [out, in]; a packed module's logical shape, as
    read/sources.py decodes it from its headers and weight_shape) against the config: gate/up [width, hidden],
    down [hidden, width]. ConfigMismatch names the field and the tensor: a config that disagrees with the
    experts it ships would be copied into the output and refused by every engine that loads it."""
    p = spec.prefix
    ex = _expert_rx(p)
    width_field = "intermediate_size" if spec.arch in ("mixtral", "olmoe") else "moe_intermediate_size"
    h, w = spec.hidden_size, spec.moe_intermediate_size
    for name, shape in weights.items():
        parts = expert_parts(name[: -len(".weight")]) if name.endswith(".weight") and ex.match(name) else None
        role = expert_role(parts[2]) if parts else None
        if role is None or len(shape) != 2:
            continue
        want = (h, w) if role == "down" else (w, h)
        if tuple(shape) != want:
            hidden_off = shape[0 if role == "down" else 1] != h
            field_, value = ("hidden_size", h) if hidden_off else (width_field, w)
            _mismatch(field_, value, name, shape, f"shape {list(shape)}, the config implies {list(want)}")


def _mismatch(field_: str, value, tensor: str, shape, detail: str | None = None):
    what = detail or f"shape {list(shape)}"
    raise ConfigMismatch(f"config.json {field_} = {value} contradicts {tensor} ({what})")


# ---- on-disk expert layouts ---------------------------------------------------------------------------
_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)(?:\.weight)?$")


def fused_experts(name: str, shape: tuple[int, ...], hidden: int | None = None):
    """Per-expert (module, expert, rows, [N, K]) of a fused 3-D expert tensor in the transformers layout
    (`experts.gate_up_proj` [E, 2*Im, D] with gate rows first, `experts.down_proj` [E, D, Im]); None if
    `name` is not one. With `hidden`, a tensor in another orientation is an error."""
    m = _FUSED.match(name)
    if not m or len(shape) != 3:
        return None
    e_count, a, b = shape
    prefix, kind = m["prefix"], m["kind"]
    if hidden is not None and not (b == hidden if kind == "gate_up_proj" else a == hidden):
        raise ConfigError(f"fused expert tensor {name} {list(shape)} is not in the [experts, out, in] layout",
                          hint="only the transformers layout gate_up_proj [E, 2*I, H] / down_proj [E, H, I] "
                               "is supported")
    out = []
    for e in range(e_count):
        if kind == "gate_up_proj":
            half = a // 2
            out.append((f"{prefix}.{e}.gate_proj", e, (0, half), (half, b)))
            out.append((f"{prefix}.{e}.up_proj", e, (half, a), (half, b)))
        else:
            out.append((f"{prefix}.{e}.down_proj", e, (0, a), (a, b)))
    return out


def validate(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> ModelSpec | None:
    """Hold a checkpoint's config.json against its tensors before anything is built from it: parse it and
    `check_tensors` (ConfigMismatch names the field and the tensor). A value beyond the sanity bounds is
    reported against the tensors too when they show the real one. A model type the registry does not know
    is not checked (None): model-free conversions stream any architecture (a model_type that is not a string
    is refused: the output's config.json would carry it to every loader)."""
    mt = config.get("model_type") if isinstance(config, Mapping) else None
    if mt is not None and not isinstance(mt, str):
        raise ConfigError(f"config.json 'model_type' must be a string, got {str(mt)[:40]}", hint=FIELD_HINT)
    try:
        family(config)
    except ConfigError:
        return None
    try:
        spec = parse_config(config)
    except ConfigError as e:
        field_ = getattr(e, "field", None)
        seen = _evidence(field_, shapes, text_config(config)[1]) if field_ else None
        if seen:
            _mismatch(field_, e.value, seen[0], None, seen[1])
        raise
    check_tensors(spec, shapes)
    return spec


def _evidence(field_: str, shapes: Mapping[str, tuple[int, ...]], p: str) -> tuple[str, str] | None:
    """(tensor, what it shows) for the real value of a config field, when the tensors show it."""
    emb = f"{p}model.embed_tokens.weight"
    if field_ in ("hidden_size", "vocab_size") and emb in shapes and len(shapes[emb]) == 2:
        return emb, f"shape {list(shapes[emb])}"
    if field_ == "num_hidden_layers":
        layers = {i for n in shapes if n.startswith(f"{p}model.layers.") and (i := layer_index(n)) is not None}
        if layers:
            return f"{p}model.layers.{max(layers)}.*", f"the shards' last layer is {max(layers)}"
    if field_ in ("num_experts", "num_local_experts", "n_routed_experts"):
        ex = _expert_rx(p)
        ids = [(int(m[1]), int(m[2])) for n in shapes if (m := ex.match(n))]
        if ids:
            layer = ids[0][0]
            n = 1 + max(e for lay, e in ids if lay == layer)
            return f"{p}model.layers.{layer}.*.experts.*", f"layer {layer} stores {n} routed experts"
    module = _EVIDENCE.get(field_)
    if module:
        name = next((n for n in shapes if n.startswith(f"{p}model.layers.") and n.endswith(f".{module}.weight")), None)
        if name:
            return name, f"shape {list(shapes[name])}"
    return None


# the module whose weight shows a field's real value (heads: with head_dim; MLA: with the other ranks)
_EVIDENCE = {"num_attention_heads": f"{ATTN}.{Q}", "num_key_value_heads": f"{ATTN}.{K}", "head_dim": f"{ATTN}.{Q}",
             "q_lora_rank": f"{ATTN}.{Q_A}", "kv_lora_rank": f"{ATTN}.{KV_A_NORM}",
             "qk_rope_head_dim": f"{ATTN}.{KV_A}", "qk_nope_head_dim": f"{ATTN}.{KV_B}", "v_head_dim": f"{ATTN}.{O}",
             "intermediate_size": f"{DENSE_MLP.block}.{DENSE_MLP.down}",
             "n_shared_experts": f"{SHARED_EXPERTS}.{DENSE_MLP.down}"}
