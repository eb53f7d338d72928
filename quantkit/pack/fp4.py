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

# E2M1 value of each 4-bit code; code 8 is -0.0, as compressed-tensors decodes it
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
E8M0_BIAS = 127


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., R, C] uint8 in 0..15 -> uint8 [..., R, C/2]: column 2j in the low nibble of byte j,
    column 2j+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_fp4`: uint8 [..., R, W] -> codes uint8 [..., R, 2W]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


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
