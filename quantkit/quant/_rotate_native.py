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


@njit(nogil=True, inline="always")
def _stages4(buf, lo, hi, h, tw, w):
    """Butterfly stages h and 2h over tile rows [lo, hi) (a multiple of 4h; each tile row tw floats, the first
    w used), fused in registers: per element the same two adds or subtracts in the same order as two radix-2
    stages, so the same bits, with half the passes over the tile."""
    for i in range(lo, hi, uint64(4) * h):
        for j in range(i, i + h):
            p0, p1, p2, p3 = j * tw, (j + h) * tw, (j + uint64(2) * h) * tw, (j + uint64(3) * h) * tw
            for c in range(uint64(0), w):
                a, b, x, y = buf[p0 + c], buf[p1 + c], buf[p2 + c], buf[p3 + c]
                a, b, x, y = a + b, a - b, x + y, x - y  # stage h: (j, j + h), (j + 2h, j + 3h)
                buf[p0 + c], buf[p2 + c] = a + x, a - x  # stage 2h: (j, j + 2h), (j + h, j + 3h)
                buf[p1 + c], buf[p3 + c] = b + y, b - y


@njit(nogil=True, inline="always")
def _stage2(buf, lo, hi, h, tw, w):
    """One radix-2 butterfly stage h over tile rows [lo, hi), as _stages4."""
    for i in range(lo, hi, uint64(2) * h):
        for j in range(i, i + h):
            p0, p1 = j * tw, (j + h) * tw
            for c in range(uint64(0), w):
                a, b = buf[p0 + c], buf[p1 + c]
                buf[p0 + c], buf[p1 + c] = a + b, a - b


@njit(nogil=True, inline="always")
def _stages(buf, lo, hi, h, end, tw, w):
    """Stages h, 2h, ... below `end` over tile rows [lo, hi): two at a time, one alone at the end if odd."""
    while uint64(4) * h <= end:
        _stages4(buf, lo, hi, h, tw, w)
        h *= uint64(4)
    if h < end:
        _stage2(buf, lo, hi, h, tw, w)


COL_TILE = 128  # columns turned together: the butterflies' inner loop, contiguous and vectorized
L1_FLOATS = 4096  # a 16 KiB sub-block of the tile: the early stages run on it while it is in L1


@njit(nogil=True)
def turn_cols_bf16(src, mult, block, scale, out, bad, c_lo, c_hi):  # src, out bf16 bits (uint16) [H, K]
    h_, k = src.shape  # (contiguous); bad bool [K]; columns [c_lo, c_hi) (a thread's share). Each column turned
    tw = uint64(COL_TILE)  # as turn_rows_bf16 turns a row: rows scaled by mult, the butterflies between rows
    buf = np.empty(h_ * COL_TILE, dtype=np.float32)  # across a tile of columns at once, the same float32
    bits = buf.view(np.uint32)  # operations per element in the same order (so the same bits): first the
    top = np.empty(COL_TILE, dtype=np.uint32)  # stages within L1-sized sub-blocks, then the rest over the tile
    hh, bb = uint64(h_), uint64(block)
    sub = max(uint64(1), min(bb, uint64(L1_FLOATS) // tw))
    s = scale[0]
    for c0 in range(uint64(c_lo), uint64(c_hi), tw):
        w = min(tw, uint64(c_hi) - c0)
        for j in range(uint64(0), hh):
            m = mult[j]
            row = j * tw
            for c in range(uint64(0), w):
                bits[row + c] = np.uint32(src[j, c0 + c]) << np.uint32(16)
            for c in range(uint64(0), w):
                buf[row + c] = buf[row + c] * m
        for start in range(uint64(0), hh, bb):
            for s0 in range(start, start + bb, sub):
                _stages(buf, s0, s0 + sub, uint64(1), sub, tw, w)
            _stages(buf, start, start + bb, sub, bb, tw, w)
            for j in range(start * tw, (start + bb) * tw):
                buf[j] = buf[j] * s
        for c in range(uint64(0), w):
            top[c] = 0
        for j in range(uint64(0), hh):
            row = j * tw
            for c in range(uint64(0), w):
                u = bits[row + c]
                top[c] = max(top[c], u & np.uint32(0x7F800000))  # all exponent bits set: NaN or Inf
                out[j, c0 + c] = np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))))
                                           >> np.uint32(16))
        for c in range(uint64(0), w):
            bad[c0 + c] = top[c] == np.uint32(0x7F800000)


def warm() -> None:
    """Compile (or load) the kernels."""
    fwht_rows(np.zeros((1, 2), dtype=np.float32), 2, np.ones(1, dtype=np.float32))
