"""A vLLM general plugin: load the FP8 KV-cache scales of MLA layers from compressed-tensors checkpoints.

Why (vLLM 0.33.0, read in its source and seen with bench/vllm_check.py): a DeepSeek-V3 / Kimi K2 / GLM-5
checkpoint that declares `kv_cache_scheme` and ships `model.layers.L.self_attn.k_scale` / `v_scale` is
served with scale 1.0, and vLLM only logs "Found k_scale in the checkpoint ... k_scale is not loaded".
Two things stop the scales, and no checkpoint name or config key gets past both:

1. No parameter to load into. `CompressedTensorsConfig.get_quant_method`
   (model_executor/layers/quantization/compressed_tensors/compressed_tensors.py:213) returns the KV-cache
   method for `isinstance(layer, Attention)` only. `MLAAttention` (model_executor/layers/attention/
   mla_attention.py:426) is not an `Attention`, so `_init_kv_cache_quant` (attention.py:157, called at
   mla_attention.py:548) never calls `create_weights`: the MLA layer keeps the `_k_scale`/`_v_scale`
   buffers at 1.0 and has no `k_scale` parameter. (ModelOpt's `get_quant_method`, modelopt.py:232, tests
   `(Attention, MLAAttention)`; compressed-tensors does not.)
2. No name that reaches it, even once the parameter exists. AutoWeightsLoader (models/utils.py:467)
   applies `QuantizationConfig.get_cache_scale_mapper` (quantization/base_config.py:220), whose last rule
   (line 249) rewrites any `.{q,k,v}_scale` not already preceded by `.attn` to `.attn.{q,k,v}_scale`, and
   its other rules also produce `.attn.*_scale`. DeepseekV2Model.load_weights (models/deepseek_v2.py:1812)
   then calls `maybe_remap_kv_scale_name` (model_loader/weight_utils.py:1722): a name that is not a
   parameter gets `.attn` inserted once more by its default rule (line 1795) and is logged "... is not
   loaded" and skipped (line 1827). The MLA parameter is `.self_attn.mla_attn.mla_attn.k_scale`
   (deepseek_v2.py:1215, layers/mla.py:122), which ends in `mla_attn.k_scale`, never `.attn.k_scale`.

What `register()` changes, and nothing else:
- an MLAAttention layer of a compressed-tensors checkpoint that declares a kv_cache_scheme with strategy
  `tensor` (what quantkit writes for MLA models) gets vLLM's own
  `CompressedTensorsKVCacheMethod` (the method `Attention` layers get), so it has `k_scale`/`v_scale`
  parameters, which vLLM's generic post-load step (model_loader/utils.py `process_weights_after_loading`
  calls every module's quant_method) copies into `_k_scale`/`_v_scale` (that step was not run here: CPU);
- `maybe_remap_kv_scale_name`, given a name ending in `.attn.{k,v}_scale` that is not a parameter, first
  tries `<stem>.mla_attn.mla_attn.{k,v}_scale` (deepseek_v2.py: DeepSeek-V3, Kimi K2/K2.5, and GLM-5 off
  CUDA) and `<stem>.{k,v}_scale` (models/deepseek_v32/{nvidia,amd}/model.py, where the attention module is
  itself an MLAAttention: GLM-5 on CUDA/ROCm), and otherwise behaves as before.
Both wrappers defer to vLLM whenever vLLM already handles the case (a method for the layer, a name that is
a parameter), so on a vLLM release that handles MLA scales itself they change nothing.

Register it with an entry point (group `vllm.general_plugins`), e.g. in pyproject.toml:
    [project.entry-points."vllm.general_plugins"]
    quantkit_mla_kv_scales = "quantkit.engine.vllm_plugin:register"
or call `register()` before vLLM builds the model. vLLM is imported only inside `register()`.
"""

from __future__ import annotations

import sys

_MLA_PATH = ".mla_attn.mla_attn"  # where DeepSeek-V2-family models keep their MLAAttention (deepseek_v2.py)
_registered = False


def register() -> None:
    """Install the two wrappers (idempotent)."""
    global _registered
    if _registered:
        return
    _give_mla_the_kv_cache_method()
    _route_kv_scale_names_to_mla()
    _registered = True


def _give_mla_the_kv_cache_method() -> None:
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.quantization.compressed_tensors import (
        compressed_tensors as ct,
    )

    original = ct.CompressedTensorsConfig.get_quant_method

    def get_quant_method(self, layer, prefix):
        method = original(self, layer, prefix)
        scheme = self.kv_cache_scheme
        if method is None and isinstance(layer, MLAAttention) and scheme and scheme.get("strategy") == "tensor":
            # one latent per token and layer, one scale: strategy tensor only. (attn_head is left to vLLM:
            # the method's per-head loader slices by the config's num_key_value_heads, which an MLA layer,
            # with its single cached head, does not have.) The method validates the rest of the scheme.
            return ct.CompressedTensorsKVCacheMethod(self)
        return method

    get_quant_method.__wrapped__ = original
    ct.CompressedTensorsConfig.get_quant_method = get_quant_method


def _route_kv_scale_names_to_mla() -> None:
    from vllm.model_executor.model_loader import weight_utils

    original = weight_utils.maybe_remap_kv_scale_name

    def maybe_remap_kv_scale_name(name: str, params_dict: dict) -> str | None:
        if name not in params_dict:
            for leaf in (".k_scale", ".v_scale"):
                if name.endswith(".attn" + leaf):
                    stem = name[: -len(".attn" + leaf)]
                    # the MLAAttention inside DeepSeek-V2-family attention (deepseek_v2.py), or an attention
                    # module that is itself the MLAAttention (models/deepseek_v32/*/model.py, GLM-5 on GPUs)
                    for candidate in (stem + _MLA_PATH + leaf, stem + leaf):
                        if candidate in params_dict:
                            return candidate
        return original(name, params_dict)

    maybe_remap_kv_scale_name.__wrapped__ = original
    weight_utils.maybe_remap_kv_scale_name = maybe_remap_kv_scale_name
    # model modules bind the function at import time; rebind it in those already imported (the others
    # import the wrapper, as vLLM imports model modules lazily, after general plugins are loaded)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("vllm.") and getattr(mod, "maybe_remap_kv_scale_name", None) is original:
            mod.maybe_remap_kv_scale_name = maybe_remap_kv_scale_name
