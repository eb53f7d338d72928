"""The compressed-tensors FP4 encodings, `nvfp4-pack-quantized` and `mxfp4-pack-quantized`: nibble packing
of E2M1 codes and decoding a packed module to floats. The one implementation convert, verify, the sources
reader and the runtime use (the rounding and the scales are quant/fp4.py's).

    weight_packed        uint8 [N, K/2]   two E2M1 codes a byte (code = sign << 3 | index of 0, .5, 1,
                                          1.5, 2, 3, 4, 6), column 2j in the low nibble of byte j
    weight_scale         NVFP4: float8_e4m3fn [N, K/16];  MXFP4: uint8 E8M0 [N, K/32] (2^(e - 127))
    weight_global_scale  NVFP4 only: float32 [1]; w = e2m1 * (weight_scale.float() / weight_global_scale)
"""

from __future__ import annotations

import torch

from ..quant.bits import E2M1_VALUES, E8M0_BIAS, pack_fp4, unpack_fp4  # noqa: F401 (the format's names)


def effective_scale(kind: str, scale: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 multiplier of each group: NVFP4 scale.float() / global_scale (the one division both
    directions of compressed-tensors use); MXFP4 2^(e - 127)."""
    if kind == "nvfp4":
        return scale.float() / global_scale.float().reshape(*global_scale.shape[:-1], 1, 1)
    return torch.exp2(scale.to(torch.int32).float() - E8M0_BIAS)


def dequantize_module(kind: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One FP4 module from its tensors under their local names (weight_packed, weight_scale[,
    weight_global_scale]) -> the weight [..., N, K]: the float32 product, rounded once to `dtype` (what
    compressed-tensors' decompressors return, in BF16)."""
    codes = unpack_fp4(tensors["weight_packed"])  # [..., N, K]
    scale = effective_scale(kind, tensors["weight_scale"], tensors.get("weight_global_scale"))  # [..., N, G]
    g = codes.shape[-1] // scale.shape[-1]
    v = E2M1_VALUES.to(codes.device)[codes.long()].unflatten(-1, (-1, g)) * scale.unsqueeze(-1)
    return v.flatten(-2).to(dtype)
