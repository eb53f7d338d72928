"""quantkit: offline INT4/FP8 quantization of large Mixture-of-Experts checkpoints.

Reads BF16 or block-FP8 safetensors checkpoints shard by shard, quantizes routed experts to INT4
group-wise, and writes compressed-tensors checkpoints that vLLM and transformers load as-is.
"""

__version__ = "0.1.0"
