"""The compressed-tensors `pack-quantized` encoding: INT4 nibble packing of values and zero points, INT8
byte packing, and dequantization of a packed module. The one implementation every reader and writer of the
format uses (convert, the calibrated pass, verify, the calibration executor's INT4 sources, the runtime).

Layout (docs/format.md, "INT4 weights"), for a Linear with weight [N, K] (N = out, K = in):

    weight_packed      int32 [N, ceil(K/8)]   element j of a row -> word j // 8, bits 4*(j % 8).., least-
                                              significant nibble first, stored u = q + 8 in 0..15
    weight_scale       bf16  [N, G]           G = K / group_size ([N, 1] for channel)
    weight_zero_point  int32 [ceil(N/8), G]   packed the same way along N; asymmetric only
    weight_g_idx       int32 [K]              actorder "group" only: the group of each input column
    weight_shape       int64 [2] = [N, K]

Example: the row [1, 2, 3, 4, 5, 6, 7, 0] packs to 0x8FEDCBA9.

INT8 (num_bits 8) is the same format with four values a word: weight_packed int32 [N, ceil(K/4)], element j
at bits 8*(j % 4) of word j // 4, stored u = q + 128 in 0..255 (compressed-tensors' `pack_to_int32` with
num_bits 8: offset 2^(bits-1), least-significant first, a partial last word padded with u = 0). The row
[1, -2, 127, -128] packs to 0x00FF7E81. `pack_ints` / `unpack_ints` / `dequantize_int4(num_bits=)` take
either width. Every function takes leading batch dims
(experts: [E, N, K]). Not here: choosing scales or rounding (quant/int4.py), which tensors a module
becomes (pack/layout.py).
"""

from __future__ import annotations

import torch

from ..quant.bits import (pack_int4, pack_int8, pack_ints, pack_zero_point, unpack_int4,  # noqa: F401 (the format's names)
                          unpack_int8, unpack_ints, unpack_zero_point)


def infer_group_size(in_features: int, n_groups: int) -> int:
    """Group size from a scale's group count; exact when in_features % group_size == 0, which is
    what compressed-tensors writes (channel: one group of all in_features)."""
    if n_groups == 1:
        return in_features
    if in_features % n_groups:
        raise ValueError(f"cannot infer group_size from K={in_features} and {n_groups} groups; pass group_size")
    return in_features // n_groups


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None, *,
                    shape, group_size: int | None = None, g_idx: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32, num_bits: int = 4) -> torch.Tensor:
    """w = (q - zp) * scale, computed in float32, returned as `dtype`.

    packed [..., N, ceil(K/8)] (num_bits 8: [..., N, ceil(K/4)]), scale [..., N, G], zero_point [..., ceil(N/8),
    G] or None (INT4 only), shape (N, K) (a tuple or the int64 `weight_shape` tensor), g_idx [K] (actorder
    "group": column j uses group g_idx[j]; otherwise column j uses group j // group_size) -> [..., N, K]."""
    n, k = int(shape[-2]), int(shape[-1])
    if zero_point is not None and num_bits != 4:
        raise ValueError("zero points are read for INT4 only")
    q = unpack_ints(packed, k, num_bits).to(torch.float32)  # [..., N, K]
    if q.shape[-2] != n:
        raise ValueError(f"packed has {q.shape[-2]} rows, shape says {n}")
    if g_idx is not None:
        cols = g_idx.long()
    else:
        g = group_size or infer_group_size(k, scale.shape[-1])
        if scale.shape[-1] != -(-k // g):
            raise ValueError(f"scale has {scale.shape[-1]} groups, expected ceil({k}/{g})")
        cols = torch.arange(k, device=packed.device) // g
    if zero_point is not None:
        q = q - unpack_zero_point(zero_point, n).to(torch.float32)[..., cols]
    return (q * scale.to(torch.float32)[..., cols]).to(dtype)


def dequantize_module(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                      num_bits: int = 4) -> torch.Tensor:
    """One pack-quantized module from its tensors under their local names (weight_packed, weight_scale,
    weight_shape, optional weight_zero_point / weight_g_idx) -> the float weight [N, K]. `num_bits`: its
    config group's (the tensors do not say: for K <= 4 both widths take one word a row)."""
    return dequantize_int4(tensors["weight_packed"], tensors["weight_scale"], tensors.get("weight_zero_point"),
                           shape=tensors["weight_shape"].tolist(), g_idx=tensors.get("weight_g_idx"), dtype=dtype,
                           num_bits=num_bits)
