"""GGML blocks from compressed-tensors words in one pass over each row (numba, compiled once and cached on disk):
the fast path of quantkit/export/blocks.py's `q4_0` / `mxfp4` (the definitions), bit-identical to them
(tests/export/test_blocks.py). Rows are split over the cores (prange). The fp16 scales are converted, and their
losses counted, by blocks.py before the kernel runs: the kernel only moves nibbles and bytes.

Q4_0 block b of a row: bytes [18 b, 18 b + 2) = d (fp16 bits), then 16 bytes; byte j (j < 8) pairs nibble j of word 4b
(elements 0..7) with nibble j of word 4b + 2 (elements 16..23); byte 8 + j pairs word 4b + 1 with word 4b + 3.
MXFP4: the same with the E8M0 byte first and compressed-tensors' FP4 bytes (two codes a byte) as the source.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..quant.jit import njit


@njit(parallel=True, nogil=True)
def q4_0_rows(words, dbits, out):
    """words uint32 [R, 4B] (8 nibbles a word, element i at bits 4 (i % 8)), dbits uint16 [R, B] -> out uint8 [R, 18B]."""
    rows, nb = dbits.shape
    for r in prange(rows):
        for b in range(nb):
            o = 18 * b
            d = dbits[r, b]
            out[r, o] = d & 0xFF
            out[r, o + 1] = d >> 8
            for h in range(2):
                lo = words[r, 4 * b + h]
                hi = words[r, 4 * b + 2 + h]
                for j in range(8):
                    out[r, o + 2 + 8 * h + j] = ((lo >> (4 * j)) & 0xF) | (((hi >> (4 * j)) & 0xF) << 4)


@njit(parallel=True, nogil=True)
def mxfp4_rows(src, e, out):
    """src uint8 [R, 16B] (element 2j low, 2j + 1 high nibble of byte j), e uint8 [R, B] -> out uint8 [R, 17B]."""
    rows, nb = e.shape
    for r in prange(rows):
        for b in range(nb):
            o = 17 * b
            out[r, o] = e[r, b]
            s = 16 * b
            for j in range(16):
                lo = (src[r, s + j // 2] >> (4 * (j % 2))) & 0xF
                k = j + 16
                hi = (src[r, s + k // 2] >> (4 * (k % 2))) & 0xF
                out[r, o + 1 + j] = lo | (hi << 4)


def q4_0(packed: np.ndarray, dbits: np.ndarray) -> np.ndarray:
    words = np.ascontiguousarray(packed).view(np.uint32)
    lead = words.shape[:-1]
    w2 = words.reshape(-1, words.shape[-1])
    d2 = np.ascontiguousarray(dbits).reshape(-1, dbits.shape[-1])
    out = np.empty((w2.shape[0], d2.shape[1] * 18), dtype=np.uint8)
    q4_0_rows(w2, d2, out)
    return out.reshape(lead + (out.shape[-1],))


def mxfp4(packed: np.ndarray, e8m0: np.ndarray) -> np.ndarray:
    src = np.ascontiguousarray(packed)
    lead = src.shape[:-1]
    s2 = src.reshape(-1, src.shape[-1])
    e2 = np.ascontiguousarray(e8m0).reshape(-1, e8m0.shape[-1])
    out = np.empty((s2.shape[0], e2.shape[1] * 17), dtype=np.uint8)
    mxfp4_rows(s2, e2, out)
    return out.reshape(lead + (out.shape[-1],))
