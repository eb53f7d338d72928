"""Bit packing, the integer side of the formats: INT4 nibbles and INT8 bytes in int32 words (compressed-tensors'
`pack_to_int32`: least-significant first, stored with an offset of 2^(bits-1)), INT4 zero points packed along the
output rows, and E2M1 (FP4) codes two a byte. Pure tensor arithmetic: which tensors a module becomes and how they
are named is the format's (pack/), the values packed are the quantizers' (quant/int4.py, quant/fp4.py).
Every function takes leading batch dims (experts: [E, N, K])."""

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
