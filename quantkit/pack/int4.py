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

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j of a word sits at bits 4j..4j+3


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int [..., R, C] in [-8, 7] -> int32 [..., R, ceil(C/8)], 8 nibbles per word along the last dim,
    least-significant nibble first, stored as q + 8. A partial last word is padded with u = 0 nibbles
    (as compressed-tensors writes), which `weight_shape` trims on unpack.

    Eight nibble values sit one per byte in an int64 (little-endian); three shift-or-mask steps pull
    them together into the low 32 bits, which is "element j at bits 4*(j % 8) of word j // 8"."""
    if q.dtype.is_floating_point:
        raise TypeError("pack_int4 takes integer q values, not floats")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("int4 values must lie in [-8, 7]")
    *lead, c = q.shape
    words = (c + 7) // 8
    u = (q.to(torch.int8) + 8).view(torch.uint8)  # [..., C] in [0, 15]
    if c % 8:
        u = torch.nn.functional.pad(u, (0, words * 8 - c))
    v = u.contiguous().reshape(-1).view(torch.int64).reshape(*lead, words)  # 8 nibbles per int64
    v = (v | (v >> 4)) & 0x00FF00FF00FF00FF
    v = (v | (v >> 8)) & 0x0000FFFF0000FFFF
    v = (v | (v >> 16)) & 0x00000000FFFFFFFF
    return v.to(torch.int32)  # values >= 2^31 wrap to negative: the word is a signed int32


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 [..., R, W] -> int8 [..., R, cols] in [-8, 7] (W = ceil(cols/8))."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed INT4 weights are int32, got {packed.dtype}")
    cols = int(cols)
    if packed.shape[-1] != (cols + 7) // 8:
        raise ValueError(f"packed last dim {packed.shape[-1]} != ceil({cols}/8)")
    u = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # arithmetic shift then mask: no sign leak
    q = (u - 8).to(torch.int8).reshape(*packed.shape[:-1], packed.shape[-1] * 8)
    return q[..., :cols]


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """q int [..., R, C] in [-128, 127] -> int32 [..., R, ceil(C/4)], four bytes per word along the last dim,
    least-significant byte first, stored as q + 128 (the int8 byte with its top bit flipped). A partial last
    word is padded with u = 0 bytes, as compressed-tensors writes."""
    if q.dtype.is_floating_point:
        raise TypeError("pack_int8 takes integer q values, not floats")
    if q.numel() and (int(q.min()) < -128 or int(q.max()) > 127):
        raise ValueError("int8 values must lie in [-128, 127]")
    *lead, c = q.shape
    words = (c + 3) // 4
    u = q.to(torch.int8).view(torch.uint8) ^ 0x80  # q + 128 (mod 256)
    if c % 4:
        u = torch.nn.functional.pad(u, (0, words * 4 - c))
    return u.contiguous().view(torch.int32).reshape(*lead, words).clone()  # little-endian: byte j at bits 8j


def unpack_int8(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of `pack_int8`: int32 [..., R, W] -> int8 [..., R, cols] in [-128, 127] (W = ceil(cols/4))."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed INT8 weights are int32, got {packed.dtype}")
    cols = int(cols)
    if packed.shape[-1] != (cols + 3) // 4:
        raise ValueError(f"packed last dim {packed.shape[-1]} != ceil({cols}/4)")
    if not packed.shape[-1]:
        return torch.empty(*packed.shape[:-1], 0, dtype=torch.int8, device=packed.device)
    u = packed.contiguous().view(torch.uint8) ^ 0x80  # [..., R, 4W]: each word's bytes, least significant first
    return u.view(torch.int8)[..., :cols]


def pack_ints(q: torch.Tensor, num_bits: int) -> torch.Tensor:
    """`pack_int4` (num_bits 4) or `pack_int8` (num_bits 8)."""
    if num_bits == 4:
        return pack_int4(q)
    if num_bits == 8:
        return pack_int8(q)
    raise ValueError(f"pack-quantized weights are written with num_bits 4 or 8, got {num_bits}")


def unpack_ints(packed: torch.Tensor, cols: int, num_bits: int) -> torch.Tensor:
    """`unpack_int4` (num_bits 4) or `unpack_int8` (num_bits 8)."""
    if num_bits == 4:
        return unpack_int4(packed, cols)
    if num_bits == 8:
        return unpack_int8(packed, cols)
    raise ValueError(f"pack-quantized weights are read with num_bits 4 or 8, got {num_bits}")


def pack_zero_point(zero_point: torch.Tensor) -> torch.Tensor:
    """Zero points [..., N, G] int in [-8, 7] -> int32 [..., ceil(N/8), G], packed along N."""
    return pack_int4(zero_point.transpose(-1, -2)).transpose(-1, -2).contiguous()


def unpack_zero_point(zero_point: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of `pack_zero_point`: int32 [..., ceil(N/8), G] -> int8 [..., N, G]."""
    return unpack_int4(zero_point.transpose(-1, -2).contiguous(), rows).transpose(-1, -2)


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
