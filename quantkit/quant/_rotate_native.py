"""The fast Walsh-Hadamard transform of quant/rotate.py (`fwht`) as a row kernel (numba, compiled once and
cached on disk, as quant/_rtn_native.py): each row's b-wide blocks turned in place, butterfly by butterfly, in
cache. The same float32 operations in the same order as the torch path (each output of a stage is one add or
one subtract of two float32 values, then one float32 product by 1/sqrt(b)), so its results are bit-identical
(tests/test_rotate.py); rows are independent, so splitting them over threads changes nothing.

Import is lazy and optional: without numba (or with QUANTKIT_NATIVE=0) the torch path runs.
"""

from __future__ import annotations

import numpy as np

from .jit import njit


@njit(nogil=True)
def fwht_rows(x, block, scale):  # x float32 [R, N] (N a multiple of block), turned in place; scale float32 [1]
    rows, n = x.shape
    s = scale[0]
    for r in range(rows):
        for start in range(0, n, block):
            h = 1
            while h < block:
                for i in range(start, start + block, 2 * h):
                    for j in range(i, i + h):
                        a = x[r, j]
                        b = x[r, j + h]
                        x[r, j] = a + b
                        x[r, j + h] = a - b
                h *= 2
            for j in range(start, start + block):
                x[r, j] = x[r, j] * s


def warm() -> None:
    """Compile (or load) the kernel."""
    fwht_rows(np.zeros((1, 2), dtype=np.float32), 2, np.ones(1, dtype=np.float32))
