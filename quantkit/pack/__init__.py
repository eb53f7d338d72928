"""The output format, and the only place that knows it: which tensors each scheme writes (names,
dtypes, shapes), how INT4 values are packed, the compressed-tensors `quantization_config`, the manifest,
and the rules for FP8 KV-cache scales. convert, the calibrated pass, plan, verify, inspect and the
runtime all read and write the format through this package."""
