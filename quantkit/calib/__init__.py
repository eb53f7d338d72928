"""Calibration: datasets -> token samples -> a layer-by-layer executor -> observers.

- `data`      turns a dataset (jsonl/json/txt/parquet/`save_to_disk` folder/hub id, or the shipped default
              set) into token samples: packed to `seq_len` and sampled deterministically.
- `executor`  builds the transformers model on the `meta` device, loads one decoder layer at a time from
              the shards, runs the calibration activations through it and frees it again. Peak memory is
              one layer plus the activations, never the model. GPTQ/AWQ reuse it through `layers()`.
- `observers` hook a materialized layer: FP8 KV-cache amax on what an engine caches (K after RoPE, V,
              or the MLA latent) and the number of tokens routed to each expert.

This module holds only the named errors, so importing it is cheap (no torch/transformers).
"""

from __future__ import annotations

from ..errors import QuantkitError


class UnsupportedArchitecture(QuantkitError):
    hint = ("calibration supports model_type llama, qwen3, qwen3_moe, mixtral, deepseek_v3 (Kimi K2: kimi_k2) "
            "and glm4_moe; RTN conversion (`quantkit convert --recipe int4-experts-rtn`) needs no calibration")


class UnsupportedWeights(QuantkitError):
    hint = ("calibration reads bfloat16/float16/float32 weights, block-FP8 (`weight` + `weight_scale_inv`) and "
            "compressed-tensors pack-quantized INT4; calibrate on the original checkpoint instead")


class DatasetError(QuantkitError):
    """A calibration dataset cannot be read or holds no usable rows."""

    hint = ("pass a .jsonl/.json file with a `text`, `messages` or `input_ids` field per row, a .txt file, "
            "a .parquet file, a `datasets.save_to_disk` folder, or omit --dataset for the shipped set")


class DatasetNotFound(DatasetError):
    hint = "check the path; a name that is not a local path is treated as a hub dataset id"


class CalibrationError(QuantkitError):
    """The activations went bad (NaN/Inf) or nothing was observed."""

    hint = "the model produced non-finite activations on the calibration data; check the checkpoint's weights"


class KVScalesError(QuantkitError):
    hint = ("a KV-scales file holds float32 tensors `model.layers.L.self_attn.k_scale` / `v_scale` of shape "
            "[1] or [num_kv_heads, 1, 1]; re-create it with `quantkit calibrate MODEL --output FILE`")


__all__ = ["UnsupportedArchitecture", "UnsupportedWeights", "DatasetError", "DatasetNotFound", "CalibrationError",
           "KVScalesError"]
