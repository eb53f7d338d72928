"""The in-block part of GPTQ's code refinement (`quant.gptq.refine_codes`) as one compiled loop (numba,
compiled once and cached on disk, as quant/_rtn_native.py): per expert and column of a block, every row's
code moves to the grid point nearest its parabola's vertex, and the block's later columns of the gradient
take the change (a rank-1 update per column). The torch path does the same in ~8 tensor ops per column,
whose dispatch cost dominates at the shapes of a solve batch; here they are plain loops over contiguous
rows. Same operations in the same order per element (float32: the vertex, its rounding half to even,
the clamp, the change times the scale; the update g - h * d), so the codes agree with the torch path's
up to the rounding of a multiply-add where the compiler contracts one (a tie then may round the other way).

Import is lazy and optional: without numba (or with QUANTKIT_NATIVE=0) the torch path runs.
"""

from __future__ import annotations

import numpy as np

from ._rtn_native import njit


@njit(nogil=True, error_model="numpy")
def cd_block(qt, gb, step, s_t, hd, delta, i1, qmin, qmax):
    """One block of columns i1 .. i1 + B of a coordinate-descent sweep, in place. qt, step, s_t [E, K, N]
    float32 (codes, Hd_jj s_j, scales, transposed: a column is a contiguous row); gb [E, B, N] the block's
    gradient rows (Hd E^T), kept current; hd [E, K, K] the damped Hessians; delta [E, B, N] out: each column's
    change of the dequantized weights."""
    e_n, b_n, n_n = gb.shape
    for e in range(e_n):
        for i in range(b_n):
            j = i1 + i
            for n in range(n_n):
                old = qt[e, j, n]
                v = np.round(old + gb[e, i, n] / step[e, j, n])
                v = qmin if v < qmin else (qmax if v > qmax else v)
                delta[e, i, n] = (v - old) * s_t[e, j, n]
                qt[e, j, n] = v
            for ii in range(i + 1, b_n):
                h = hd[e, i1 + ii, j]
                for n in range(n_n):
                    gb[e, ii, n] -= h * delta[e, i, n]
