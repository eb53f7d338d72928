"""The one reader of config.json: `parse_config` reduces it to a validated `ModelSpec`. A config is hostile
input: every field read is checked for its type and range, and the fields against each other, so a value
beyond sane bounds is a named error (its `field` names the key) before anything is built from it.

Legend: D = hidden_size, V = vocab_size, H = attention heads, KV = key/value heads, hd = head_dim,
I = dense intermediate, Im = expert intermediate, E = routed experts, L = decoder layers (no MTP).
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .layout import ExpertNames
from .registry import ARCHITECTURES, family, text_config


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
    """Each field, read and checked on its own (`_consistent` then holds them against each other): the fields
    every family has, then the family's own (`_deepseek_family`, `_gqa_family`)."""
    arch = family(config)
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
    head_dim = _head_dim(cfg, arch, D, H)
    mtp = _int(cfg, _key(arch, cfg, "num_nextn_predict_layers"), 0, upper=MAX_LAYERS, lo=0) \
        if arch in ("deepseek_v3", "glm4_moe", "glm_moe_dsa") else 0
    common = dict(model_type=model_type, arch=arch, prefix=prefix, dtype=_dtype_of(cfg), vocab_size=V,
                  hidden_size=D, num_layers=L, mtp_layers=mtp, num_heads=H,
                  tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False), quantization=quant, text=cfg)
    gqa = dict(attention="gqa", num_kv_heads=kv_heads, head_dim=head_dim)
    if arch in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        return _deepseek_family(cfg, arch, common, gqa)
    return _gqa_family(cfg, arch, common, gqa)


def _head_dim(cfg: Mapping[str, Any], arch: str, D: int, H: int) -> int:
    """One attention head's width: head_dim, else hidden_size / num_attention_heads; a GQA family's RoPE must
    rotate an even number of its dimensions."""
    gqa_family = ARCHITECTURES[arch].attention == "gqa"
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
    return head_dim


def _top_k(cfg: Mapping[str, Any]) -> int:
    return _int(cfg, "num_experts_per_tok", upper=MAX_EXPERTS, lo=0)  # held to E by `_consistent`


def _width(cfg: Mapping[str, Any], key: str) -> int:
    return _int(cfg, key, upper=MAX_INTERMEDIATE)


def _deepseek_family(cfg: Mapping[str, Any], arch: str, common: dict, gqa: dict) -> ModelSpec:
    """deepseek_v3, glm4_moe, glm_moe_dsa: the MoE layout and group-limited routing (`_deepseek_moe`), then
    GQA (glm4_moe) or MLA, with GLM-5's DSA indexer."""
    moe_common = _deepseek_moe(cfg, arch, common["num_layers"], common["mtp_layers"])
    bias = _bool(cfg, "attention_bias", False)
    if arch == "glm4_moe":  # GQA; attention_bias adds q/k/v biases only (o_proj has none)
        return ModelSpec(**common, **moe_common, **gqa, qkv_bias=bias, qk_norm=_bool(cfg, "use_qk_norm", False))
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
        L, mtp = common["num_layers"], common["mtp_layers"]
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


def _deepseek_moe(cfg: Mapping[str, Any], arch: str, L: int, mtp: int) -> dict:
    """The MoE fields of deepseek_v3, glm4_moe and glm_moe_dsa: which layers are MoE (first_k_dense_replace and
    moe_layer_freq, or glm_moe_dsa's mlp_layer_types), the widths, the shared experts and the routing."""
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
        moe = tuple(i >= first_dense and i % freq == 0 for i in range(L + mtp))
    inter, moe_inter = _width(cfg, "intermediate_size"), _width(cfg, "moe_intermediate_size")
    _str(cfg, "topk_method", None)
    return dict(moe=moe, intermediate_size=inter, moe_intermediate_size=moe_inter, num_experts=E,
                experts_per_tok=_top_k(cfg),
                shared_intermediate=moe_inter * _int(cfg, "n_shared_experts", 0, upper=MAX_EXPERTS, lo=0),
                router_bias=True, mtp_embeddings=arch in ("deepseek_v3", "glm4_moe"),
                scoring=_str(cfg, "scoring_func", "sigmoid", ("sigmoid", "softmax")),
                norm_topk_prob=_bool(cfg, "norm_topk_prob", True),
                n_group=_int(cfg, "n_group", 1, upper=MAX_EXPERTS),
                topk_group=_int(cfg, "topk_group", 1, upper=MAX_EXPERTS),
                routed_scaling_factor=_num(cfg, "routed_scaling_factor", 1.0))


def _gqa_family(cfg: Mapping[str, Any], arch: str, common: dict, gqa: dict) -> ModelSpec:
    """qwen3_moe, olmoe, mixtral and the dense llama and qwen3: GQA attention and each family's MLP layout."""
    L = common["num_layers"]
    if arch == "qwen3_moe":
        E = _int(cfg, _experts_key(arch, cfg), upper=MAX_EXPERTS, lo=0)  # 0: every layer dense (transformers)
        step = _int(cfg, "decoder_sparse_step", 1, upper=MAX_LAYERS)
        only = set(_int_list(cfg, "mlp_only_layers", MAX_LAYERS))
        moe = tuple(i not in only and E > 0 and (i + 1) % step == 0 for i in range(L))
        bias = _bool(cfg, "attention_bias", False)
        _bool(cfg, "use_sliding_window", False)
        return ModelSpec(**common, **gqa, moe=moe, intermediate_size=_width(cfg, "intermediate_size"),
                         moe_intermediate_size=_width(cfg, "moe_intermediate_size"), num_experts=E,
                         experts_per_tok=_top_k(cfg), shared_intermediate=0, qkv_bias=bias, o_bias=bias,
                         qk_norm=True, norm_topk_prob=_bool(cfg, "norm_topk_prob", False))
    if arch == "olmoe":  # intermediate_size is the routed expert's width; no dense MLP
        inter = _width(cfg, "intermediate_size")
        bias = _bool(cfg, "attention_bias", False)
        _num(cfg, "clip_qkv", None)  # null: no clipping
        return ModelSpec(**common, **gqa, moe=(True,) * L, intermediate_size=inter, moe_intermediate_size=inter,
                         num_experts=_int(cfg, _experts_key(arch, cfg), upper=MAX_EXPERTS, lo=0),
                         experts_per_tok=_top_k(cfg), shared_intermediate=0, qkv_bias=bias, o_bias=bias,
                         qk_norm=True, norm_topk_prob=_bool(cfg, "norm_topk_prob", False))
    if arch == "mixtral":
        inter = _width(cfg, "intermediate_size")
        return ModelSpec(**common, **gqa, moe=(True,) * L, intermediate_size=inter, moe_intermediate_size=inter,
                         num_experts=_int(cfg, _experts_key(arch, cfg), upper=MAX_EXPERTS, lo=0),
                         experts_per_tok=_top_k(cfg), shared_intermediate=0, norm_topk_prob=True)
    bias = _bool(cfg, "attention_bias", False)  # llama, qwen3 (dense)
    return ModelSpec(**common, **gqa, moe=(False,) * L, intermediate_size=_width(cfg, "intermediate_size"),
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

