"""config.json keys vLLM needs that a source may omit (light: no torch; `convert` and `verify --engine vllm`
both use it).

R1, the router bias. vLLM builds a DeepSeek-style MoE gate's `e_score_correction_bias` parameter only when
config.json says `topk_method: noaux_tc` (vLLM 0.33.0 model_executor/models/deepseek_v2.py, DeepseekV2MoE:
`if getattr(config, "topk_method", None) == "noaux_tc"`, else the bias is None). DeepSeek-V3, Kimi K2/K2.5
(whose text model is DeepSeek-V3) and GLM-5 (glm_moe_dsa, GlmMoeDsaForCausalLM subclasses it) are built
there. A checkpoint that carries `model.layers.L.mlp.gate.e_score_correction_bias` with a config without
that key fails at load: the weight has no parameter (KeyError in the model's load_weights). transformers'
DeepseekV3/GlmMoeDsa always apply the bias (their configs have no topk_method field), so a checkpoint saved by
transformers lacks the key while its weights carry the bias; the routing it was trained with is noaux_tc.
glm4_moe is not concerned (vLLM's glm4_moe.py always builds the bias).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..arch.layout import ROUTER_BIAS_TENSOR

NOAUX_TC_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm_moe_dsa")
ROUTER_BIAS = ROUTER_BIAS_TENSOR
SOURCE = "model_executor/models/deepseek_v2.py (DeepseekV2MoE.__init__)"


def _text(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None]:
    tc = config.get("text_config")
    if isinstance(tc, Mapping) and tc.get("model_type"):
        return tc, "text_config"
    return config, None


def router_bias_problem(config: Mapping[str, Any], names: Iterable[str]) -> tuple[str, str] | None:
    """(where, detail) when vLLM would not build the router bias the checkpoint carries, else None."""
    cfg, sub = _text(config)
    if cfg.get("model_type") not in NOAUX_TC_MODEL_TYPES:
        return None
    bias = next((n for n in names if ROUTER_BIAS.search(n)), None)
    if bias is None or cfg.get("topk_method") == "noaux_tc":
        return None
    key = f"{sub}.topk_method" if sub else "topk_method"
    have = cfg.get("topk_method")
    return bias, (f"config.json {key} is {have!r}: vLLM builds e_score_correction_bias only for topk_method "
                  f"'noaux_tc', so this tensor has no parameter and the load fails (KeyError); "
                  + ("set it to \"noaux_tc\" (quantkit convert adds it when the source omits it)" if have is None
                     else "the source names another routing: check which one the model was trained with"))


def config_additions(config: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """{dotted key: value} to add to an output's config.json so that vLLM loads it (only keys the source
    omits; a value the source states is never changed)."""
    cfg, sub = _text(config)
    if (cfg.get("model_type") in NOAUX_TC_MODEL_TYPES and "topk_method" not in cfg
            and any(ROUTER_BIAS.search(n) for n in names)):
        return {(f"{sub}.topk_method" if sub else "topk_method"): "noaux_tc"}
    return {}


def apply_additions(config: dict, additions: Mapping[str, Any]) -> dict:
    """A copy of `config` with the dotted keys set (nested dicts copied, never shared with the input)."""
    out = dict(config)
    for dotted, value in additions.items():
        *path, leaf = dotted.split(".")
        node = out
        for part in path:
            node[part] = dict(node[part])
            node = node[part]
        node[leaf] = value
    return out


# Where vLLM 0.33.0 does not use a calibrated KV scale (read in its source):
# - MLA: the latent cache (kv_c_normed + k_pe) is written with `_k_scale` only (layers/attention/
#   mla_attention.py, update_kv_cache(..., self._k_scale)); `v_scale` is never read. quantkit writes the same
#   value in both (calib/observers.py: the latent is K and V), so nothing is lost.
# - DSA (GLM-5 glm_moe_dsa, DeepSeek-V3.2): on the FlashMLA sparse backend (Hopper, Blackwell) an FP8 cache is
#   the `fp8_ds_mla` layout (mla_attention.py _canonicalize_sparse_mla_kv_cache_dtype; v1/attention/backends/
#   mla/flashmla_sparse.py): 512 FP8 latent values with one float32 scale per 128 computed as each token is
#   written, then 64 BF16 rope values, 656 bytes per token and layer. The calibrated k_scale is not used there.
MLA_V_SCALE_NOTE = ("vLLM 0.33.0 quantizes the MLA latent with k_scale alone; v_scale is not read (quantkit "
                    "writes the same latent scale in both)")
DSA_KV_NOTE = ("vLLM 0.33.0 serves a DSA model's FP8 KV cache on its FlashMLA sparse backend (Hopper, Blackwell) in "
               "the fp8_ds_mla layout, with one scale per 128 latent values computed as tokens are written: the "
               "calibrated k_scale is not used there (656 bytes per token and layer; `quantkit plan` lists it as "
               "kv_dtype fp8_ds_mla); other backends use it (with quantkit's vLLM plugin)")


def kv_scale_use_notes(config: Mapping[str, Any]) -> list[str]:
    """What vLLM does not use of the KV scales quantkit calibrates for this model (empty for GQA models)."""
    cfg, _ = _text(config)
    if "kv_lora_rank" not in cfg:
        return []
    notes = [MLA_V_SCALE_NOTE]
    if cfg.get("model_type") == "glm_moe_dsa" or "index_topk" in cfg:
        notes.append(DSA_KV_NOTE)
    return notes
