"""The fast Walsh-Hadamard transform of quant/rotate.py (`fwht`, `Hadamard.turned`) as row kernels (numba,
compiled once and cached on disk, as quant/_rtn_native.py): each row's b-wide blocks turned butterfly by
butterfly, in cache. The same float32 operations in the same order as the torch path (each output of a stage
is one add or one subtract of two float32 values, then one float32 product by 1/sqrt(b); the fused kernels
first multiply by the signs times the gain in float32 and round to bf16 last, to nearest even as torch does
for finite values; rows with NaN or Inf are flagged, and refused by the caller), so the results are bit-identical (tests/test_rotate.py); rows are independent, so splitting
them over threads changes nothing.

Import is lazy and optional: without numba (or with QUANTKIT_NATIVE=0) the torch path runs.
"""

from __future__ import annotations

import numpy as np
from numba import uint64

from .jit import njit


@njit(nogil=True, inline="always")
def _fwht(row, n, block, s):
    """row float32 [n] turned in place: each block's butterflies, then times s."""
    for start in range(0, n, block):
        h = 1
        if block >= 8:  # the first three stages (h = 1, 2, 4) on each run of 8 values, in registers
            for i in range(uint64(start), uint64(start + block), uint64(8)):
                x0, x1, x2, x3 = row[i], row[i + uint64(1)], row[i + uint64(2)], row[i + uint64(3)]
                x4, x5, x6, x7 = row[i + uint64(4)], row[i + uint64(5)], row[i + uint64(6)], row[i + uint64(7)]
                x0, x1, x2, x3, x4, x5, x6, x7 = x0 + x1, x0 - x1, x2 + x3, x2 - x3, x4 + x5, x4 - x5, \
                    x6 + x7, x6 - x7  # h = 1
                x0, x2, x1, x3, x4, x6, x5, x7 = x0 + x2, x0 - x2, x1 + x3, x1 - x3, x4 + x6, x4 - x6, \
                    x5 + x7, x5 - x7  # h = 2
                row[i], row[i + uint64(4)] = x0 + x4, x0 - x4  # h = 4
                row[i + uint64(1)], row[i + uint64(5)] = x1 + x5, x1 - x5
                row[i + uint64(2)], row[i + uint64(6)] = x2 + x6, x2 - x6
                row[i + uint64(3)], row[i + uint64(7)] = x3 + x7, x3 - x7
            h = 8
        while h < block:
            for i in range(start, start + block, 2 * h):
                # unsigned indices: no negative-index wraparound test per access, so the contiguous inner loop
                # vectorizes (5x faster than signed indices on 2048-wide blocks)
                for jj in range(uint64(0), uint64(h)):
                    j = uint64(i) + jj
                    a = row[j]
                    b = row[j + uint64(h)]
                    row[j] = a + b
                    row[j + uint64(h)] = a - b
            h *= 2
        for j in range(uint64(start), uint64(start + block)):
            row[j] = row[j] * s


@njit(nogil=True)
def fwht_rows(x, block, scale):  # x float32 [R, N] (N a multiple of block), turned in place; scale float32 [1]
    rows, n = x.shape
    for r in range(rows):
        _fwht(x[r], n, block, scale[0])


@njit(nogil=True)
def turn_rows_f32(src, mult, block, scale, out, bad):  # src, out float32 [R, N]; mult float32 [N]; bad bool [R]
    rows, n = src.shape  # out = fwht(src * mult); bad: the row holds NaN or Inf (the caller refuses it)
    for r in range(rows):
        row = out[r]
        for j in range(uint64(0), uint64(n)):
            row[j] = src[r, j] * mult[j]
        _fwht(row, n, block, scale[0])
        bad[r] = not np.isfinite(row).all()


@njit(nogil=True)
def turn_rows_bf16(src, mult, block, scale, out, bad):  # src, out bf16 bits (uint16) [R, N]; the same, rounded
    rows, n = src.shape  # once to nearest even (finite values: torch's rounding; a non-finite row is refused)
    buf = np.empty(n, dtype=np.float32)
    bits = buf.view(np.uint32)
    for r in range(rows):
        for j in range(uint64(0), uint64(n)):
            bits[j] = np.uint32(src[r, j]) << np.uint32(16)
        for j in range(uint64(0), uint64(n)):
            buf[j] = buf[j] * mult[j]
        _fwht(buf, n, block, scale[0])
        nonfinite = False
        for j in range(uint64(0), uint64(n)):
            u = bits[j]
            nonfinite |= (u & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
            out[r, j] = np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))
        bad[r] = nonfinite


@njit(nogil=True)
def turn_cols_bf16(src_t, mult, block, scale, out_t, bad):  # src_t, out_t bf16 bits (uint16) [K, H]: views of
    src, out = src_t.T, out_t.T  # [H, K] (so that run_rows splits the columns); bad bool [K]
    h_, k = src.shape  # each column turned as turn_rows_bf16 turns a row: rows scaled by mult, the butterflies
    tw = uint64(32)    # between rows across a tile of 32 columns (contiguous: vectorized), the same float32
    buf = np.empty(h_ * 32, dtype=np.float32)  # operations per element in the same order, so the same bits
    bits = buf.view(np.uint32)
    hh, kk, bb = uint64(h_), uint64(k), uint64(block)
    s = scale[0]
    for c0 in range(uint64(0), kk, tw):
        w = min(tw, kk - c0)
        for j in range(uint64(0), hh):
            m = mult[j]
            row = j * tw
            for c in range(uint64(0), w):
                bits[row + c] = np.uint32(src[j, c0 + c]) << np.uint32(16)
            for c in range(uint64(0), w):
                buf[row + c] = buf[row + c] * m
        for start in range(uint64(0), hh, bb):
            h = uint64(1)
            while h < bb:
                for i in range(start, start + bb, uint64(2) * h):
                    for j in range(i, i + h):
                        lo, hi = j * tw, (j + h) * tw
                        for c in range(uint64(0), w):
                            a = buf[lo + c]
                            b = buf[hi + c]
                            buf[lo + c] = a + b
                            buf[hi + c] = a - b
                h *= uint64(2)
            for j in range(start * tw, (start + bb) * tw):
                buf[j] = buf[j] * s
        for c in range(uint64(0), w):
            bad[c0 + c] = False
        for j in range(uint64(0), hh):
            row = j * tw
            for c in range(uint64(0), w):
                u = bits[row + c]
                if (u & np.uint32(0x7F800000)) == np.uint32(0x7F800000):
                    bad[c0 + c] = True
                out[j, c0 + c] = np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))))
                                           >> np.uint32(16))


def warm() -> None:
    """Compile (or load) the kernels."""
    fwht_rows(np.zeros((1, 2), dtype=np.float32), 2, np.ones(1, dtype=np.float32))
