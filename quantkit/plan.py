"""Memory planner: parameter counts, checkpoint bytes, KV-cache bytes and GPU residency for MoE models.

`plan(model_or_config, recipe)` answers, before anything is downloaded or converted: how many parameters
the model has by role, how many bytes its checkpoint takes as it is and after a recipe (INT4/FP8 laid
out exactly as quantkit writes them), how many bytes one token of KV cache costs in BF16, FP8 and the
DeepSeek `fp8_ds_mla` layout, and how many tokens / concurrent requests fit on N GPUs of G GiB.

Inputs: a config.json, a checkpoint directory (its safetensors headers are read, never the data), or the
name of a shipped reference config (`kimi-k2`, `glm-4.5`, `glm-5`). From a config the checkpoint's
tensors are enumerated under their on-disk Hugging Face names and shapes (checked against
`save_pretrained` output in tests/test_plan.py).

This file is pure arithmetic over shapes. It is not a loader (it never reads tensor data), not a
converter, and it does not model engine internals beyond what is stated in `PlanReport.assumptions`
(sharding rules, activation reserve, which layers cache KV).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .recipe import KVCacheSpec, Recipe, Scheme, WeightGroup, load_recipe

# Legend: D = hidden_size, V = vocab_size, H = attention heads, KV = key/value heads, hd = head_dim,
# I = dense intermediate, Im = expert intermediate, E = routed experts, L = decoder layers (no MTP).

GIB = 1 << 30
# Name -> (shape, safetensors dtype string such as "BF16", "F8_E4M3", "I32").
TensorShapes = dict[str, tuple[tuple[int, ...], str]]

ROLES = ("routed_experts", "shared_experts", "attention", "dense_mlp", "router", "embeddings", "lm_head",
         "norms", "mtp", "vision", "other")
KV_DTYPES = ("bfloat16", "float8_e4m3", "fp8_ds_mla")
_KV_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "auto": "bfloat16", "fp8": "float8_e4m3",
               "fp8_e4m3": "float8_e4m3", "float8_e4m3": "float8_e4m3", "float8_e4m3fn": "float8_e4m3",
               "fp8_ds_mla": "fp8_ds_mla"}
REFERENCE_CONFIGS = ("kimi-k2", "glm-4.5", "glm-5")
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25", "glm4_moe", "glm_moe_dsa", "qwen3_moe",
                         "mixtral", "llama", "qwen3")

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_TORCH_DTYPE = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32"}

# Default activation reserve when none is given: 10% of each GPU (like vLLM's default
# gpu_memory_utilization=0.9). Real engines also spend it on CUDA graphs and allocator slack.
DEFAULT_RESERVE_FRACTION = 0.10
# Shard size assumed for a config-only plan (the hub convention); it only moves the header estimate.
DEFAULT_SHARD_BYTES = 5 * 10**9
# FP8 "fp8_ds_mla" (DeepSeek FlashMLA): FP8 latent with one fp32 scale per 128 values, rope part in BF16.
DS_MLA_TILE = 128


# ---- model description --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs from a config.json, normalized across architectures."""

    model_type: str  # as written in config.json (kimi_k2, kimi_k25, deepseek_v3, ...)
    arch: str  # family: deepseek_v3 | glm4_moe | glm_moe_dsa | qwen3_moe | mixtral | llama | qwen3
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
    quantization: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def source_format(self) -> str:
        q = self.quantization
        if not q:
            return self.dtype.lower()
        if q.get("quant_method") == "fp8":
            return "fp8-block"
        return str(q.get("quant_method"))


def _get(cfg: Mapping, key: str, default: Any = ..., *, where: str = "config.json") -> Any:
    v = cfg.get(key, default)
    if v is ... or (v is None and default is ...):
        raise ConfigError(f"{where} has no {key!r}", hint="pass the model's own config.json (as on the hub)")
    return v


def _int(cfg: Mapping, key: str, default: Any = ...) -> int:
    v = _get(cfg, key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ConfigError(f"config.json {key!r} must be a non-negative integer, got {v!r}")
    return v


def _dtype_of(cfg: Mapping) -> str:
    d = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return _TORCH_DTYPE.get(str(d).replace("torch.", ""), "BF16")


def _indexer_types(cfg: Mapping, n: int) -> list[str]:
    """glm_moe_dsa: which layers run their own indexer ("full") or reuse the previous one ("shared").
    Same derivation as transformers' GlmMoeDsaConfig."""
    t = cfg.get("indexer_types")
    if t is None and cfg.get("index_topk_pattern") is not None:
        p = cfg["index_topk_pattern"]
        t = [{"F": "full", "S": "shared"}[c] for c in p] if isinstance(p, str) else list(p)
    if t is None:
        freq = max(int(cfg.get("index_topk_freq", 1)), 1)
        off = int(cfg.get("index_skip_topk_offset", 2))
        t = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(t) < n or any(x not in ("full", "shared") for x in t):
        raise ConfigError(f"config.json indexer_types must list 'full'/'shared' for all {n} layers")
    return list(t)


def parse_config(config: Mapping[str, Any]) -> ModelSpec:
    """A `ModelSpec` from a config.json dict; raises ConfigError for unsupported or incomplete configs."""
    if not isinstance(config, Mapping):
        raise ConfigError("config.json must be a JSON object")
    model_type = str(config.get("model_type", ""))
    cfg, prefix = config, ""
    if model_type == "kimi_k25":  # multimodal wrapper: the text model sits in text_config
        cfg = config.get("text_config")
        if not isinstance(cfg, Mapping):
            raise ConfigError("kimi_k25 config.json has no text_config object")
        prefix = "language_model."
    inner = str(cfg.get("model_type", "deepseek_v3" if prefix else ""))
    arch = {"kimi_k2": "deepseek_v3", "deepseek_v3": "deepseek_v3"}.get(inner, inner)
    if arch not in ("deepseek_v3", "glm4_moe", "glm_moe_dsa", "qwen3_moe", "mixtral", "llama", "qwen3"):
        raise ConfigError(f"model_type {model_type or '(missing)'!r} is not supported by the planner",
                          hint=f"supported model_type values: {', '.join(SUPPORTED_MODEL_TYPES)}")
    quant = config.get("quantization_config") or cfg.get("quantization_config")

    D, L = _int(cfg, "hidden_size"), _int(cfg, "num_hidden_layers")
    V, H = _int(cfg, "vocab_size"), _int(cfg, "num_attention_heads")
    if L == 0 or H == 0:
        raise ConfigError("config.json num_hidden_layers and num_attention_heads must be positive")
    kv_heads = _int(cfg, "num_key_value_heads", H) or H
    head_dim = cfg.get("head_dim") or D // H
    mtp = _int(cfg, "num_nextn_predict_layers", 0) if arch in ("deepseek_v3", "glm4_moe", "glm_moe_dsa") else 0
    n_all = L + mtp
    common = dict(model_type=model_type, arch=arch, prefix=prefix, dtype=_dtype_of(cfg), vocab_size=V,
                  hidden_size=D, num_layers=L, mtp_layers=mtp, num_heads=H,
                  tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), quantization=quant)

    if arch in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        E = _int(cfg, "n_routed_experts")
        first_dense = _int(cfg, "first_k_dense_replace", 1 if arch == "glm4_moe" else 3)  # transformers' defaults
        if arch == "glm_moe_dsa":
            n_dense = min(first_dense, L)
            types = cfg.get("mlp_layer_types") or ["dense"] * n_dense + ["sparse"] * (L - n_dense)
            if len(types) < L:
                raise ConfigError(f"config.json mlp_layer_types must list 'dense'/'sparse' for all {L} layers")
            moe = tuple(t == "sparse" for t in types[:L]) + (True,) * mtp  # the MTP layer is an MoE layer
        else:
            freq = max(int(cfg.get("moe_layer_freq", 1) or 1), 1)
            moe = tuple(i >= first_dense and i % freq == 0 for i in range(n_all))
        moe_common = dict(moe=moe, intermediate_size=_int(cfg, "intermediate_size"),
                          moe_intermediate_size=_int(cfg, "moe_intermediate_size"), num_experts=E,
                          experts_per_tok=_int(cfg, "num_experts_per_tok"),
                          shared_intermediate=_int(cfg, "moe_intermediate_size") * _int(cfg, "n_shared_experts", 0),
                          router_bias=True, mtp_embeddings=arch in ("deepseek_v3", "glm4_moe"))
        bias = bool(cfg.get("attention_bias", False))
        if arch == "glm4_moe":  # GQA; attention_bias adds q/k/v biases only (o_proj has none)
            return ModelSpec(**common, **moe_common, attention="gqa", num_kv_heads=kv_heads, head_dim=head_dim,
                             qkv_bias=bias, qk_norm=bool(cfg.get("use_qk_norm", False)))
        nope, rope = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim")
        mla = dict(attention="mla", num_kv_heads=1, head_dim=nope + rope, q_lora_rank=cfg.get("q_lora_rank"),
                   kv_lora_rank=_int(cfg, "kv_lora_rank"), qk_rope_head_dim=rope, qk_nope_head_dim=nope,
                   v_head_dim=_int(cfg, "v_head_dim"), qkv_bias=bias, o_bias=bias)
        if arch == "glm_moe_dsa":
            if not mla["q_lora_rank"]:
                raise ConfigError("glm_moe_dsa config.json needs q_lora_rank (the indexer reads the q latent)")
            types = _indexer_types(cfg, L)
            # The MTP layer of GLM-5 ships its own indexer (model.layers.78.self_attn.indexer.*).
            indexer = tuple(t == "full" for t in types[:L]) + (True,) * mtp
            return ModelSpec(**common, **moe_common, **mla, indexer=indexer,
                             index_n_heads=_int(cfg, "index_n_heads"), index_head_dim=_int(cfg, "index_head_dim"))
        return ModelSpec(**common, **moe_common, **mla)

    gqa = dict(attention="gqa", num_kv_heads=kv_heads, head_dim=head_dim)
    if arch == "qwen3_moe":
        E = _int(cfg, "num_experts" if cfg.get("num_experts") is not None else "num_local_experts")
        step = max(_int(cfg, "decoder_sparse_step", 1), 1)
        only = set(cfg.get("mlp_only_layers") or [])
        moe = tuple(i not in only and E > 0 and (i + 1) % step == 0 for i in range(L))
        bias = bool(cfg.get("attention_bias", False))
        return ModelSpec(**common, **gqa, moe=moe, intermediate_size=_int(cfg, "intermediate_size"),
                         moe_intermediate_size=_int(cfg, "moe_intermediate_size"), num_experts=E,
                         experts_per_tok=_int(cfg, "num_experts_per_tok"), shared_intermediate=0,
                         qkv_bias=bias, o_bias=bias, qk_norm=True)
    if arch == "mixtral":
        inter = _int(cfg, "intermediate_size")
        return ModelSpec(**common, **gqa, moe=(True,) * L, intermediate_size=inter, moe_intermediate_size=inter,
                         num_experts=_int(cfg, "num_local_experts"), experts_per_tok=_int(cfg, "num_experts_per_tok"),
                         shared_intermediate=0)
    bias = bool(cfg.get("attention_bias", False))  # llama, qwen3 (dense)
    return ModelSpec(**common, **gqa, moe=(False,) * L, intermediate_size=_int(cfg, "intermediate_size"),
                     moe_intermediate_size=0, num_experts=0, experts_per_tok=0, shared_intermediate=0,
                     qkv_bias=bias, o_bias=bias, qk_norm=arch == "qwen3",
                     mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "llama")


# ---- tensor enumeration (the checkpoint's on-disk names and shapes) ------------------------------------
def _layer_tensors(s: ModelSpec, i: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    p, D, dt = f"{s.prefix}model.layers.{i}.", s.hidden_size, s.dtype
    a = p + "self_attn."
    if s.attention == "mla":
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        if s.q_lora_rank:
            yield a + "q_a_proj.weight", (s.q_lora_rank, D), dt
            if s.qkv_bias:
                yield a + "q_a_proj.bias", (s.q_lora_rank,), dt
            yield a + "q_a_layernorm.weight", (s.q_lora_rank,), dt
            yield a + "q_b_proj.weight", (s.num_heads * qk, s.q_lora_rank), dt
        else:
            yield a + "q_proj.weight", (s.num_heads * qk, D), dt
        yield a + "kv_a_proj_with_mqa.weight", (s.kv_lora_rank + s.qk_rope_head_dim, D), dt
        if s.qkv_bias:
            yield a + "kv_a_proj_with_mqa.bias", (s.kv_lora_rank + s.qk_rope_head_dim,), dt
        yield a + "kv_a_layernorm.weight", (s.kv_lora_rank,), dt
        yield a + "kv_b_proj.weight", (s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank), dt
        yield a + "o_proj.weight", (D, s.num_heads * s.v_head_dim), dt
        if s.o_bias:
            yield a + "o_proj.bias", (D,), dt
        if s.indexer and s.indexer[i]:
            x, n, hd = a + "indexer.", s.index_n_heads, s.index_head_dim
            yield x + "wq_b.weight", (n * hd, s.q_lora_rank), dt  # [n*hd, q_lora_rank]
            yield x + "wk.weight", (hd, D), dt  # one K head shared by all index heads
            yield x + "k_norm.weight", (hd,), dt  # LayerNorm: weight and bias
            yield x + "k_norm.bias", (hd,), dt
            yield x + "weights_proj.weight", (n, D), dt
    else:
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield a + proj + ".weight", (out, D), dt
            if s.qkv_bias:
                yield a + proj + ".bias", (out,), dt
        yield a + "o_proj.weight", (D, q), dt
        if s.o_bias:
            yield a + "o_proj.bias", (D,), dt
        if s.qk_norm:
            yield a + "q_norm.weight", (s.head_dim,), dt
            yield a + "k_norm.weight", (s.head_dim,), dt
    yield p + "input_layernorm.weight", (D,), dt
    yield p + "post_attention_layernorm.weight", (D,), dt
    if not s.moe[i]:
        yield from _mlp(p + "mlp.", D, s.intermediate_size, dt, s.mlp_bias)
        return
    E, Im = s.num_experts, s.moe_intermediate_size
    if s.arch == "mixtral":
        m = p + "block_sparse_moe."
        for e in range(E):
            x = f"{m}experts.{e}."
            yield x + "w1.weight", (Im, D), dt  # gate
            yield x + "w2.weight", (D, Im), dt  # down
            yield x + "w3.weight", (Im, D), dt  # up
        yield m + "gate.weight", (E, D), dt
        return
    m = p + "mlp."
    for e in range(E):
        yield from _mlp(f"{m}experts.{e}.", D, Im, dt)
    yield m + "gate.weight", (E, D), dt  # router [E, D]
    if s.router_bias:
        yield m + "gate.e_score_correction_bias", (E,), "F32"  # float32 in the DeepSeek/Kimi/GLM releases
    if s.shared_intermediate:
        yield from _mlp(m + "shared_experts.", D, s.shared_intermediate, dt)


def _mlp(p: str, D: int, inter: int, dt: str, bias: bool = False) -> Iterator[tuple[str, tuple[int, ...], str]]:
    for proj, shape in (("gate_proj", (inter, D)), ("up_proj", (inter, D)), ("down_proj", (D, inter))):
        yield p + proj + ".weight", shape, dt
        if bias:
            yield p + proj + ".bias", (shape[0],), dt


def enumerate_tensors(spec: ModelSpec, *, mtp: bool = True) -> TensorShapes:
    """The unquantized checkpoint's tensors by on-disk name: {name: (shape, dtype)}.

    `mtp=True` includes the MTP layers as the hub releases ship them (DeepSeek-V3: layer 61, GLM-4.5:
    layer 92, GLM-5: layer 78); transformers' `save_pretrained` drops them, so pass `mtp=False` to
    compare with a checkpoint written by transformers."""
    s, D, V, dt = spec, spec.hidden_size, spec.vocab_size, spec.dtype
    out: TensorShapes = {}
    top = f"{s.prefix}model."
    out[top + "embed_tokens.weight"] = ((V, D), dt)
    out[top + "norm.weight"] = ((D,), dt)
    if not s.tie_word_embeddings:
        out[f"{s.prefix}lm_head.weight"] = ((V, D), dt)
    for i in range(s.num_layers + (s.mtp_layers if mtp else 0)):
        for name, shape, d in _layer_tensors(s, i):
            out[name] = (shape, d)
        if i >= s.num_layers:  # MTP extras around the decoder block
            p = f"{top}layers.{i}."
            out[p + "enorm.weight"] = ((D,), dt)
            out[p + "hnorm.weight"] = ((D,), dt)
            out[p + "eh_proj.weight"] = ((D, 2 * D), dt)  # [D, 2D]: concat(embedding, hidden) -> hidden
            out[p + "shared_head.norm.weight"] = ((D,), dt)
            if s.mtp_embeddings:
                out[p + "embed_tokens.weight"] = ((V, D), dt)
                out[p + "shared_head.head.weight"] = ((V, D), dt)
    return out


# ---- roles -------------------------------------------------------------------------------------------
_VISION_PREFIXES = ("vision_tower.", "mm_projector.", "visual.", "vision_model.", "multi_modal_projector.")


def _layer_index(name: str) -> int | None:
    i = name.find("layers.")
    if i < 0 or (i and name[i - 1] != "."):
        return None
    j = name.find(".", i + 7)
    idx = name[i + 7:j]
    return int(idx) if idx.isdigit() else None


def tensor_role(name: str, num_layers: int | None = None) -> str:
    """The role of a tensor (one of ROLES) from its name; layers >= num_layers are MTP layers.
    (Plain substring tests: this runs once per tensor, ~10^5 times for a 1T-parameter model.)"""
    if name.startswith(_VISION_PREFIXES):
        return "vision"
    if num_layers is not None:
        li = _layer_index(name)
        if li is not None and li >= num_layers:
            return "mtp"
    if ".experts." in name:
        return "routed_experts"
    if ".shared_expert" in name:  # shared_experts (DeepSeek/GLM), shared_expert(_gate) (Qwen2-MoE style)
        return "shared_experts"
    if ".mlp.gate." in name or ".block_sparse_moe.gate." in name:
        return "router"
    module = name.rsplit(".", 1)[0]
    if module.endswith("norm"):  # input_layernorm, q_a_layernorm, k_norm, model.norm, enorm, ...
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "dense_mlp"
    if "embed_tokens." in name:
        return "embeddings"
    if name.startswith("lm_head.") or ".lm_head." in name:
        return "lm_head"
    return "other"


# ---- bytes as quantkit writes them ---------------------------------------------------------------------
def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


_BYTES_MEMO: dict[tuple[tuple[int, ...], str], int] = {}


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of one stored tensor (memoized: a 1T-parameter model has ~10^5 tensors but few shapes)."""
    key = (shape, dtype)
    b = _BYTES_MEMO.get(key)
    if b is None:
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown safetensors dtype {dtype!r}",
                              hint=f"known: {', '.join(sorted(DTYPE_BYTES))}")
        b = _BYTES_MEMO[key] = _numel(shape) * DTYPE_BYTES[dtype]
    return b


_EMBED_MODULES = ("embed_tokens", "wte", "word_embeddings", "embeddings")
_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                   "input_scale", "k_scale", "v_scale")


def _is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """A Linear's 2-D weight (what a recipe can quantize). Embeddings and norms are not Linears."""
    if not name.endswith(".weight") or len(shape) != 2:
        return False
    return name[:-7].rsplit(".", 1)[-1] not in _EMBED_MODULES


def _quantized_tensors(module: str, out: int, k: int, src_dtype: str, scheme: Scheme,
                       actorder_group: bool = False) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """The tensors that replace `<module>.weight` [out, k] (compressed-tensors pack-/float-quantized)."""
    if scheme.type == "int":
        pack = 32 // scheme.num_bits  # values per int32 word (8 for INT4)
        groups = 1 if scheme.strategy == "channel" else k // scheme.group_size
        yield module + ".weight_packed", (out, -(-k // pack)), "I32"  # [out, ceil(k/8)]
        # The scale keeps the weight's float dtype (bf16); FP8 sources are dequantized to bf16 first.
        yield module + ".weight_scale", (out, groups), "BF16" if src_dtype.startswith("F8") else src_dtype
        yield module + ".weight_shape", (2,), "I64"  # [out, k]
        if not scheme.symmetric:
            yield module + ".weight_zero_point", (-(-out // pack), groups), "I32"  # packed along dim 0
        if actorder_group:
            yield module + ".weight_g_idx", (k,), "I32"
        return
    yield module + ".weight", (out, k), "F8_E4M3"
    if scheme.strategy == "tensor":
        yield module + ".weight_scale", (1,), "F32"
    elif scheme.strategy == "channel":
        yield module + ".weight_scale", (out, 1), "F32"
    else:
        b0, b1 = scheme.block_structure
        yield module + ".weight_scale", (-(-out // b0), -(-k // b1)), "F32"


_FUSED_RE = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?$")


def _split_fused_experts(name: str, shape: tuple[int, ...],
                         dtype: str) -> list[tuple[str, tuple[int, ...], str]] | None:
    """Fused 3-D experts ([E, 2*Im, D] gate_up_proj, [E, D, Im] down_proj) as per-expert weights, the way
    quantkit writes them; None if `name` is not a fused expert tensor."""
    if len(shape) != 3:
        return None
    m = _FUSED_RE.match(name)
    if not m:
        return None
    base, kind = m.groups()
    E, a, b = shape
    if kind == "down_proj":
        return [(f"{base}.{e}.down_proj.weight", (a, b), dtype) for e in range(E)]
    return [(f"{base}.{e}.{p}.weight", (a // 2, b), dtype) for e in range(E) for p in ("gate_proj", "up_proj")]


def quantized_layout(tensors: Mapping[str, tuple[tuple[int, ...], str]], recipe: Recipe | None, *,
                     spec: ModelSpec | None = None) -> TensorShapes:
    """The checkpoint `tensors` become after `recipe`, as quantkit writes it (recipe None: unchanged).

    Per Linear weight `X.weight` [out, k]: `group = recipe.match("X")`; None keeps `X.weight` (and an
    FP8 source's `X.weight_scale_inv`) as is, otherwise the scheme's tensors replace them. Every other
    tensor (norms, biases, embeddings, router bias) is kept. With `recipe.kv_cache`, k_scale/v_scale
    float32 tensors are added to every attention module of the decoder layers (not MTP layers)."""
    if recipe is None:
        return dict(tensors)
    out: TensorShapes = {}
    dropped: set[str] = set()
    # (group, shape, dtype) -> the replacement tensors as (suffix, shape, dtype): all experts of a model
    # share a handful of shapes, so each scheme is applied (and for_in_features checked) once per shape.
    memo: dict[tuple[int, tuple[int, ...], str], tuple[tuple[str, tuple[int, ...], str], ...]] = {}
    for name, (shape, dtype) in tensors.items():
        if type(shape) is not tuple:
            shape = tuple(shape)
        split = _split_fused_experts(name, shape, dtype) if len(shape) == 3 else None
        if split and any(recipe.match(n[:-7]) for n, _, _ in split):
            todo = split
        else:
            todo = ((name, shape, dtype),)
        for name, shape, dtype in todo:
            if not _is_linear_weight(name, shape):
                out[name] = (shape, dtype)
                continue
            module = name[:-7]
            group = recipe.match(module)
            if group is None:
                out[name] = (shape, dtype)
                continue
            key = (id(group), shape, dtype)
            parts = memo.get(key)
            if parts is None:
                scheme = group.scheme.for_in_features(shape[1])  # may raise GroupSizeError
                actorder = str(group.option("actorder", "")) == "group"
                parts = memo[key] = tuple(_quantized_tensors("", shape[0], shape[1], dtype, scheme, actorder))
            for suffix, sh, d in parts:
                out[module + suffix] = (sh, d)
            dropped.add(module + ".weight_scale_inv")
    for n in dropped:
        out.pop(n, None)
    if recipe.kv_cache is not None:
        out.update(_kv_scale_tensors(tensors, recipe.kv_cache, spec))
    return out


def _kv_scale_tensors(tensors: Mapping, kv: KVCacheSpec, spec: ModelSpec | None) -> TensorShapes:
    attn: dict[str, int] = {}
    for name in tensors:
        m = re.match(r"^(.*layers\.(\d+)\.self_attn)\.", name)
        if m and (spec is None or int(m.group(2)) < spec.num_layers):
            attn[m.group(1)] = int(m.group(2))
    mla = any(".kv_a_proj_with_mqa." in n for n in tensors) if spec is None else spec.attention == "mla"
    if kv.strategy == "tensor":
        shape: tuple[int, ...] = (1,)
    elif mla:
        shape = (1, 1, 1)  # MLA caches one latent "head" per token
    elif spec is not None:
        shape = (spec.num_kv_heads, 1, 1)
    else:
        raise ConfigError("kv_cache strategy attn_head needs the number of KV heads",
                          hint="pass spec=parse_config(config) to predict_bytes")
    out: TensorShapes = {}
    for a in attn:
        out[a + ".k_scale"] = (shape, "F32")
        out[a + ".v_scale"] = (shape, "F32")
    return out


def header_bytes(tensors: Mapping[str, tuple[tuple[int, ...], str]], n_shards: int = 1) -> int:
    """Estimated safetensors header bytes for `tensors` written in `n_shards` files: per shard the 8-byte
    length, the compact JSON (`{"__metadata__":{"format":"pt"},"name":{"dtype":..,"shape":[..],
    "data_offsets":[a,b]},...}`) and the padding to 8 bytes. Offsets are simulated (name order)."""
    n_shards = max(1, n_shards)
    names = sorted(tensors)
    sizes = [tensor_bytes(*tensors[n]) for n in names]
    target = sum(sizes) / n_shards
    total, shard_json, off, used = 0, 0, 0, 0
    shape_len: dict[tuple[int, ...], int] = {}
    fixed = len(',"":{"dtype":"","shape":[],"data_offsets":[,]}')

    def close(js: int) -> float:
        raw = js + len('{"__metadata__":{"format":"pt"}}')
        return 8 + raw + 3.5  # 8-byte length prefix; padding to 8 bytes averages 3.5

    for name, nb in zip(names, sizes):
        if off and off + nb > target and used < n_shards - 1:
            total += close(shard_json)
            shard_json, off, used = 0, 0, used + 1
        shape, dtype = tensors[name]
        sl = shape_len.get(shape)
        if sl is None:
            sl = shape_len[shape] = len(",".join(str(x) for x in shape))
        # ,"name":{"dtype":"BF16","shape":[a,b],"data_offsets":[x,y]}
        shard_json += len(name) + len(dtype) + sl + len(str(off)) + len(str(off + nb)) + fixed
        off += nb
    total += close(shard_json)
    return int(round(total))


def predict_bytes(tensor_shapes: Mapping[str, tuple[tuple[int, ...], str]], recipe: Recipe | str | None, *,
                  spec: ModelSpec | None = None, n_shards: int | None = None, header: bool = True) -> int:
    """Bytes of the checkpoint `tensor_shapes` describe after `recipe` (a Recipe, a recipe name or path,
    or None for the checkpoint as it is), with the safetensors headers of `n_shards` files (default: one
    per DEFAULT_SHARD_BYTES) unless `header=False`."""
    if isinstance(recipe, (str, Path)):
        recipe = load_recipe(recipe)
    layout = quantized_layout(tensor_shapes, recipe, spec=spec)
    data = sum(tensor_bytes(sh, d) for sh, d in layout.values())
    if not header:
        return data
    if n_shards is None:
        n_shards = max(1, -(-data // DEFAULT_SHARD_BYTES))
    return data + header_bytes(layout, n_shards)


# ---- source layouts of quantized releases ---------------------------------------------------------------
# Kept in BF16 by the DeepSeek-style FP8 block releases (DeepSeek-V3, Kimi K2, GLM FP8): not nn.Linear
# in their modeling code (router), or precision-sensitive by convention.
_FP8_KEEP = re.compile(r"(?:^|\.)(?:lm_head|shared_head\.head|eh_proj|gate|weights_proj)$")


def _not_converted(module: str, entries: list[str]) -> bool:
    return any(module == e or module.startswith(e + ".") or module.endswith("." + e) for e in entries)


def fp8_block_layout(tensors: Mapping[str, tuple[tuple[int, ...], str]], qc: Mapping[str, Any]) -> TensorShapes:
    """`tensors` as an FP8 block checkpoint (`quant_method: fp8`) stores them: each Linear weight as
    float8_e4m3fn plus `weight_scale_inv` float32 [ceil(out/b0), ceil(in/b1)]; embeddings, lm_head,
    routers, eh_proj, the indexer's weights_proj and `modules_to_not_convert` stay as they are."""
    b0, b1 = tuple(qc.get("weight_block_size") or (128, 128))
    skip = [str(e) for e in (qc.get("modules_to_not_convert") or [])]
    out: TensorShapes = {}
    for name, (shape, dtype) in tensors.items():
        module = name[:-7]
        if (not _is_linear_weight(name, shape) or _FP8_KEEP.search(module) or name.startswith(_VISION_PREFIXES)
                or (skip and _not_converted(module, skip))):
            out[name] = (shape, dtype)
            continue
        n_out, k = shape
        out[name] = (shape, "F8_E4M3")
        out[module + ".weight_scale_inv"] = ((-(-n_out // b0), -(-k // b1)), "F32")  # [ceil(out/b0), ceil(k/b1)]
    return out


_ROUTERS = (r"re:.*\.mlp\.gate$", r"re:.*\.block_sparse_moe\.gate$")


def recipe_from_quantization_config(qc: Mapping[str, Any]) -> Recipe:
    """A Recipe equivalent to a compressed-tensors `quantization_config` (used to size its source bytes).
    The target "Linear" means every Linear; routers are not nn.Linear in the MoE modeling code."""
    groups = []
    for gname, g in (qc.get("config_groups") or {}).items():
        w = (g or {}).get("weights")
        if not w:
            continue
        try:
            scheme = Scheme(num_bits=int(w.get("num_bits", 4)), type=w.get("type", "int"),
                            symmetric=bool(w.get("symmetric", True)), strategy=w.get("strategy", "group"),
                            group_size=w.get("group_size"),
                            block_structure=tuple(w["block_structure"]) if w.get("block_structure") else None)
        except Exception as e:  # RecipeError: a scheme quantkit does not write
            raise ConfigError(f"quantization_config group {gname!r}: {getattr(e, 'message', e)}",
                              hint="the planner sizes pack-quantized INT4/INT8 and FP8 schemes") from None
        targets = tuple("re:.*" if t == "Linear" else str(t) for t in (g.get("targets") or ["Linear"]))
        options = (("actorder", w["actorder"]),) if w.get("actorder") else ()
        groups.append(WeightGroup(str(gname), targets, scheme, "rtn", options))
    if not groups:
        raise ConfigError("compressed-tensors quantization_config has no weight groups")
    kv = qc.get("kv_cache_scheme")
    kv_spec = KVCacheSpec(kv.get("strategy", "tensor")) if isinstance(kv, Mapping) else None
    ignore = tuple(str(x) for x in (qc.get("ignore") or [])) + _ROUTERS
    return Recipe(name="quantization_config", groups=tuple(groups), ignore=ignore, kv_cache=kv_spec)


def source_tensors(spec: ModelSpec, *, mtp: bool = True) -> TensorShapes:
    """The tensors of the checkpoint a config.json describes, in its own format (BF16, FP8 block, or
    compressed-tensors as its quantization_config says)."""
    t = enumerate_tensors(spec, mtp=mtp)
    q = spec.quantization
    if not q:
        return t
    method = q.get("quant_method")
    if method == "fp8":
        return fp8_block_layout(t, q)
    if method == "compressed-tensors":
        return quantized_layout(t, recipe_from_quantization_config(q), spec=spec)
    raise ConfigError(f"quantization_config quant_method {method!r} is not supported by the planner",
                      hint="supported: no quantization_config (BF16), quant_method fp8 (block), compressed-tensors")


# ---- parameters -------------------------------------------------------------------------------------
def parameter_count(name: str, shape: tuple[int, ...], dtype: str) -> int:
    """Parameters a stored tensor holds: scales, zero points and shapes hold none; a packed INT4 word
    holds 8 (INT8 checkpoints are counted as INT4 too: the header alone does not say)."""
    last = name.rsplit(".", 1)[-1]
    if last in _SCALE_SUFFIXES:
        return 0
    if last == "weight_packed":
        return _numel(shape) * 8
    return _numel(shape)


def _by_role(tensors: Mapping[str, tuple[tuple[int, ...], str]], num_layers: int, fn) -> dict[str, int]:
    acc = dict.fromkeys(ROLES, 0)
    memo: dict[str, str] = {}  # module -> role: X.weight, X.weight_scale, X.weight_shape share one lookup
    for name, (shape, dtype) in tensors.items():
        module = name.rpartition(".")[0]
        role = memo.get(module) if module else None
        if role is None:
            role = tensor_role(name, num_layers)
            if module:
                memo[module] = role
        acc[role] += fn(name, tuple(shape), dtype)
    return acc


# ---- KV cache -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVLayout:
    """What one token caches per layer. GQA: K and V of every KV head; MLA: one latent of kv_lora_rank
    values plus the rotated k_pe of qk_rope_head_dim values; DSA indexer: one K of index_head_dim."""

    kind: str  # "gqa" | "mla"
    layers: int  # layers with a KV cache (decoder layers; MTP layers are not served)
    kv_heads: int  # GQA KV heads (MLA: 1)
    head_dim: int  # GQA head_dim
    latent: int = 0  # MLA kv_lora_rank
    rope: int = 0  # MLA qk_rope_head_dim
    indexer_layers: int = 0
    indexer_dim: int = 0

    @property
    def values_per_layer(self) -> int:
        return self.latent + self.rope if self.kind == "mla" else 2 * self.kv_heads * self.head_dim

    def bytes_per_token(self, dtype: str, tp: int = 1) -> int | None:
        """Bytes one token of KV takes on one GPU of a TP group of `tp` (tp=1: the whole model).
        MLA latents and indexer keys are replicated on every rank; GQA KV heads shard over the ranks
        (ceil(kv_heads / tp) per rank: replicated once tp exceeds the head count)."""
        if dtype not in KV_DTYPES:
            raise ConfigError(f"unknown KV dtype {dtype!r}", hint=f"choose one of {', '.join(KV_DTYPES)}")
        if self.kind == "mla":
            if dtype == "bfloat16":
                per = 2 * (self.latent + self.rope)
            elif dtype == "float8_e4m3":
                per = self.latent + self.rope  # one per-tensor scale: nothing per token
            else:  # latent in FP8 + fp32 scale per 128 values, rope kept in BF16 (512 + 16 + 128 = 656)
                per = self.latent + 4 * -(-self.latent // DS_MLA_TILE) + 2 * self.rope
        else:
            if dtype == "fp8_ds_mla":
                return None
            heads = -(-self.kv_heads // max(1, tp))
            per = 2 * heads * self.head_dim * (2 if dtype == "bfloat16" else 1)
        idx = 0
        if self.indexer_layers:
            d = self.indexer_dim
            idx = {"bfloat16": 2 * d, "float8_e4m3": d, "fp8_ds_mla": d + 4 * -(-d // DS_MLA_TILE)}[dtype]
        return self.layers * per + self.indexer_layers * idx


def kv_layout(spec: ModelSpec) -> KVLayout:
    idx = sum(spec.indexer[: spec.num_layers]) if spec.indexer else 0
    if spec.attention == "mla":
        return KVLayout("mla", spec.num_layers, 1, 0, spec.kv_lora_rank, spec.qk_rope_head_dim, idx,
                        spec.index_head_dim)
    return KVLayout("gqa", spec.num_layers, spec.num_kv_heads, spec.head_dim)


# ---- loading inputs ------------------------------------------------------------------------------------
def _tensor_shapes_from_checkpoint(directory: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} from the safetensors headers of `directory` (metadata only, no data read)."""
    from safetensors import safe_open

    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                out[k] = (tuple(int(x) for x in sl.get_shape()), str(sl.get_dtype()))
    return out


@dataclass(frozen=True)
class _Source:
    label: str
    config: Mapping[str, Any]
    checkpoint: Path | None  # directory with *.safetensors, or None (config only)


def _read_json(path: Path) -> Mapping[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return doc


def reference_config(name: str) -> dict[str, Any]:
    """A shipped reference config.json (`kimi-k2`, `glm-4.5`, `glm-5`), `_source` provenance included."""
    res = resources.files("quantkit") / "data" / "configs" / f"{name}.json"
    if name not in REFERENCE_CONFIGS or not res.is_file():
        raise ConfigError(f"no reference config named {name!r}", hint=f"shipped: {', '.join(REFERENCE_CONFIGS)}")
    return json.loads(res.read_text(encoding="utf-8"))


def _resolve(model_or_config: str | Path) -> _Source:
    p = Path(model_or_config)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(f"{p} has no config.json", hint="pass a checkpoint directory or a config.json file")
        has_shards = any(p.glob("*.safetensors"))
        return _Source(str(p), _read_json(p / "config.json"), p if has_shards else None)
    if p.is_file():
        return _Source(str(p), _read_json(p), None)
    name = str(model_or_config)
    if name in REFERENCE_CONFIGS:
        return _Source(name, reference_config(name), None)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name):  # a hub id already in the local cache (never downloads)
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except Exception:
            cached = None
        if isinstance(cached, str):
            d = Path(cached).parent
            return _Source(name, _read_json(Path(cached)), d if any(d.glob("*.safetensors")) else None)
    raise ConfigError(f"{name!r} is not a config.json, a checkpoint directory or a reference config name",
                      hint=f"reference configs: {', '.join(REFERENCE_CONFIGS)}")


# ---- the report ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanReport:
    """Everything `plan` computed. Bytes are bytes; GiB = 2**30 bytes."""

    model: str
    model_type: str
    arch: str
    source_format: str
    recipe: str | None
    parameters: Mapping[str, int]  # by role, plus "total"
    active_parameters: int  # per token: everything but the routed experts and MTP, plus top-k/E of them
    checkpoint_bytes: Mapping[str, int | None]  # {"source", "recipe"}
    bytes_by_role: Mapping[str, Mapping[str, int | None]]  # role -> {"source", "recipe"}
    kv: KVLayout
    kv_bytes_per_token: Mapping[str, int | None]  # whole model, per KV dtype
    kv_bytes_per_token_per_gpu: Mapping[str, int | None]
    kv_tokens: Mapping[str, int | None]
    max_concurrency: Mapping[str, int | None]
    kv_dtype: str  # the dtype the summary highlights
    gpus: int
    tp: int
    gpu_memory_gib: float
    context_len: int
    activation_reserve_gib: float
    weight_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int
    assumptions: tuple[str, ...]
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The `quantkit plan --json` object. Contract keys: parameters, checkpoint_bytes,
        kv_bytes_per_token, kv_tokens, max_concurrency; the rest is extra detail."""
        kv = self.kv
        return {
            "parameters": dict(self.parameters),
            "checkpoint_bytes": dict(self.checkpoint_bytes),
            "kv_bytes_per_token": dict(self.kv_bytes_per_token),
            "kv_tokens": dict(self.kv_tokens),
            "max_concurrency": dict(self.max_concurrency),
            "model": {"name": self.model, "model_type": self.model_type, "arch": self.arch,
                      "source_format": self.source_format, "recipe": self.recipe},
            "active_parameters": self.active_parameters,
            "bytes_by_role": {r: dict(v) for r, v in self.bytes_by_role.items()},
            "kv_cache": {"kind": kv.kind, "layers": kv.layers, "values_per_layer": kv.values_per_layer,
                         "indexer_layers": kv.indexer_layers, "indexer_values_per_layer": kv.indexer_dim,
                         "selected_dtype": self.kv_dtype},
            "per_gpu": {"gpus": self.gpus, "tp": self.tp, "replicas": self.gpus // self.tp,
                        "gpu_memory_bytes": int(self.gpu_memory_gib * GIB),
                        "activation_reserve_bytes": int(self.activation_reserve_gib * GIB),
                        "weight_bytes": self.weight_bytes_per_gpu,
                        "kv_budget_bytes": self.kv_budget_bytes_per_gpu,
                        "kv_bytes_per_token": dict(self.kv_bytes_per_token_per_gpu)},
            "context_len": self.context_len,
            "assumptions": list(self.assumptions),
            "warnings": list(self.warnings),
        }


def _kv_dtype(kv_dtype: str | None, recipe: Recipe | None, kind: str) -> str:
    if kv_dtype is None:
        return "float8_e4m3" if recipe is not None and recipe.kv_cache is not None else "bfloat16"
    d = _KV_ALIASES.get(str(kv_dtype).lower())
    if d is None:
        raise ConfigError(f"unknown kv_dtype {kv_dtype!r}", hint=f"choose one of {', '.join(KV_DTYPES)}")
    if d == "fp8_ds_mla" and kind != "mla":
        raise ConfigError("kv_dtype fp8_ds_mla applies to MLA models only (DeepSeek-V3, Kimi K2, GLM-5)")
    return d


def plan(model_or_config: str | Path, recipe: str | Recipe | None = None, *, gpu_memory_gib: float = 80, gpus: int = 8,
         context_len: int = 131072, tp: int | None = None, activation_reserve_gib: float | None = None,
         kv_dtype: str | None = None) -> PlanReport:
    """Plan memory for `model_or_config` (config.json, checkpoint directory, or reference config name),
    optionally after `recipe`, served on `gpus` GPUs of `gpu_memory_gib` GiB with tensor parallelism
    `tp` (default: all GPUs; gpus/tp data-parallel replicas otherwise) at `context_len` tokens per request.
    `activation_reserve_gib` per GPU is kept free of weights and KV (default 10% of the GPU)."""
    tp = gpus if tp is None else tp
    if gpus < 1 or tp < 1 or gpus % tp:
        raise ConfigError(f"gpus={gpus} must be a positive multiple of tp={tp}",
                          hint="tp GPUs hold one copy of the model; gpus/tp copies serve in parallel")
    if gpu_memory_gib <= 0 or context_len < 1 or (activation_reserve_gib is not None and activation_reserve_gib < 0):
        raise ConfigError("gpu_memory_gib and context_len must be positive and the activation reserve >= 0")
    src = _resolve(model_or_config)
    spec = parse_config(src.config)
    rec = load_recipe(recipe) if isinstance(recipe, (str, Path)) else recipe
    kv_sel = _kv_dtype(kv_dtype, rec, "mla" if spec.attention == "mla" else "gqa")
    if rec is not None and spec.quantization and spec.quantization.get("quant_method") == "compressed-tensors":
        raise ConfigError("the source is already a compressed-tensors checkpoint; quantkit quantizes BF16 or "
                          "FP8 block sources", hint="plan the recipe from the original BF16/FP8 checkpoint")
    assumptions: list[str] = []
    warnings: list[str] = []

    # Tensors: the real headers of a checkpoint directory, or the hub layout enumerated from config.json.
    if src.checkpoint is not None:
        tensors = _tensor_shapes_from_checkpoint(src.checkpoint)
        shard_files = sorted(src.checkpoint.glob("*.safetensors"))
        n_shards = len(shard_files)
        source_total = sum(f.stat().st_size for f in shard_files)
        assumptions.append(f"tensors: read from the safetensors headers of {n_shards} shard(s); source bytes are "
                           "the shard file sizes")
    else:
        tensors = source_tensors(spec)
        n_shards = None
        source_total = predict_bytes(tensors, None)
        mtp_note = (f"; the {spec.mtp_layers} MTP layer(s) the hub release ships are included"
                    if spec.mtp_layers else "")
        assumptions.append(f"tensors: enumerated from config.json in the hub layout ({spec.source_format}"
                           f"{mtp_note}); header bytes estimated for {DEFAULT_SHARD_BYTES // 10**9} GB shards")
        if spec.prefix:
            assumptions.append("kimi_k25: text model only (the vision tower is not enumerated from a config)")
        if spec.quantization and spec.quantization.get("quant_method") == "fp8":
            assumptions.append("fp8 source: every Linear in FP8 with float32 128x128 weight_scale_inv; embeddings, "
                               "lm_head, routers, eh_proj, indexer weights_proj and norms in BF16")

    # Parameters come from the unquantized enumeration for configs (exact), from headers for directories.
    logical = enumerate_tensors(spec) if src.checkpoint is None and spec.quantization else tensors
    params = _by_role(logical, spec.num_layers, parameter_count)
    params["total"] = sum(params[r] for r in ROLES)
    routed = params["routed_experts"]
    active = params["total"] - params["mtp"] - routed
    if spec.num_experts:
        active += routed * spec.experts_per_tok // spec.num_experts

    src_role = _by_role(tensors, spec.num_layers, lambda n, s, d: tensor_bytes(s, d))
    rec_total, rec_role = None, None
    if rec is not None:
        layout = quantized_layout(tensors, rec, spec=spec)
        rec_data = sum(tensor_bytes(sh, d) for sh, d in layout.values())
        rec_total = rec_data + header_bytes(layout, n_shards or max(1, -(-rec_data // DEFAULT_SHARD_BYTES)))
        rec_role = _by_role(layout, spec.num_layers, lambda n, s, d: tensor_bytes(s, d))
    bytes_by_role = {r: {"source": src_role[r], "recipe": rec_role[r] if rec_role else None}
                     for r in ROLES if src_role[r] or (rec_role and rec_role[r])}

    # GPU residency. MTP weights are not loaded (no speculative decoding) and cache no KV.
    resident = sum((rec_role or src_role)[r] for r in ROLES if r != "mtp")
    weights_per_gpu = -(-resident // tp)
    reserve_gib = (DEFAULT_RESERVE_FRACTION * gpu_memory_gib if activation_reserve_gib is None
                   else activation_reserve_gib)
    gpu_bytes = int(gpu_memory_gib * GIB)
    budget = gpu_bytes - int(reserve_gib * GIB) - weights_per_gpu
    if budget <= 0:
        warnings.append(f"weights ({weights_per_gpu / GIB:.1f} GiB per GPU at tp={tp}) plus the reserve "
                        f"({reserve_gib:.1f} GiB) exceed {gpu_memory_gib:g} GiB: no room for KV cache")
        budget = 0
    kv = kv_layout(spec)
    replicas = gpus // tp
    kv_total = {d: kv.bytes_per_token(d) for d in KV_DTYPES}
    kv_gpu = {d: kv.bytes_per_token(d, tp) for d in KV_DTYPES}
    tokens = {d: None if b is None else replicas * (budget // b) for d, b in kv_gpu.items()}
    conc = {d: None if b is None else replicas * ((budget // b) // context_len) for d, b in kv_gpu.items()}

    w_label = f"recipe {rec.name}" if rec else f"source ({spec.source_format})"
    assumptions += [
        f"weights on GPU: {w_label} bytes without MTP layers, split evenly over tp={tp} "
        f"({replicas} replica(s)); replicated small tensors (norms, routers) are not double-counted",
        f"activation reserve: {reserve_gib:g} GiB per GPU"
        + (f" (default: {DEFAULT_RESERVE_FRACTION:.0%} of the GPU)" if activation_reserve_gib is None else ""),
        "KV cached by the decoder layers only (MTP layers serve no KV); float8_e4m3 = 1 byte per value "
        "with per-tensor scales",
        ("MLA: one latent (kv_lora_rank + qk_rope_head_dim values) per token per layer, replicated on every "
         "TP rank; fp8_ds_mla = FP8 latent + one fp32 scale per 128 values + BF16 rope (656 B/layer for 512+64)")
        if kv.kind == "mla" else
        f"GQA: K and V of {kv.kv_heads} KV heads x {kv.head_dim}; heads shard over TP ranks "
        f"({-(-kv.kv_heads // tp)} per GPU at tp={tp}, replicated beyond {kv.kv_heads})",
        f"max_concurrency = resident tokens // context_len ({context_len:,} tokens per request)",
    ]
    if kv.indexer_layers:
        assumptions.append(f"DSA indexer: one {kv.indexer_dim}-value key per token in {kv.indexer_layers} layers "
                           "(BF16 2 B, FP8 1 B per value; fp8_ds_mla adds one fp32 scale per 128 values)")
    if spec.quantization and spec.quantization.get("quant_method") == "fp8" and rec is not None:
        assumptions.append("recipe on an FP8 source: tensors the recipe does not target stay FP8 as they are")

    return PlanReport(
        model=src.label, model_type=spec.model_type, arch=spec.arch, source_format=spec.source_format,
        recipe=rec.name if rec else None, parameters=params, active_parameters=active,
        checkpoint_bytes={"source": source_total, "recipe": rec_total}, bytes_by_role=bytes_by_role, kv=kv,
        kv_bytes_per_token=kv_total, kv_bytes_per_token_per_gpu=kv_gpu, kv_tokens=tokens, max_concurrency=conc,
        kv_dtype=kv_sel, gpus=gpus, tp=tp, gpu_memory_gib=gpu_memory_gib,
        context_len=context_len, activation_reserve_gib=reserve_gib, weight_bytes_per_gpu=weights_per_gpu,
        kv_budget_bytes_per_gpu=budget, assumptions=tuple(assumptions), warnings=tuple(warnings))


# ---- rendering for people ------------------------------------------------------------------------------
def _gb(n: int | None) -> str:
    """Decimal and binary units side by side (vendors quote GB, allocators GiB)."""
    if n is None:
        return "-"
    if n >= 10**9:
        return f"{n / 1e9:,.1f} GB ({n / GIB:,.1f} GiB)"
    if n >= 10**6:
        return f"{n / 1e6:,.2f} MB ({n / (1 << 20):,.2f} MiB)"
    return f"{n:,} B"


def _count(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:,.2f}{unit}"
    return str(n)


def render(report: PlanReport, console) -> None:
    """Draw the report as rich tables on `console` (a rich.console.Console)."""
    from rich.table import Table

    r = report
    title = f"{r.model} ({r.model_type}, source {r.source_format}" + (f", recipe {r.recipe})" if r.recipe else ")")
    t = Table(title=f"Parameters and checkpoint bytes: {title}", title_justify="left")
    t.add_column("role")
    t.add_column("parameters", justify="right")
    t.add_column("share", justify="right")
    t.add_column("source bytes", justify="right")
    if r.recipe:
        t.add_column("recipe bytes", justify="right")
    total = r.parameters["total"] or 1
    for role in ROLES:
        n = r.parameters.get(role, 0)
        b = r.bytes_by_role.get(role)
        if not n and not b:
            continue
        row = [role, _count(n), f"{100 * n / total:.1f}%", _gb(b["source"]) if b else "-"]
        if r.recipe:
            row.append(_gb(b["recipe"]) if b else "-")
        t.add_row(*row)
    row = ["total", _count(r.parameters["total"]), "100%", _gb(r.checkpoint_bytes["source"])]
    if r.recipe:
        row.append(_gb(r.checkpoint_bytes["recipe"]))
    t.add_row(*row, style="bold")
    console.print(t)
    console.print(f"active parameters per token: {_count(r.active_parameters)}"
                  + (f"; recipe checkpoint is {r.checkpoint_bytes['recipe'] / r.checkpoint_bytes['source']:.1%} "
                     "of the source" if r.recipe else ""))

    kv = Table(title=f"KV cache on {r.gpus} x {r.gpu_memory_gib:g} GiB, tp={r.tp}, context {r.context_len:,}",
               title_justify="left")
    for c in ("KV dtype", "bytes/token", "per GPU", "resident tokens", "vs bf16", "max concurrency"):
        kv.add_column(c, justify="left" if c == "KV dtype" else "right")
    base = r.kv_tokens["bfloat16"] or 0
    for d in KV_DTYPES:
        b = r.kv_bytes_per_token[d]
        if b is None:
            continue
        tok = r.kv_tokens[d] or 0
        kv.add_row(d + (" *" if d == r.kv_dtype else ""), f"{b:,}", f"{r.kv_bytes_per_token_per_gpu[d]:,}",
                   f"{tok:,}", f"{tok / base:.3f}x" if base else "-", f"{r.max_concurrency[d]:,}")
    console.print(kv)
    console.print(f"per GPU: {r.gpu_memory_gib:g} GiB - weights {r.weight_bytes_per_gpu / GIB:,.2f} GiB - reserve "
                  f"{r.activation_reserve_gib:g} GiB = KV budget {r.kv_budget_bytes_per_gpu / GIB:,.2f} GiB")
    for w in r.warnings:
        console.print(f"[bold red]warning:[/] {w}")
    console.print("assumptions:")
    for a in r.assumptions:
        console.print(f"  - {a}", highlight=False)
