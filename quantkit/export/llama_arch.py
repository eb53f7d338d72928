"""What llama.cpp (as in llama-cpp-python 0.3.36) needs to run each architecture: its GGUF architecture, the
hyper-parameters it reads (taken from the transformers config object, i.e. what transformers computes, not what
config.json happens to spell), the tensor names, and what it cannot represent (refused by name).

Facts read in llama.cpp's loader (src/llama-model.cpp, src/models/*.cpp) and converter (conversion/*.py) of that
release; docs/export.md lists them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ExportError, NotRepresentable


# quantkit arch (registry key) -> gguf.MODEL_ARCH member name
GGUF_ARCH = {"qwen3_moe": "QWEN3MOE", "mixtral": "LLAMA", "deepseek_v3": "DEEPSEEK2", "glm4_moe": "GLM4_MOE",
             "glm_moe_dsa": "GLM_DSA"}
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama_expert_gating_func_type
# llama.cpp's deepseek2 loader treats these layer counts as DeepSeek-V2-Lite and ignores q_lora_rank
DEEPSEEK2_LITE_LAYERS = (26, 27)
# llama.cpp uses YaRN's beta_fast 32 / beta_slow 1 whatever the GGUF says (it reads no beta key for these archs)
LLAMA_CPP_YARN_BETAS = (32.0, 1.0)


@dataclass(frozen=True)
class Routing:
    gating: int
    norm_topk: bool
    scale: float
    n_group: int
    topk_group: int


UINT32_MAX = (1 << 32) - 1
FLOAT32_MAX = 3.4028234663852886e38
FIELD_HINT = "config.json was edited or is corrupt; restore the checkpoint's own"


def _get(cfg, name, default=None):
    v = getattr(cfg, name, default)
    return default if v is None else v


def _bad(name: str, v, want: str):
    shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
    return ExportError(f"config.json {name} = {shown}: a GGUF key needs {want}", hint=FIELD_HINT)


def uint(cfg, name: str, default: int, lo: int = 0) -> int:
    """An integer field of the transformers config (its default when null) that a uint32 GGUF key holds."""
    return whole(_get(cfg, name, default), name, lo)


def whole(v, name: str, lo: int = 0) -> int:
    """`v` (a config value) as a uint32 GGUF key holds it: an integer (not a boolean) from `lo`."""
    if type(v) is not int or not lo <= v <= UINT32_MAX:
        raise _bad(name, v, f"an integer from {lo} to {UINT32_MAX}")
    return v


def real(v, name: str, positive: bool = True) -> float:
    """`v` (a config value) as a float32 GGUF key holds it: a number (not a boolean), finite in float32, and
    positive unless `positive` is False."""
    if type(v) not in (int, float) or not math.isfinite(v) or abs(v) > FLOAT32_MAX or (positive and v <= 0):
        raise _bad(name, v, "a positive finite number" if positive else "a finite number")
    return float(v)


def flag(cfg, name: str, default: bool) -> bool:
    v = _get(cfg, name, default)
    if type(v) is not bool:
        raise _bad(name, v, "true or false")
    return v


def rope(cfg) -> dict:
    """rope_parameters as transformers computed it (an object; {} when none)."""
    rp = _get(cfg, "rope_parameters", {}) or {}
    if not isinstance(rp, dict):
        raise _bad("rope_parameters", rp, "an object")
    return rp


def _rp(rp: dict, key: str, default: float, positive: bool = True) -> float:
    """rope_parameters[key] as a float; `default` when absent, null or 0 (as transformers reads these)."""
    v = rp.get(key)
    return default if v is None or (type(v) in (int, float) and v == 0) else real(v, f"rope_parameters.{key}", positive)


def routing(arch: str, cfg) -> Routing:
    """How transformers routes tokens for `arch` (the modeling files: DeepSeek-V3, Kimi, GLM always score
    with a sigmoid whatever `scoring_func` says or omits; Qwen3-MoE and Mixtral softmax)."""
    if arch in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        return Routing(GATING_SIGMOID, flag(cfg, "norm_topk_prob", False),
                       real(_get(cfg, "routed_scaling_factor", 1.0), "routed_scaling_factor"),
                       uint(cfg, "n_group", 1, lo=1), uint(cfg, "topk_group", 1, lo=1))
    norm = flag(cfg, "norm_topk_prob", True) if arch == "qwen3_moe" else True
    return Routing(GATING_SOFTMAX, norm, 1.0, 1, 1)


def refusals(arch: str, cfg, spec) -> list[str]:
    """What llama.cpp would compute differently from transformers for this config (each one line)."""
    out = []
    if arch not in GGUF_ARCH:
        out.append(f"model_type {spec.model_type} has no llama.cpp architecture quantkit exports to (exported: "
                   "qwen3_moe, mixtral, deepseek_v3 / kimi_k2 / kimi_k25, glm4_moe, glm_moe_dsa)")
        return out
    r = routing(arch, cfg)
    if arch == "qwen3_moe" and not r.norm_topk:
        out.append("norm_topk_prob is false: llama.cpp's qwen3moe graph always renormalizes the top-k routing "
                   "weights (no GGUF key turns it off)")
    if arch == "qwen3_moe":
        if not all(spec.moe[:spec.num_layers]):
            out.append("decoder_sparse_step / mlp_only_layers make some layers dense: llama.cpp's qwen3moe graph "
                       "runs every layer as MoE")
    if arch in ("deepseek_v3", "glm_moe_dsa"):
        if spec.q_lora_rank is None:
            out.append("q_lora_rank is null (DeepSeek-V2-Lite style q_proj): not exported")
        if arch == "deepseek_v3" and spec.num_layers in DEEPSEEK2_LITE_LAYERS:
            out.append(f"{spec.num_layers} decoder layers: llama.cpp's deepseek2 loader takes a model of 26 or 27 "
                       "layers for DeepSeek-V2-Lite and ignores q_lora_rank")
        rp = rope(cfg)
        if rp.get("rope_type") == "yarn":
            m, mad = _rp(rp, "mscale", 1.0, False), _rp(rp, "mscale_all_dim", 0.0, False)
            if mad and m != mad:
                out.append(f"YaRN mscale {m} != mscale_all_dim {mad}: llama.cpp's deepseek2 attention scale assumes "
                           "they are equal")
    if arch == "glm_moe_dsa" and spec.index_head_dim % 64:
        out.append(f"DSA indexer head size {spec.index_head_dim}: llama.cpp's glm-dsa rotates the indexer's keys with a "
                   "Hadamard matrix of 64 or more (a multiple of 64 is needed; GLM-5 has 128)")
    if arch == "mixtral" and _get(cfg, "sliding_window", None):
        out.append("sliding_window is set: llama.cpp's llama graph attends over the whole context")
    if arch in ("deepseek_v3", "glm4_moe", "glm_moe_dsa"):
        dense = leading_dense(spec)
        if dense is None:
            out.append("dense and MoE layers interleave (moe_layer_freq / mlp_layer_types): llama.cpp's "
                       f"{GGUF_ARCH[arch].lower()} graph takes dense layers first, then MoE layers")
    rt = rope(cfg).get("rope_type")
    if rt not in (None, "default") and not (rt == "yarn" and arch == "deepseek_v3"):
        out.append(f"rope type {rt}: llama.cpp's {GGUF_ARCH[arch].lower()} graph is not given it by quantkit's export")
    return out


def yarn_betas(cfg) -> tuple[float, float] | None:
    """(beta_fast, beta_slow) of a YaRN config, when they are not llama.cpp's fixed 32 / 1 (the run passes them
    to llama.cpp as context parameters; a plain llama.cpp user must pass --yarn-beta-fast/--yarn-beta-slow)."""
    rp = rope(cfg)
    if rp.get("rope_type") != "yarn":
        return None
    b = (_rp(rp, "beta_fast", 32.0, False), _rp(rp, "beta_slow", 1.0, False))
    return None if b == LLAMA_CPP_YARN_BETAS else b


def leading_dense(spec) -> int | None:
    """How many dense layers come before the MoE layers (llama.cpp's leading_dense_block_count); None when dense
    and MoE layers interleave, which llama.cpp's graphs cannot express."""
    moe = list(spec.moe[:spec.num_layers])
    k = moe.index(True) if True in moe else len(moe)
    return k if all(moe[k:]) else None


def write_hparams(w, arch: str, cfg, spec, vocab_rows: int) -> dict:
    """The `{arch}.*` keys llama.cpp reads, onto GGUFWriter `w`. Returns them as a dict (for the report)."""
    keys: dict = {}
    a = w.arch

    def put(kind: str, key: str, value):
        getattr(w, f"add_{kind}")(f"{a}.{key}", value)
        keys[key] = value

    D, L = spec.hidden_size, spec.num_layers
    rp = rope(cfg)
    theta = _rp(rp, "rope_theta", None) or real(_get(cfg, "rope_theta", 10000.0), "rope_theta")
    put("uint32", "context_length", uint(cfg, "max_position_embeddings", 4096, lo=1))
    put("uint32", "embedding_length", D)
    put("uint32", "block_count", L)  # MTP layers are not exported: llama.cpp's main graph never runs them
    put("uint32", "vocab_size", vocab_rows)
    put("float32", "attention.layer_norm_rms_epsilon", real(_get(cfg, "rms_norm_eps", 1e-6), "rms_norm_eps"))
    put("float32", "rope.freq_base", theta)
    put("uint32", "attention.head_count", spec.num_heads)
    put("uint32", "expert_count", spec.num_experts)
    put("uint32", "expert_used_count", spec.experts_per_tok)
    r = routing(arch, cfg)
    if arch == "qwen3_moe":
        put("uint32", "attention.head_count_kv", spec.num_kv_heads)
        put("uint32", "attention.key_length", spec.head_dim)
        put("uint32", "attention.value_length", spec.head_dim)
        put("uint32", "feed_forward_length", spec.intermediate_size)
        put("uint32", "expert_feed_forward_length", spec.moe_intermediate_size)
    elif arch == "mixtral":
        put("uint32", "attention.head_count_kv", spec.num_kv_heads)
        put("uint32", "attention.key_length", spec.head_dim)
        put("uint32", "attention.value_length", spec.head_dim)
        put("uint32", "rope.dimension_count", spec.head_dim)
        # llama.cpp's llama graph sizes the experts by feed_forward_length
        put("uint32", "feed_forward_length", spec.moe_intermediate_size)
    else:
        put("uint32", "feed_forward_length", spec.intermediate_size)
        put("uint32", "expert_feed_forward_length", spec.moe_intermediate_size)
        # both as the tensors hold them (export.check_layout held the config to them)
        put("uint32", "expert_shared_count", spec.shared_intermediate // spec.moe_intermediate_size)
        dense = leading_dense(spec)
        if dense is None:  # pragma: no cover - refusals() names it first
            raise NotRepresentable("dense and MoE layers interleave: llama.cpp takes dense layers first")
        put("uint32", "leading_dense_block_count", dense)
        put("uint32", "expert_gating_func", r.gating)
        put("bool", "expert_weights_norm", r.norm_topk)
        put("float32", "expert_weights_scale", r.scale)
        put("uint32", "expert_group_count", r.n_group)
        put("uint32", "expert_group_used_count", r.topk_group)
    if arch == "glm4_moe":
        put("uint32", "attention.head_count_kv", spec.num_kv_heads)
        put("uint32", "attention.key_length", spec.head_dim)
        put("uint32", "attention.value_length", spec.head_dim)
        factor = _rp(rp, "partial_rotary_factor", None) or real(_get(cfg, "partial_rotary_factor", 0.5),
                                                                 "partial_rotary_factor")
        put("uint32", "rope.dimension_count", int(spec.head_dim * factor))
    if arch in ("deepseek_v3", "glm_moe_dsa"):  # MLA, stored as MQA over the latent
        put("uint32", "attention.head_count_kv", 1)
        put("uint32", "attention.key_length", spec.kv_lora_rank + spec.qk_rope_head_dim)
        put("uint32", "attention.value_length", spec.kv_lora_rank)
        put("uint32", "attention.key_length_mla", spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        put("uint32", "attention.value_length_mla", spec.v_head_dim)
        put("uint32", "attention.q_lora_rank", int(spec.q_lora_rank))
        put("uint32", "attention.kv_lora_rank", spec.kv_lora_rank)
        put("uint32", "rope.dimension_count", spec.qk_rope_head_dim)
    if arch == "deepseek_v3" and rp.get("rope_type") == "yarn":
        put("string", "rope.scaling.type", "yarn")
        put("float32", "rope.scaling.factor", real(rp.get("factor"), "rope_parameters.factor"))
        orig = rp.get("original_max_position_embeddings")
        put("uint32", "rope.scaling.original_context_length",
            whole(orig, "rope_parameters.original_max_position_embeddings", 1) if orig is not None and orig != 0
            else uint(cfg, "max_position_embeddings", 4096, lo=1))
        mad = _rp(rp, "mscale_all_dim", 0.0, False)
        if mad:
            put("float32", "rope.scaling.yarn_log_multiplier", 0.1 * mad)
        put("float32", "rope.scaling.yarn_beta_fast", _rp(rp, "beta_fast", 32.0, False))
        put("float32", "rope.scaling.yarn_beta_slow", _rp(rp, "beta_slow", 1.0, False))
    if arch == "glm_moe_dsa":
        put("uint32", "attention.indexer.head_count", spec.index_n_heads)
        put("uint32", "attention.indexer.key_length", spec.index_head_dim)
        put("uint32", "attention.indexer.top_k", uint(cfg, "index_topk", 2048, lo=1))
        types = [bool(x) for x in spec.indexer[:L]]
        w.add_array(f"{a}.attention.indexer.types", types)  # explicit: absent, llama.cpp guesses from the context
        keys["attention.indexer.types"] = types
    return keys


def mixtral_permute(rows: int, heads: int) -> list[int]:
    """The row order llama.cpp's llama graph wants for q/k (its rope pairs adjacent values; transformers'
    rotates halves): per head, [h0, h_half, h1, h_half+1, ...] (conversion/llama.py `permute`)."""
    hd = rows // heads
    half = hd // 2
    order = []
    for h in range(heads):
        base = h * hd
        for i in range(half):
            order += [base + i, base + half + i]
    return order

