"""A small model runner that executes a quantkit INT4 checkpoint as written: packed experts through
`fused_moe_int4`, paged KV cache (BF16 or FP8) with the page-ownership check on every decode step.

It reads config.json and the shards (lazily, per tensor, through quantkit.io) and nothing of the
converter. Supported architectures, with routing, norms and RoPE as transformers' modeling files
define them (models/{qwen3_moe,mixtral,glm4_moe,deepseek_v3}/modeling_*.py):

    qwen3_moe    GQA + per-head q/k RMSNorm, softmax top-k (renormalized if norm_topk_prob)
    mixtral      GQA, softmax top-k, always renormalized
    glm4_moe     GQA (optional qk-norm, partial rotary, default factor 0.5), sigmoid scores +
                 e_score_correction_bias, group-limited top-k, routed_scaling_factor, shared expert,
                 first_k_dense_replace dense layers
    deepseek_v3  MLA (Kimi K2: model_type kimi_k2), same routing as glm4_moe; rope interleave, yarn

Weights: routed experts stay INT4 (`Int4Experts`, one stack per layer); packed dense Linears run
through `int4_gemm`; everything else is a BF16 tensor cast to the compute dtype. RoPE: default,
linear, yarn (anything else raises UnsupportedModel).

Attention: prefill computes causal attention in torch over the request's own tokens (fresh K/V)
and writes K/V to the pool; decode reads only the paged cache with the kernels of
runtime/paged_attention.py, integrity check on. GQA caches post-RoPE K (after k_norm) and V; MLA
caches the latent kv_a_layernorm(kv_a) ++ rotated k_pe and decodes in the absorbed form (q_nope
times W_UK, attention in latent space, W_UV after). The per-layer FP8 scales are why decode calls
write_kv_cache / paged_*_attention itself rather than decode_step (whose pool holds one scale for
all layers); the step is decode_step's, applied to every layer: a request whose block table points
outside its own pages is aborted (its pages freed, its id returned), the others are unaffected.

Not here: a scheduler, chunked prefill or prefix caching, sliding-window attention, sampling
(generate is greedy), tensor/expert parallelism, multimodal wrappers.

Legend: T = tokens of one request, B = requests in a decode batch, D = hidden, H / Hkv = query / KV
heads, Dh = head dim, E = experts, k = experts per token, V = vocab, L = kv_lora_rank, R = rope dim.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import ConfigError, QuantkitError
from ..io.checkpoint import Checkpoint
from ..io.safetensors import SafetensorsFile
from ._triton import resolve_backend
from .fused_moe import Int4Experts, fused_moe_int4
from .int4 import PackedInt4, int4_gemm
from .kv_pool import PagedKVPool
from .paged_attention import FP8_DTYPE, paged_decode_attention, paged_mla_decode_attention, write_kv_cache

__all__ = ["load_runner", "Runner", "ModelSpec", "parse_config", "RunnerError", "UnsupportedModel",
           "UnsupportedCheckpoint", "KVScalesMissing", "KVCacheViolation"]


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------
class RunnerError(QuantkitError):
    hint = "see docs/runtime.md, 'Model runner'"


class UnsupportedModel(RunnerError):
    hint = ("the runner supports model_type qwen3_moe, mixtral, glm4_moe and deepseek_v3 / kimi_k2, with "
            "default, linear or yarn RoPE; run other models with transformers or an inference engine")


class UnsupportedCheckpoint(RunnerError):
    hint = ("the runner executes compressed-tensors pack-quantized INT4 experts (what `quantkit convert` "
            "writes with an int4 recipe) and BF16/FP16/FP32 or INT4 dense weights")


class KVScalesMissing(RunnerError):
    hint = ("an FP8 KV cache needs calibrated scales: convert with --kv-scales (or a recipe with a kv_cache "
            "section), or pass kv_scales= a mapping or safetensors file of model.layers.L.self_attn.k_scale / v_scale")


class KVCacheViolation(RunnerError):
    hint = "a block table pointed at a page the request does not own; the request was aborted and freed"


# --------------------------------------------------------------------------------------------------
# config -> spec (validated, frozen)
# --------------------------------------------------------------------------------------------------
ARCHS = ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "kimi_k2")
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
    prefix: str = "mlp"  # module under model.layers.L holding router and experts
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert gate, up, down
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
    if partial is None:
        partial = 0.5 if arch == "glm4_moe" else 1.0
    if arch not in ("glm4_moe",) and kind == "default" and partial != 1.0:
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
    interleave = arch in ("deepseek_v3", "kimi_k2") and bool(cfg.get("rope_interleave", True))
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
    """Validate config.json and reduce it to what the runner needs. Raises UnsupportedModel for
    architectures or features the runner does not implement, ConfigError for malformed values."""
    if not isinstance(cfg, dict):
        raise ConfigError("config.json must hold a JSON object")
    arch = cfg.get("model_type")
    if arch not in ARCHS:
        if isinstance(cfg.get("text_config"), dict):
            raise UnsupportedModel(f"model_type {str(arch)[:40]!r} wraps a text model (text_config); "
                                   "multimodal wrappers are not supported")
        raise UnsupportedModel(f"model_type {str(arch)[:40]!r} is not supported")
    if _get(cfg, "hidden_act", str, "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {cfg['hidden_act']!r}: the fused MoE kernel is SiLU-gated")
    hidden = _pos_int(cfg, "hidden_size")
    layers = _pos_int(cfg, "num_hidden_layers")
    heads = _pos_int(cfg, "num_attention_heads")
    kv_heads = _pos_int(cfg, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    vocab = _pos_int(cfg, "vocab_size")
    eps = float(_get(cfg, "rms_norm_eps", (int, float), 1e-6))
    top_k = _pos_int(cfg, "num_experts_per_tok")
    mla = None
    qk_norm = False
    if arch == "qwen3_moe":
        if cfg.get("use_sliding_window"):
            raise UnsupportedModel("sliding-window attention is not implemented")
        n_exp = _pos_int(cfg, "num_experts", None) or _pos_int(cfg, "num_local_experts")
        step = _pos_int(cfg, "decoder_sparse_step", 1)
        only = _get(cfg, "mlp_only_layers", list, [])
        moe_layers = tuple(i not in only and (i + 1) % step == 0 for i in range(layers))
        moe = MoESpec(n_exp, top_k, _pos_int(cfg, "moe_intermediate_size"), "softmax",
                      bool(cfg.get("norm_topk_prob", False)), weights_in_act_dtype=True)
        qk_norm = True
    elif arch == "mixtral":
        if cfg.get("sliding_window") is not None:
            raise UnsupportedModel("sliding-window attention is not implemented (Mixtral with sliding_window set)")
        moe = MoESpec(_pos_int(cfg, "num_local_experts"), top_k, _pos_int(cfg, "intermediate_size"), "softmax",
                      True, prefix="block_sparse_moe", names=("w1", "w3", "w2"))
        moe_layers = (True,) * layers
    else:  # glm4_moe, deepseek_v3 / kimi_k2: sigmoid + correction bias, group-limited top-k
        if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
            raise UnsupportedModel(f"routing scoring_func={cfg.get('scoring_func')!r} topk_method="
                                   f"{cfg.get('topk_method')!r}; the runner implements sigmoid + noaux_tc")
        n_exp = _pos_int(cfg, "n_routed_experts")
        n_group, topk_group = _pos_int(cfg, "n_group", 1), _pos_int(cfg, "topk_group", 1)
        if n_exp % n_group or topk_group > n_group or n_exp // n_group < 2 or top_k > topk_group * (n_exp // n_group):
            raise ConfigError(f"routing n_routed_experts={n_exp} n_group={n_group} topk_group={topk_group} "
                              f"num_experts_per_tok={top_k} is inconsistent")
        inter = _pos_int(cfg, "moe_intermediate_size")
        moe = MoESpec(n_exp, top_k, inter, "sigmoid", bool(cfg.get("norm_topk_prob", True)), n_group, topk_group,
                      float(_get(cfg, "routed_scaling_factor", (int, float), 1.0)),
                      shared_intermediate=inter * _get(cfg, "n_shared_experts", int, 0))
        first_dense = _get(cfg, "first_k_dense_replace", int, 0)
        moe_layers = tuple(i >= first_dense for i in range(layers))
        if arch == "glm4_moe":
            qk_norm = bool(cfg.get("use_qk_norm", False))
        else:
            q_lora = cfg.get("q_lora_rank")
            mla = MLASpec(None if q_lora is None else _pos_int(cfg, "q_lora_rank"), _pos_int(cfg, "kv_lora_rank"),
                          _pos_int(cfg, "qk_nope_head_dim"), _pos_int(cfg, "qk_rope_head_dim"),
                          _pos_int(cfg, "v_head_dim"))
    if top_k > moe.num_experts:
        raise ConfigError(f"num_experts_per_tok {top_k} > {moe.num_experts} experts")
    if mla is not None:
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        rope = _rope_spec(cfg, arch, mla.qk_rope_head_dim, mla.qk_rope_head_dim)  # transformers: head_dim = rope dim
        kv_heads = 1
    else:
        head_dim = _pos_int(cfg, "head_dim", None) or hidden // heads
        rope = _rope_spec(cfg, arch, head_dim, head_dim)
    return ModelSpec(arch, vocab, hidden, layers, heads, kv_heads, head_dim, eps, rope,
                     _softmax_scale(cfg, rope, head_dim, mla is not None), moe, moe_layers,
                     _pos_int(cfg, "intermediate_size"), qk_norm, mla, bool(cfg.get("tie_word_embeddings", False)))


# --------------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Linear:
    """y = x @ W^T (+ b). weight: dense [N, K] in the compute dtype, or PackedInt4 (N, K)."""

    weight: torch.Tensor | PackedInt4
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        if isinstance(self.weight, PackedInt4):
            y = int4_gemm(x, self.weight, backend=backend)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        w = self.weight
        return (w.dequantize(torch.float32) if isinstance(w, PackedInt4) else w).to(dtype)


@dataclass(frozen=True)
class DenseMLP:
    gate: Linear
    up: Linear
    down: Linear


@dataclass(frozen=True)
class MoEBlock:
    router: torch.Tensor  # [E, D]
    bias: torch.Tensor | None  # fp32 [E] e_score_correction_bias (sigmoid routing)
    experts: Int4Experts
    shared: DenseMLP | None


@dataclass(frozen=True)
class GQAAttention:
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


@dataclass(frozen=True)
class MLAAttention:
    q: Linear | None  # q_lora_rank None
    q_a: Linear | None
    q_a_norm: torch.Tensor | None
    q_b: Linear | None
    kv_a: Linear  # -> [L + R]
    kv_a_norm: torch.Tensor  # [L]
    kv_b: Linear  # [H * (nope + v), L]
    w_uk: torch.Tensor  # fp32 [H, nope, L]  (absorbed into q for decode)
    w_uv: torch.Tensor  # fp32 [H, v, L]
    o: Linear


@dataclass(frozen=True)
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: GQAAttention | MLAAttention
    mlp: DenseMLP | MoEBlock


class _QuantScheme:
    """The config's compressed-tensors groups, validated: every group must be pack-quantized INT4."""

    def __init__(self, qcfg: dict | None):
        self.groups = []
        if qcfg is None:
            return
        if qcfg.get("quant_method") != "compressed-tensors":
            raise UnsupportedCheckpoint(f"quantization_config.quant_method {qcfg.get('quant_method')!r}: the runner "
                                        "reads compressed-tensors checkpoints")
        if qcfg.get("quantization_status", "compressed") != "compressed":
            raise UnsupportedCheckpoint(f"quantization_status {qcfg.get('quantization_status')!r}, "
                                        "expected 'compressed'")
        top_fmt = qcfg.get("format")
        for name, g in (qcfg.get("config_groups") or {}).items():
            w = g.get("weights") or {}
            fmt = g.get("format", top_fmt)
            int4 = fmt == "pack-quantized" and w.get("num_bits") == 4 and w.get("type") == "int"
            if not int4 or g.get("input_activations"):
                acts = " with quantized activations" if g.get("input_activations") else ""
                raise UnsupportedCheckpoint(f"quantization group {str(name)[:40]!r} is {fmt} {w.get('type')}"
                                            f"{w.get('num_bits')}{acts}; the runner executes pack-quantized INT4 "
                                            "weight-only (W4A16)")
            if w.get("actorder") == "group":
                raise UnsupportedCheckpoint("act-order 'group' (weight_g_idx) is not supported by the INT4 kernels")
            gs = w.get("group_size") if w.get("strategy") == "group" else None
            self.groups.append((list(g.get("targets") or []), gs))

    def group_size(self, module: str) -> int | None:
        """The group size the config gives `module` (None: infer from the scale's shape)."""
        for targets, gs in self.groups:
            for t in targets:
                if t == "Linear" or t == module or (t.startswith("re:") and re.match(t[3:], module)):
                    return gs
        return None


class _Reader:
    """Per-tensor lazy reads over a validated Checkpoint (one mmap per shard, closed after load)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self._files: dict[str, SafetensorsFile] = {}

    def has(self, name: str) -> bool:
        return name in self.ckpt.location

    def get(self, name: str) -> torch.Tensor:
        if name not in self.ckpt.location:
            raise UnsupportedCheckpoint(f"tensor {name} is missing from the checkpoint")
        shard = self.ckpt.location[name]
        if shard not in self._files:
            self._files[shard] = SafetensorsFile(self.ckpt.shard(shard).header)
        return self._files[shard].get(name)

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()


class _Loader:
    def __init__(self, reader: _Reader, scheme: _QuantScheme, dtype: torch.dtype, device: torch.device):
        self.r, self.scheme, self.dtype, self.device = reader, scheme, dtype, device

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.r.get(name)
        if not t.is_floating_point() or t.dtype == FP8_DTYPE:
            raise UnsupportedCheckpoint(f"{name} is {str(t.dtype).removeprefix('torch.')}; expected a BF16/FP16/FP32 "
                                        "tensor (FP8 weights are not supported by the runner)")
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def packed(self, module: str) -> PackedInt4:
        if self.r.has(f"{module}.weight_g_idx"):
            raise UnsupportedCheckpoint(f"{module} has weight_g_idx (act-order 'group'), which the kernels do not take")
        zp = f"{module}.weight_zero_point"
        return PackedInt4.from_tensors(
            self.r.get(f"{module}.weight_packed").to(self.device), self.r.get(f"{module}.weight_scale").to(self.device),
            self.r.get(f"{module}.weight_shape"), self.r.get(zp).to(self.device) if self.r.has(zp) else None,
            self.scheme.group_size(module))

    def linear(self, module: str, shape: tuple[int, int] | None = None) -> Linear:
        if self.r.has(f"{module}.weight_packed"):
            w = self.packed(module)
            got = w.shape
        elif self.r.has(f"{module}.weight"):
            w = self.tensor(f"{module}.weight")
            got = tuple(w.shape)
        else:
            raise UnsupportedCheckpoint(f"{module}: neither {module}.weight nor {module}.weight_packed is in "
                                        "the checkpoint")
        if shape is not None and tuple(got) != tuple(shape):
            raise UnsupportedCheckpoint(f"{module} has shape {list(got)}, the config implies {list(shape)}")
        b = f"{module}.bias"
        return Linear(w, self.tensor(b) if self.r.has(b) else None)

    def mlp(self, prefix: str, d: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> DenseMLP:
        g, u, dn = names
        return DenseMLP(self.linear(f"{prefix}.{g}", (inter, d)), self.linear(f"{prefix}.{u}", (inter, d)),
                        self.linear(f"{prefix}.{dn}", (d, inter)))

    def experts(self, prefix: str, spec: MoESpec, d: int) -> Int4Experts:
        """Stack the per-expert packed tensors of one layer into [E, ...] PackedInt4s."""
        stacks = []
        for name, shape in zip(spec.names, [(spec.intermediate_size, d)] * 2 + [(d, spec.intermediate_size)]):
            mods = [f"{prefix}.{e}.{name}" for e in range(spec.num_experts)]
            if not self.r.has(f"{mods[0]}.weight_packed"):
                raise UnsupportedCheckpoint(
                    f"{mods[0]} is not INT4 pack-quantized; the runner executes quantized experts only",
                    hint="convert the model with an INT4 expert recipe (quantkit convert, e.g. int4-experts-rtn)")
            parts = [self.packed(m) for m in mods]
            if any(p.shape != tuple(shape) or p.group_size != parts[0].group_size for p in parts):
                raise UnsupportedCheckpoint(f"{prefix}.*.{name}: experts disagree in shape or group size "
                                            f"(expected {list(shape)})")
            zps = [p.zero_point for p in parts]
            zp = None if zps[0] is None else torch.stack(zps)
            stacks.append(PackedInt4(torch.stack([p.packed for p in parts]), torch.stack([p.scale for p in parts]),
                                     zp, tuple(shape), parts[0].group_size))
        gate, up, down = stacks
        return Int4Experts(down, gate=gate, up=up)


def _load_layer(ld: _Loader, spec: ModelSpec, i: int) -> Layer:
    p = f"model.layers.{i}"
    d, h = spec.hidden_size, spec.num_heads
    if spec.mla is None:
        dh, hkv = spec.head_dim, spec.num_kv_heads
        qn = f"{p}.self_attn.q_norm.weight"
        attn = GQAAttention(ld.linear(f"{p}.self_attn.q_proj", (h * dh, d)),
                            ld.linear(f"{p}.self_attn.k_proj", (hkv * dh, d)),
                            ld.linear(f"{p}.self_attn.v_proj", (hkv * dh, d)),
                            ld.linear(f"{p}.self_attn.o_proj", (d, h * dh)),
                            ld.tensor(qn) if spec.qk_norm else None,
                            ld.tensor(f"{p}.self_attn.k_norm.weight") if spec.qk_norm else None)
    else:
        m = spec.mla
        a = f"{p}.self_attn"
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            q, q_a, q_a_norm, q_b = ld.linear(f"{a}.q_proj", (h * qk, d)), None, None, None
        else:
            q = None
            q_a = ld.linear(f"{a}.q_a_proj", (m.q_lora_rank, d))
            q_a_norm = ld.tensor(f"{a}.q_a_layernorm.weight")
            q_b = ld.linear(f"{a}.q_b_proj", (h * qk, m.q_lora_rank))
        kv_b = ld.linear(f"{a}.kv_b_proj", (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
        # the absorbed decode needs W_UK / W_UV as matrices: an INT4 kv_b_proj is dequantized once here
        wkv = kv_b.dense(torch.float32).view(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        attn = MLAAttention(q, q_a, q_a_norm, q_b,
                            ld.linear(f"{a}.kv_a_proj_with_mqa", (m.kv_lora_rank + m.qk_rope_head_dim, d)),
                            ld.tensor(f"{a}.kv_a_layernorm.weight"), kv_b,
                            wkv[:, : m.qk_nope_head_dim].contiguous(), wkv[:, m.qk_nope_head_dim:].contiguous(),
                            ld.linear(f"{a}.o_proj", (d, h * m.v_head_dim)))
    if spec.moe_layers[i]:
        mp = f"{p}.{spec.moe.prefix}"
        if ld.r.has(f"{mp}.gate.weight_packed"):
            raise UnsupportedCheckpoint(f"{mp}.gate (the router) is quantized; routers must stay in full precision")
        sigmoid = spec.moe.scoring == "sigmoid"
        # DeepSeek/GLM keep the router and its bias in fp32 (_keep_in_fp32_modules_strict)
        router = ld.tensor(f"{mp}.gate.weight", torch.float32 if sigmoid else None)
        bias = None
        if sigmoid:
            bn = f"{mp}.gate.e_score_correction_bias"
            bias = ld.tensor(bn, torch.float32) if ld.r.has(bn) else torch.zeros(spec.moe.num_experts, device=ld.device)
        shared = (ld.mlp(f"{mp}.shared_experts", d, spec.moe.shared_intermediate)
                  if spec.moe.shared_intermediate else None)
        mlp = MoEBlock(router, bias, ld.experts(f"{mp}.experts", spec.moe, d), shared)
    else:
        mlp = ld.mlp(f"{p}.mlp", d, spec.intermediate_size)
    return Layer(ld.tensor(f"{p}.input_layernorm.weight"), ld.tensor(f"{p}.post_attention_layernorm.weight"), attn, mlp)


# --------------------------------------------------------------------------------------------------
# math (pure functions)
# --------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' *RMSNorm: normalize in fp32, cast back, then scale (in the weight's dtype)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_cos_sin(rope: RopeSpec, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [N, rope.dim] for int positions [N] (cat(freqs, freqs) layout, cast to `dtype`)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [N, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rope.attention_factor).to(dtype), (emb.sin() * rope.attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the first cos.shape[-1] features of x [N, heads, Dh]; cos/sin [N, dim]."""
    dim = cos.shape[-1]
    xr, xp = x[..., :dim], x[..., dim:]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleave:  # DeepSeek: pairs (x0, x1), ...; output de-interleaved like transformers'
        c, s = c[..., : dim // 2], s[..., : dim // 2]
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        rot = torch.cat((-xr[..., dim // 2:], xr[..., : dim // 2]), dim=-1)  # rotate_half
        out = xr * c + rot * s
    return out if xp.shape[-1] == 0 else torch.cat([out, xp], dim=-1)


def route(moe: MoESpec, block: MoEBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router of one MoE layer, as transformers computes it. x [T, D] -> (topk_ids [T, k], weights [T, k])."""
    if moe.scoring == "softmax":  # Qwen3-MoE / Mixtral
        logits = F.linear(x, block.router)  # [T, E] in the activation dtype
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        w, ids = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        if moe.weights_in_act_dtype:
            w = w.to(logits.dtype)
        return ids, w
    # DeepSeek-V3 / GLM-4.5 noaux_tc: sigmoid scores; the bias steers the choice only, weights use scores
    scores = F.linear(x.to(torch.float32), block.router).sigmoid()  # [T, E]
    choice = scores + block.bias
    t, e, g = x.shape[0], moe.num_experts, moe.n_group
    group_scores = choice.view(t, g, e // g).topk(2, dim=-1)[0].sum(-1)  # [T, G] sum of each group's top 2
    group_idx = torch.topk(group_scores, moe.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(t, g, e // g).reshape(t, e)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if moe.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * moe.routed_scaling_factor


def mlp_forward(m: DenseMLP, x: torch.Tensor, backend: str) -> torch.Tensor:
    return m.down(F.silu(m.gate(x, backend)) * m.up(x, backend), backend)


def moe_forward(moe: MoESpec, block: MoEBlock, x: torch.Tensor, backend: str) -> torch.Tensor:
    """x [T, D] -> [T, D]: every routed expert runs packed, through fused_moe_int4."""
    ids, w = route(moe, block, x)
    y = fused_moe_int4(x, ids, w, block.experts, backend=backend)
    if block.shared is not None:
        y = y + mlp_forward(block.shared, x, backend)
    return y


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Prefill attention over one request's own tokens. q [T, H, Dq], k [T, Hkv, Dq], v [T, Hkv, Dv]
    -> [T, H, Dv]. Query head h reads KV head h // (H / Hkv), as transformers' repeat_kv and the
    paged kernels do."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=sm_scale)  # [H, T, Dv]
    return out.transpose(0, 1)


# --------------------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------------------
class Runner:
    """A loaded model plus its paged KV pool. Build with load_runner().

    prefill(request_id, token_ids) -> logits fp32 [T, V]      registers the request, caches its K/V
    decode(request_ids, token_ids) -> (logits fp32 [B, V], aborted ids)   one token per request
    generate(token_ids, max_new_tokens) -> new token ids        greedy, frees its request after
    free(request_id)
    """

    def __init__(self, spec: ModelSpec, embed: torch.Tensor, layers: list[Layer], norm: torch.Tensor,
                 lm_head: torch.Tensor, pool: PagedKVPool, kv_scales: list[tuple], *, backend: str,
                 dtype: torch.dtype, device: torch.device):
        self.spec, self.embed, self.layers, self.norm, self.lm_head = spec, embed, layers, norm, lm_head
        self.pool, self.kv_scales = pool, kv_scales  # per layer (k_scale, v_scale) fp32 or (None, None)
        self.backend, self.dtype, self.device = backend, dtype, device
        self.inv_freq = spec.rope.inv_freq().to(device)

    # --- public API --------------------------------------------------------------------------------
    @property
    def requests(self) -> list[int]:
        return self.pool.requests

    def free(self, request_id: int) -> None:
        self.pool.free(request_id)

    @torch.no_grad()
    def prefill(self, request_id: int, token_ids) -> torch.Tensor:
        """Run a new request's prompt, write its K/V into the pool. -> logits fp32 [T, V]."""
        ids = self._tokens(token_ids)
        if ids.numel() == 0:
            raise RunnerError("prefill needs at least one token")
        self.pool.add_request(request_id)
        try:
            return self._prefill(request_id, ids)
        except BaseException:
            if request_id in self.pool.requests:
                self.pool.free(request_id)  # no half-registered request on any failure
            raise

    def _prefill(self, request_id: int, ids: torch.Tensor) -> torch.Tensor:
        t = ids.numel()
        self.pool.reserve([request_id], t)
        # every token is one "row" of the checked cache write: the request's table repeated T times
        tables = self.pool.block_tables([request_id]).expand(t, -1).contiguous()  # [T, max_pages]
        guard = dict(block_tables=tables, positions=torch.arange(t, dtype=torch.int32, device=self.device),
                     owner=self.pool.owner, request_ids=self.pool.request_id_tensor([request_id] * t),
                     check=True, backend=self.backend)
        cos, sin = rope_cos_sin(self.spec.rope, self.inv_freq, torch.arange(t, device=self.device), self.dtype)
        x = self.embed[ids]  # [T, D]
        bad = torch.zeros(t, dtype=torch.bool, device=self.device)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, self.spec.rms_norm_eps)
            a, wbad = self._attn_prefill(i, layer.attn, h, cos, sin, guard)
            bad |= wbad
            x = x + a
            x = x + self._mlp(i, layer, x)
        if bool(bad.any()):
            raise KVCacheViolation(f"request {request_id}: its block table points outside its own pages during "
                                   "prefill; it was aborted")
        self.pool.advance([request_id], t)
        return self._logits(x)

    @torch.no_grad()
    def decode(self, request_ids, token_ids) -> tuple[torch.Tensor, list[int]]:
        """One new token per request (already prefilled). -> (logits fp32 [B, V], aborted ids).

        Each request's K/V write and its attention read are checked against the page-owner table;
        a request whose block table points outside its own pages is aborted: its logits row is zeros
        and must not be used, its pages are freed, its id is returned. The other requests' results
        equal those of a batch without it."""
        rids = list(request_ids)
        ids = self._tokens(token_ids)
        if ids.numel() != len(rids) or not rids:
            raise RunnerError(f"decode takes one token per request: {len(rids)} requests, {ids.numel()} tokens")
        positions = self.pool.reserve(rids, 1)  # int32 [B], slot of the new token = tokens stored so far
        guard = dict(block_tables=self.pool.block_tables(rids), owner=self.pool.owner,
                     request_ids=self.pool.request_id_tensor(rids), check=True, backend=self.backend)
        cos, sin = rope_cos_sin(self.spec.rope, self.inv_freq, positions.to(torch.long), self.dtype)
        x = self.embed[ids]  # [B, D]
        violated = torch.zeros(len(rids), dtype=torch.bool, device=self.device)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, self.spec.rms_norm_eps)
            a, bad = self._attn_decode(i, layer.attn, h, cos, sin, positions, guard)
            violated |= bad
            x = x + a.masked_fill(violated[:, None], 0)  # a flagged row's attention is unspecified
            x = x + self._mlp(i, layer, x)
        logits = self._logits(x).masked_fill(violated[:, None], 0)
        aborted = [rids[j] for j in violated.nonzero().flatten().tolist()]
        for r in aborted:
            self.pool.free(r)  # frees only the pages the owner table says it owns
        gone = set(aborted)
        self.pool.advance([r for r in rids if r not in gone])
        return logits, aborted

    @torch.no_grad()
    def generate(self, token_ids, max_new_tokens: int, *, stop_token_ids=()) -> list[int]:
        """Greedy decoding of one prompt: the new tokens (without the prompt), at most max_new_tokens;
        stops after a token in stop_token_ids. The request is freed afterwards."""
        if max_new_tokens <= 0:
            return []
        rid = next(r for r in range(len(self.pool.requests) + 1) if r not in set(self.pool.requests))
        stop = set(stop_token_ids)
        try:
            tok = int(self.prefill(rid, token_ids)[-1].argmax())
            out = [tok]
            while len(out) < max_new_tokens and tok not in stop:
                logits, aborted = self.decode([rid], [tok])
                if aborted:
                    raise KVCacheViolation(f"request {rid} was aborted by the KV-cache integrity check")
                tok = int(logits[0].argmax())
                out.append(tok)
            return out
        finally:
            if rid in self.pool.requests:
                self.pool.free(rid)

    # --- pieces ------------------------------------------------------------------------------------
    def _tokens(self, token_ids) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size):
            raise RunnerError(f"token ids must lie in [0, {self.spec.vocab_size})")
        return ids

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.norm, self.spec.rms_norm_eps)
        return F.linear(h, self.lm_head).to(torch.float32)

    def _mlp(self, i: int, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, layer.post_norm, self.spec.rms_norm_eps)
        if isinstance(layer.mlp, MoEBlock):
            return moe_forward(self.spec.moe, layer.mlp, h, self.backend)
        return mlp_forward(layer.mlp, h, self.backend)

    def _gqa_qkv(self, a: GQAAttention, h, cos, sin):
        """-> q [N, H, Dh], k [N, Hkv, Dh] (post qk-norm, post RoPE), v [N, Hkv, Dh]."""
        n, dh, be = h.shape[0], self.spec.head_dim, self.backend
        q = a.q(h, be).view(n, -1, dh)
        k = a.k(h, be).view(n, -1, dh)
        v = a.v(h, be).view(n, -1, dh)
        if a.q_norm is not None:
            q = rms_norm(q, a.q_norm, self.spec.rms_norm_eps)
            k = rms_norm(k, a.k_norm, self.spec.rms_norm_eps)
        il = self.spec.rope.interleave
        return apply_rope(q, cos, sin, il), apply_rope(k, cos, sin, il), v

    def _mla_q_latent(self, a: MLAAttention, h, cos, sin):
        """-> q_nope [N, H, nope], q_pe [N, H, R] (rotated), latent [N, L + R] = norm(kv_a) ++ rotated k_pe."""
        m, be, n = self.spec.mla, self.backend, h.shape[0]
        q = a.q(h, be) if a.q is not None else a.q_b(rms_norm(a.q_a(h, be), a.q_a_norm, self.spec.rms_norm_eps), be)
        q = q.view(n, self.spec.num_heads, -1)
        q_nope, q_pe = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        kv = a.kv_a(h, be)  # [N, L + R]
        c = rms_norm(kv[:, : m.kv_lora_rank], a.kv_a_norm, self.spec.rms_norm_eps)
        k_pe = kv[:, None, m.kv_lora_rank:]  # [N, 1, R]
        il = self.spec.rope.interleave
        q_pe, k_pe = apply_rope(q_pe, cos, sin, il), apply_rope(k_pe, cos, sin, il)
        return q_nope, q_pe, torch.cat([c, k_pe[:, 0]], dim=-1)

    def _attn_prefill(self, i: int, a, h, cos, sin, guard):
        """-> (attention output [T, D], write violated bool [T])."""
        kc, vc = self.pool.layer(i)
        ks, vs = self.kv_scales[i]
        t = h.shape[0]
        if isinstance(a, GQAAttention):
            q, k, v = self._gqa_qkv(a, h, cos, sin)
            bad = write_kv_cache(k, v, kc, vc, k_scale=ks, v_scale=vs, **guard)
            o = causal_attention(q, k, v, self.spec.sm_scale)  # [T, H, Dh]
        else:
            m = self.spec.mla
            q_nope, q_pe, latent = self._mla_q_latent(a, h, cos, sin)
            bad = write_kv_cache(latent[:, None], None, kc, None, k_scale=ks, **guard)
            # as transformers: expand the latent to per-head K / V (the non-absorbed form)
            kv = a.kv_b(latent[:, : m.kv_lora_rank], self.backend).view(t, self.spec.num_heads, -1)
            k_nope, v = kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim:]
            k_pe = latent[:, None, m.kv_lora_rank:].expand(t, self.spec.num_heads, m.qk_rope_head_dim)
            o = causal_attention(torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1), v, self.spec.sm_scale)
        return a.o(o.reshape(t, -1), self.backend), bad

    def _attn_decode(self, i: int, a, h, cos, sin, positions, guard):
        """-> (attention output [B, D], violated bool [B]) over the paged cache."""
        kc, vc = self.pool.layer(i)
        ks, vs = self.kv_scales[i]
        b = h.shape[0]
        ctx = positions + 1  # attend over the stored tokens and the one written now
        if isinstance(a, GQAAttention):
            q, k, v = self._gqa_qkv(a, h, cos, sin)
            wbad = write_kv_cache(k, v, kc, vc, positions=positions, k_scale=ks, v_scale=vs, **guard)
            o, rbad = paged_decode_attention(q, kc, vc, context_lens=ctx, k_scale=ks, v_scale=vs,
                                             sm_scale=self.spec.sm_scale, **guard)  # [B, H, Dh]
        else:
            q_nope, q_pe, latent = self._mla_q_latent(a, h, cos, sin)
            wbad = write_kv_cache(latent[:, None], None, kc, None, positions=positions, k_scale=ks, **guard)
            # absorbed form: scores = (q_nope W_UK) . c + q_pe . k_pe; out = (softmax @ c) W_UV^T
            q_abs = torch.einsum("bhn,hnl->bhl", q_nope.to(torch.float32), a.w_uk).to(self.dtype)  # [B, H, L]
            lat, rbad = paged_mla_decode_attention(q_abs, q_pe.contiguous(), kc, context_lens=ctx,
                                                   sm_scale=self.spec.sm_scale, scale=ks, **guard)  # [B, H, L]
            o = torch.einsum("bhl,hvl->bhv", lat.to(torch.float32), a.w_uv).to(self.dtype)  # [B, H, v]
        return a.o(o.reshape(b, -1), self.backend), wbad | rbad


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------
def _kv_scale_source(kv_scales, reader: _Reader):
    """name -> tensor lookup for the KV scales: the argument (mapping or safetensors path), else the checkpoint."""
    if kv_scales is None:
        return reader.get if any(n.endswith("self_attn.k_scale") for n in reader.ckpt.location) else None, "checkpoint"
    if isinstance(kv_scales, (str, os.PathLike)):
        path = Path(kv_scales)
        if not path.is_file():
            raise KVScalesMissing(f"KV-scales file {str(path)!r} does not exist")
        with SafetensorsFile(path) as f:
            table = {n: f.get(n) for n in f.header.tensors}
        return table.get, str(path)
    if isinstance(kv_scales, Mapping):
        return (lambda n: kv_scales.get(n)), "kv_scales"
    raise TypeError("kv_scales must be None, a path to a safetensors file, or a mapping name -> tensor")


def _load_kv_scales(spec: ModelSpec, kv_dtype, kv_scales, reader: _Reader, device) -> list[tuple]:
    """Per layer (k_scale, v_scale) fp32 [1] or [Hkv, 1, 1]; (None, None) for a BF16/FP16 cache."""
    if kv_dtype != FP8_DTYPE:
        return [(None, None)] * spec.num_layers
    lookup, origin = _kv_scale_source(kv_scales, reader)
    if lookup is None:
        raise KVScalesMissing("kv_dtype is float8_e4m3fn but the checkpoint holds no self_attn.k_scale / v_scale")
    out = []
    for i in range(spec.num_layers):
        pair = []
        for kind in ("k", "v") if spec.mla is None else ("k",):  # MLA: one scale for the whole latent
            name = f"model.layers.{i}.self_attn.{kind}_scale"
            t = lookup(name) if (origin != "checkpoint" or reader.has(name)) else None
            if t is None:
                raise KVScalesMissing(f"{name} is missing ({origin})")
            t = torch.as_tensor(t).to(device=device, dtype=torch.float32)
            ok_shape = t.numel() == 1 or (spec.mla is None and tuple(t.shape) == (spec.num_kv_heads, 1, 1))
            if not ok_shape or not bool(torch.isfinite(t).all() and (t > 0).all()):
                raise KVScalesMissing(f"{name} must be positive finite fp32 [1]"
                                      + ("" if spec.mla else f" or [{spec.num_kv_heads}, 1, 1]")
                                      + f", got {list(t.shape)}")
            pair.append(t.reshape(-1, 1, 1) if t.numel() > 1 else t.reshape(1))
        out.append((pair[0], pair[1] if len(pair) > 1 else None))
    return out


def load_runner(checkpoint_dir: str | os.PathLike, *, device="cpu", backend: str = "torch",
                dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype = torch.bfloat16, kv_scales=None,
                page_size: int = 16, num_pages: int = 256, max_requests: int = 8,
                max_pages_per_request: int | None = None) -> Runner:
    """Load a quantkit INT4 checkpoint for running.

    dtype: activation / dense-weight dtype (bf16, fp16; fp32 only with the torch backend).
    kv_dtype: bfloat16, float16 or float8_e4m3fn; FP8 takes per-layer scales from kv_scales (a mapping
    name -> tensor or a safetensors file of model.layers.L.self_attn.{k,v}_scale) or, when None, the
    checkpoint's own. The pool has num_pages pages of page_size tokens; a request may hold
    max_pages_per_request pages (default: all of them)."""
    device = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise RunnerError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    try:
        resolved = resolve_backend(backend, device)
    except (RuntimeError, ValueError) as e:
        raise RunnerError(str(e), hint="use backend='torch', or set TRITON_INTERPRET=1 before importing "
                                       "quantkit.runtime to run the kernels on a CPU") from None
    if kv_dtype not in (torch.bfloat16, torch.float16, FP8_DTYPE):
        raise RunnerError(f"kv_dtype must be bfloat16, float16 or float8_e4m3fn, got {kv_dtype}")
    if resolved == "triton" and dtype == torch.float32:
        raise RunnerError("the Triton kernels take bf16/fp16 activations", hint="use dtype=torch.bfloat16 or "
                                                                                 "backend='torch'")
    ckpt = Checkpoint.open(checkpoint_dir)
    spec = parse_config(ckpt.config)
    scheme = _QuantScheme(ckpt.quantization_config)
    reader = _Reader(ckpt)
    try:
        ld = _Loader(reader, scheme, dtype, device)
        embed = ld.tensor("model.embed_tokens.weight")
        if tuple(embed.shape) != (spec.vocab_size, spec.hidden_size):
            raise UnsupportedCheckpoint(f"model.embed_tokens.weight is {list(embed.shape)}, the config implies "
                                        f"[{spec.vocab_size}, {spec.hidden_size}]")
        layers = [_load_layer(ld, spec, i) for i in range(spec.num_layers)]
        norm = ld.tensor("model.norm.weight")
        if spec.tie_word_embeddings and not reader.has("lm_head.weight"):
            lm_head = embed
        else:
            lm_head = ld.linear("lm_head", (spec.vocab_size, spec.hidden_size)).dense(dtype)
        scales = _load_kv_scales(spec, kv_dtype, kv_scales, reader, device)
    finally:
        reader.close()
    width = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim if spec.mla else spec.head_dim
    k0, v0 = scales[0]
    pool = PagedKVPool(num_pages, page_size, spec.num_kv_heads, width, max_requests=max_requests,
                       max_pages_per_request=max_pages_per_request or num_pages, dtype=kv_dtype,
                       k_scale=k0, v_scale=v0, num_layers=spec.num_layers, latent=spec.mla is not None,
                       device=device)  # the pool's own scales go unused: each layer passes its own
    return Runner(spec, embed, layers, norm, lm_head, pool, scales, backend=backend, dtype=dtype, device=device)
