"""compressed-tensors codes -> GGML block bytes, without re-quantization (docs/export.md, "Blocks").

Every function takes the stored codes and scales of one matrix (or a stack of experts: leading dims pass
through) and returns uint8 [..., N, K / block * block_bytes], the rows of GGML blocks that gguf-py's
`GGUFWriter.add_tensor_info(raw_dtype=...)` takes as a byte shape. Decoding those bytes with GGML's
definition gives exactly compressed-tensors' decode, except where an fp16 field cannot hold a scale: those
are counted (`Inexact`) and the caller reports them.

    Q4_0   18 bytes / 32: fp16 d, 16 bytes; byte j = u[j] | u[j + 16] << 4; w = (u - 8) * d
    Q4_1   20 bytes / 32: fp16 d, fp16 m, 16 bytes (as Q4_0); w = u * d + m
    Q8_0   34 bytes / 32: fp16 d, 32 int8; w = q * d
    MXFP4  17 bytes / 32: E8M0 e, 16 bytes (as Q4_0) of E2M1 codes; w = 2 * e2m1(code) * 2^(e - 128)
    NVFP4  36 bytes / 64: 4 UE4M3 sub-scales (one per 16), then per sub-block 8 bytes, byte j = c[j] | c[j + 8] << 4;
           w = 2 * e2m1(code) * ue4m3 / 2 (gguf-py's kvalues convention), times the tensor's own scale

compressed-tensors side (pack/int4.py, pack/fp4.py): INT4 int32 words, element j at bits 4 (j % 8), stored u = q + 8;
FP4 bytes, element 2j in the low nibble of byte j; the E2M1 code (sign << 3 | index) is GGML's kvalues index.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

QK = 32  # Q4_0 / Q4_1 / Q8_0 / MXFP4 block
QK_NVFP4 = 64
NVFP4_SUB = 16
FP16_MIN_NORMAL = 2.0 ** -14
FP16_MAX = 65504.0


@dataclass
class Inexact:
    """Scales an fp16 field could not hold exactly: `subnormal` (below fp16's normal range: fewer mantissa
    bits), `changed` (the fp16 value differs from the stored scale; these alter the decoded weights),
    `minimum` (Q4_1's m = -(8 + z) * s rounded to fp16), out of `total` scales."""

    total: int = 0
    subnormal: int = 0
    changed: int = 0
    minimum: int = 0
    worst_rel: float = 0.0
    where: list[str] = field(default_factory=list)

    def add(self, other: "Inexact", name: str) -> None:
        self.total += other.total
        self.subnormal += other.subnormal
        self.changed += other.changed
        self.minimum += other.minimum
        self.worst_rel = max(self.worst_rel, other.worst_rel)
        if (other.changed or other.minimum) and len(self.where) < 10:
            self.where.append(name)

    def to_json(self) -> dict:
        return {"scales": self.total, "fp16_subnormal": self.subnormal, "changed": self.changed,
                "q4_1_min_rounded": self.minimum, "worst_relative_change": self.worst_rel, "examples": self.where}


def _to_fp16(s: np.ndarray, counts: Inexact, *, what: str = "changed", reps: int = 1) -> np.ndarray:
    """float32 scales -> fp16, counting (`reps` times each: the GGML blocks that repeat a group's scale) the ones
    that do not survive. Overflow (|s| > 65504) is refused."""
    s = np.asarray(s, dtype=np.float32)
    a = np.abs(s)
    if s.size and float(a.max()) > FP16_MAX:
        raise ValueError(f"{int((a > FP16_MAX).sum())} scale(s) exceed fp16's range (largest {float(a.max()):.4g})")
    h = s.astype(np.float16)
    back = h.astype(np.float32)
    diff = back != s
    changed = int(np.count_nonzero(diff))
    if what == "changed":
        counts.total += s.size * reps
        counts.subnormal += (int(np.count_nonzero(a < FP16_MIN_NORMAL)) - int(np.count_nonzero(a == 0))) * reps
        counts.changed += changed * reps
    else:
        counts.minimum += changed * reps
    if changed:
        rel = np.abs(back[diff] - s[diff]) / np.maximum(a[diff], np.float32(1e-38))
        counts.worst_rel = max(counts.worst_rel, float(rel.max()))
    return h


def int4_nibbles(packed: np.ndarray, cols: int) -> np.ndarray:
    """compressed-tensors INT4 words int32 [..., N, ceil(K/8)] -> u = q + 8, uint8 [..., N, K]."""
    b = np.ascontiguousarray(packed).view(np.uint8)  # little-endian: byte i holds elements 2i (low), 2i+1 (high)
    u = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.uint8)
    u[..., 0::2] = b & 0x0F
    u[..., 1::2] = b >> 4
    return u[..., :cols]


def fp4_codes(packed: np.ndarray) -> np.ndarray:
    """compressed-tensors FP4 bytes uint8 [..., N, K/2] -> codes uint8 [..., N, K]."""
    u = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    u[..., 0::2] = packed & 0x0F
    u[..., 1::2] = packed >> 4
    return u


def _pairs(u: np.ndarray, block: int) -> np.ndarray:
    """[..., K] nibbles -> [..., K / block, block / 2] bytes: byte j = u[j] | u[j + block / 2] << 4."""
    v = u.reshape(u.shape[:-1] + (u.shape[-1] // block, block))
    h = block // 2
    return v[..., :h] | (v[..., h:] << 4)


def _per_block(scale: np.ndarray, k: int, block: int) -> np.ndarray:
    """A scale per group [..., N, G] -> a scale per GGML block [..., N, K / block] (a group of 64 or 128 is
    consecutive blocks that repeat it)."""
    g = scale.shape[-1]
    if k % g or (k // g) % block:
        raise ValueError(f"group size {k}/{g} is not a multiple of the GGML block {block}")
    return np.repeat(scale, (k // g) // block, axis=-1)


def _block_scales(scale: np.ndarray, k: int, counts: Inexact) -> np.ndarray:
    """A group's scale as fp16 for each GGML block of it (converted once per group, counted per block)."""
    g = scale.shape[-1]
    if k % g or (k // g) % QK:
        raise ValueError(f"group size {k}/{g} is not a multiple of the GGML block {QK}")
    reps = (k // g) // QK
    d = _to_fp16(scale, counts, reps=reps)
    return d if reps == 1 else np.repeat(d, reps, axis=-1)


def _assemble(parts: list[np.ndarray]) -> np.ndarray:
    """[..., B, w_i] uint8 pieces -> [..., B * sum(w_i)] (each block's fields in order)."""
    out = np.concatenate(parts, axis=-1)
    return out.reshape(out.shape[:-2] + (out.shape[-2] * out.shape[-1],))


def q4_0(u: np.ndarray, scale: np.ndarray, counts: Inexact) -> np.ndarray:
    """Symmetric INT4: u = q + 8 uint8 [..., N, K], scale float32 [..., N, G] -> Q4_0 bytes."""
    d = _block_scales(scale, u.shape[-1], counts)
    return _assemble([d.view(np.uint8).reshape(d.shape + (2,)), _pairs(u, QK)])


def q4_1(u: np.ndarray, scale: np.ndarray, zero: np.ndarray, counts: Inexact) -> np.ndarray:
    """Asymmetric INT4: w = (u - 8 - z) * s -> Q4_1 with d = s, m = -(8 + z) * s (rounded to fp16: counted)."""
    k = u.shape[-1]
    s = _per_block(scale, k, QK).astype(np.float32)
    z = _per_block(zero.astype(np.float32), k, QK)
    d = _to_fp16(s, counts)
    m = _to_fp16(-(8.0 + z) * d.astype(np.float32), counts, what="minimum")
    return _assemble([d.view(np.uint8).reshape(d.shape + (2,)), m.view(np.uint8).reshape(m.shape + (2,)),
                      _pairs(u, QK)])


def q8_0(q: np.ndarray, scale: np.ndarray, counts: Inexact) -> np.ndarray:
    """Symmetric INT8: q int8 [..., N, K], scale [..., N, G] -> Q8_0 bytes."""
    k = q.shape[-1]
    d = _block_scales(scale, k, counts)
    v = q.astype(np.int8).view(np.uint8).reshape(q.shape[:-1] + (k // QK, QK))
    return _assemble([d.view(np.uint8).reshape(d.shape + (2,)), v])


def _native():
    """quantkit/export/_blocks_native.py, or None (no numba, QUANTKIT_NATIVE=0): the numpy definitions here."""
    if os.environ.get("QUANTKIT_NATIVE", "1") == "0":
        return None
    try:
        from . import _blocks_native
    except Exception:  # noqa: BLE001 - no numba, or it cannot compile here
        return None
    return _blocks_native


def q4_0_packed(packed: np.ndarray, k: int, scale: np.ndarray, counts: Inexact) -> np.ndarray:
    """`q4_0` from compressed-tensors' INT4 words int32 [..., N, ceil(K/8)] directly (the fused kernel when K fills
    the words; the same bytes)."""
    nat = _native()
    if nat is None or packed.shape[-1] * 8 != k:
        return q4_0(int4_nibbles(packed, k), scale, counts)
    d = _block_scales(scale, k, counts)
    return nat.q4_0(packed, d.view(np.uint16))


def mxfp4_packed(packed: np.ndarray, e8m0: np.ndarray) -> np.ndarray:
    """`mxfp4` from compressed-tensors' FP4 bytes uint8 [..., N, K/2] directly (the fused kernel; the same bytes)."""
    nat = _native()
    if nat is None:
        return mxfp4(fp4_codes(packed), e8m0)
    return nat.mxfp4(packed, np.asarray(e8m0, dtype=np.uint8))


def mxfp4(codes: np.ndarray, e8m0: np.ndarray) -> np.ndarray:
    """MXFP4: codes uint8 [..., N, K], E8M0 bytes [..., N, K / 32] -> GGML MXFP4 bytes (bit for bit: GGML's
    doubled table times 2^(e - 128) is compressed-tensors' e2m1 times 2^(e - 127))."""
    e = np.asarray(e8m0, dtype=np.uint8)
    return _assemble([e.reshape(e.shape + (1,)), _pairs(codes, QK)])


def nvfp4(codes: np.ndarray, ue4m3: np.ndarray) -> np.ndarray:
    """NVFP4: codes uint8 [..., N, K], E4M3 scale bytes [..., N, K / 16] (positive) -> GGML NVFP4 bytes, a
    superblock of 64 = 4 sub-blocks of 16. The per-tensor scale travels separately."""
    k = codes.shape[-1]
    if k % QK_NVFP4:
        raise ValueError(f"NVFP4 rows of {k} are not a multiple of GGML's superblock {QK_NVFP4}")
    s = np.asarray(ue4m3, dtype=np.uint8).reshape(codes.shape[:-1] + (k // QK_NVFP4, 4))
    q = _pairs(codes, NVFP4_SUB)  # [..., K/16, 8]
    q = q.reshape(codes.shape[:-1] + (k // QK_NVFP4, 32))
    return _assemble([s, q])
