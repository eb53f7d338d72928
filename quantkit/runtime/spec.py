"""What the reference runner needs from config.json: arch.py's `ModelSpec` (the one reader of configs)
reduced to the runner's terms (rotary embedding, routing, MLA dimensions) and checked for what the runner
implements. Raises UnsupportedModel for architectures or features it does not run, ConfigError for
malformed values."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import arch as _arch
from ..arch.layout import QWEN_EXPERTS
from ..errors import ConfigError, UnsupportedModel

ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of `dim` leading features of each head (transformers' modeling_rope_utils)."""

    kind: str  # default | linear | yarn
    theta: float
    dim: int  # rotated features per head (partial rotary: < head_dim)
    interleave: bool = False  # DeepSeek: pairs (x0, x1), (x2, x3), ... instead of halves
    factor: float = 1.0
    attention_factor: float = 1.0  # multiplies cos and sin (yarn)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 0
    truncate: bool = True

    def inv_freq(self) -> torch.Tensor:
        """fp32 [dim / 2], as transformers computes it."""
        pos_freqs = self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)
        if self.kind == "default":
            return 1.0 / pos_freqs
        if self.kind == "linear":
            return 1.0 / pos_freqs / self.factor
        # yarn (arXiv 2309.00071), transformers' _compute_yarn_parameters
        def corr_dim(rot):
            return (self.dim * math.log(self.original_max_position_embeddings / (rot * 2 * math.pi))) / (
                2 * math.log(self.theta))

        low, high = corr_dim(self.beta_fast), corr_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001  # as transformers: avoid a zero-width ramp
        ramp = ((torch.arange(self.dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    scoring: str  # softmax | sigmoid
    norm_topk_prob: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate: int = 0  # shared-expert MLP width, 0 = none
    prefix: str = QWEN_EXPERTS.block  # module under model.layers.L holding router and experts
    names: tuple[str, str, str] = (QWEN_EXPERTS.gate, QWEN_EXPERTS.up, QWEN_EXPERTS.down)  # per expert
    weights_in_act_dtype: bool = False  # Qwen3 rounds the routing weights to the activation dtype


@dataclass(frozen=True)
class MLASpec:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # MLA: the latent is one "head"
    head_dim: int  # GQA head dim; MLA: qk_nope + qk_rope
    rms_norm_eps: float
    rope: RopeSpec
    sm_scale: float
    moe: MoESpec
    moe_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP
    intermediate_size: int  # dense MLP layers
    qk_norm: bool = False
    mla: MLASpec | None = None
    tie_word_embeddings: bool = False


def _get(cfg: dict, key: str, kind, default=...):
    """cfg[key] checked against `kind` (a type or tuple); `default` when absent or null."""
    v = cfg.get(key)
    if v is None:
        if default is ...:
            raise ConfigError(f"config.json has no {key!r}")
        return default
    ok = isinstance(v, kind) and not (isinstance(v, bool) and kind in (int, float, (int, float)))
    if not ok:
        raise ConfigError(f"config.json {key!r} must be {getattr(kind, '__name__', kind)}, got {v!r:.60}")
    return v


def _pos_int(cfg: dict, key: str, default=...) -> int:
    v = _get(cfg, key, int, default)
    if v is not None and v <= 0:
        raise ConfigError(f"config.json {key!r} must be a positive integer, got {v}")
    return v


def _rope_spec(cfg: dict, arch: str, head_dim: int, rope_dim_base: int) -> RopeSpec:
    """Standardize `rope_parameters` (transformers 5) or legacy `rope_scaling` + `rope_theta`."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ConfigError("config.json rope_parameters / rope_scaling must be an object")
    if any(isinstance(v, dict) for v in rp.values()):
        raise UnsupportedModel("per-layer-type rope_parameters are not supported")
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"rope type {kind!r} is not implemented (the runner has {', '.join(ROPE_TYPES)})")
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    # transformers applies partial_rotary_factor in GLM's default rope and in the scaled ropes
    partial = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    traits = _arch.ARCHITECTURES[arch]
    if partial is None:
        partial = traits.partial_rotary
    if traits.partial_rotary == 1.0 and kind == "default" and partial != 1.0:
        raise UnsupportedModel(f"{arch} with partial_rotary_factor {partial} is not what transformers runs")
    dim = int(rope_dim_base * float(partial))
    if dim % 2 or not 0 < dim <= head_dim:
        raise ConfigError(f"rotary dim {dim} (partial_rotary_factor {partial}) must be even and <= {head_dim}")
    extra = {}
    if kind in ("linear", "yarn"):
        factor = rp.get("factor")
        omax = rp.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        omax = omax or cfg.get("max_position_embeddings")
        if factor is None and kind == "yarn" and omax:
            factor = cfg["max_position_embeddings"] / omax
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ConfigError(f"{kind} rope needs a positive 'factor', got {factor!r}")
        extra["factor"] = float(factor)
    if kind == "yarn":
        if not isinstance(omax, int) or omax <= 0:
            raise ConfigError("yarn rope needs original_max_position_embeddings")

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        af = rp.get("attention_factor")
        ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")
        if af is None:
            af = mscale(factor, ms) / mscale(factor, msa) if (ms and msa) else mscale(factor)
        extra.update(attention_factor=float(af), beta_fast=float(rp.get("beta_fast") or 32),
                     beta_slow=float(rp.get("beta_slow") or 1), original_max_position_embeddings=omax,
                     truncate=bool(rp.get("truncate", True)))
    interleave = traits.rope_interleave and bool(cfg.get("rope_interleave", True))
    return RopeSpec(kind, theta, dim, interleave, **extra)


def _softmax_scale(cfg: dict, rope: RopeSpec, qk_head_dim: int, mla: bool) -> float:
    scale = qk_head_dim ** -0.5
    if mla and rope.kind != "default":  # DeepSeek's yarn_apply_mscale
        rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        msa = rp.get("mscale_all_dim", 0)
        if msa and rope.factor > 1:
            m = 0.1 * msa * math.log(rope.factor) + 1.0
            scale *= m * m
    return scale


def parse_config(cfg: dict) -> ModelSpec:
    """Validate config.json (through arch.parse_config) and reduce it to what the runner needs."""
    if not isinstance(cfg, dict):
        raise ConfigError("config.json must hold a JSON object")
    try:
        a = _arch.parse_config(cfg)
    except ConfigError as e:
        if "is not supported" not in e.message:
            raise
        wrapped = isinstance(cfg.get("text_config"), dict)
        raise UnsupportedModel(f"model_type {str(cfg.get('model_type'))[:40]!r} "
                               + ("wraps a text model (text_config); multimodal wrappers are not supported"
                                  if wrapped else "is not supported"), hint=_arch.support_hint("runner")) from None
    traits = _arch.ARCHITECTURES[a.arch]
    if not traits.runner or a.prefix:
        raise UnsupportedModel(f"model_type {str(cfg.get('model_type'))[:40]!r} is not supported"
                               + (" (a multimodal wrapper)" if a.prefix else ""), hint=_arch.support_hint("runner"))
    c = a.text
    if _get(c, "hidden_act", str, "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {c['hidden_act']!r}: the fused MoE kernel is SiLU-gated")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts_per_tok"):
        _pos_int(c, key)
    heads, kv_heads = a.num_heads, _pos_int(c, "num_key_value_heads", a.num_heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    eps = float(_get(c, "rms_norm_eps", (int, float), 1e-6))
    top_k = a.experts_per_tok
    if a.arch == "qwen3_moe" and c.get("use_sliding_window"):
        raise UnsupportedModel("sliding-window attention is not implemented")
    if a.arch == "mixtral" and c.get("sliding_window") is not None:
        raise UnsupportedModel("sliding-window attention is not implemented (Mixtral with sliding_window set)")
    if traits.routing == "noaux_tc" and (a.scoring != "sigmoid" or c.get("topk_method", "noaux_tc") != "noaux_tc"):
        raise UnsupportedModel(f"routing scoring_func={c.get('scoring_func')!r} topk_method="
                               f"{c.get('topk_method')!r}; the runner implements sigmoid + noaux_tc")
    n_exp, n_group, topk_group = a.num_experts, a.n_group, a.topk_group
    if n_exp <= 0 or a.moe_intermediate_size <= 0:
        raise ConfigError("config.json must give a positive number of routed experts and expert width")
    if a.scoring == "sigmoid" and (n_exp % n_group or topk_group > n_group or n_exp // n_group < 2
                                   or top_k > topk_group * (n_exp // n_group)):
        raise ConfigError(f"routing n_routed_experts={n_exp} n_group={n_group} topk_group={topk_group} "
                          f"num_experts_per_tok={top_k} is inconsistent")
    if top_k > n_exp:
        raise ConfigError(f"num_experts_per_tok {top_k} > {n_exp} experts")
    names = a.experts
    moe = MoESpec(n_exp, top_k, a.moe_intermediate_size, a.scoring, a.norm_topk_prob, n_group, topk_group,
                  a.routed_scaling_factor, shared_intermediate=a.shared_intermediate, prefix=names.block,
                  names=(names.gate, names.up, names.down), weights_in_act_dtype=traits.routing_weights_in_act_dtype)
    mla = None
    if a.attention == "mla":
        mla = MLASpec(None if a.q_lora_rank is None else _pos_int(c, "q_lora_rank"), _pos_int(c, "kv_lora_rank"),
                      _pos_int(c, "qk_nope_head_dim"), _pos_int(c, "qk_rope_head_dim"), _pos_int(c, "v_head_dim"))
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        rope = _rope_spec(c, a.arch, mla.qk_rope_head_dim, mla.qk_rope_head_dim)  # transformers: head_dim = rope dim
        kv_heads = 1
    else:
        head_dim = a.head_dim
        rope = _rope_spec(c, a.arch, head_dim, head_dim)
    return ModelSpec(a.arch, a.vocab_size, a.hidden_size, a.num_layers, heads, kv_heads, head_dim, eps, rope,
                     _softmax_scale(c, rope, head_dim, mla is not None), moe, a.moe[:a.num_layers],
                     _pos_int(c, "intermediate_size"), a.qk_norm, mla, a.tie_word_embeddings)
