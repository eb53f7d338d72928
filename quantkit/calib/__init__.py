"""Calibration: datasets -> token samples -> a layer-by-layer executor -> observers.

- `data`      turns a dataset (jsonl/json/txt/parquet/`save_to_disk` folder/hub id, or the shipped default
              set) into token samples: packed to `seq_len` and sampled deterministically.
- `executor`  builds the transformers model on the `meta` device, loads one decoder layer at a time from
              the shards, runs the calibration activations through it and frees it again. Peak memory is
              one layer plus the activations, never the model. GPTQ/AWQ reuse it through `layers()`.
- `observers` hook a materialized layer: FP8 KV-cache amax on what an engine caches (K after RoPE, V,
              or the MLA latent) and the number of tokens routed to each expert.

Its named errors live in quantkit/errors.py.
"""
