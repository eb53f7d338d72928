"""GPTQ's code refinement (`quant.gptq.refine_codes`) as one compiled loop (numba, compiled once and cached
on disk, as quant/_rtn_native.py): each row runs all its coordinate-descent sweeps on its own, its gradient
row in cache, and a code that moves updates the gradient with one multiply-add per column (none for the codes
that stay). The torch path sweeps every row of a block of columns at once, ~8 tensor ops per column plus a
GEMM per block, whose costs do not shrink when few codes move. Same float32 operations per code (the
vertex, its rounding half to even, the clamp, the change times the scale); the gradient's updates are summed
in another order than the torch path's GEMMs, so a rounding tie may go the other way (about one code in a
thousand, tests/quant/test_gptq.py).

Import is lazy and optional: without numba (or with QUANTKIT_NATIVE=0) the torch path runs.
"""

from __future__ import annotations

import numpy as np

from .jit import njit


@njit(nogil=True, error_model="numpy")
def cd_rows(q, ex, g, scale, diag, hdt, gs, sweeps, qmin, qmax):
    """Whole sweeps of coordinate descent, one row at a time, in place: rows are independent (the Hessian
    couples the columns of a row only), so each row runs all its sweeps with its gradient row in cache. For
    R rows of experts ex [R] (int64): q [R, K] float32 codes, g [R, K] float32 the row's gradient Hd e_n (kept
    current), scale [R, G] float32 its group scales (0: a row to leave as it is); diag [E, K] the damped
    Hessians' diagonals and hdt [E, K, K] the damped Hessians transposed (hdt[e, j] = column j of Hd). A code
    that moves by d (in weight units) updates the row's gradient by -d Hd[:, j]: K multiply-adds per moved
    code, none for the codes that stay; the last sweep updates only the columns still ahead."""
    r_n, k_n = q.shape
    lo, hi = np.float32(qmin), np.float32(qmax)
    kn = np.uint64(k_n)  # unsigned indices: no negative-index wraparound, so the update loop vectorizes
    for r in range(r_n):
        e = ex[r]
        qr, gr, sr, dr = q[r], g[r], scale[r], diag[e]
        for sweep in range(sweeps):
            last = sweep == sweeps - 1
            for gi in range(k_n // gs):
                s = sr[gi]
                for j in range(gi * gs, (gi + 1) * gs):
                    step = dr[j] * s  # Hd_jj s_j, the curvature of the error in code units (float32)
                    if not step > 0:
                        continue
                    old = qr[j]
                    v = np.round(old + gr[j] / step)  # the grid point nearest the vertex of this weight's parabola
                    v = lo if v < lo else (hi if v > hi else v)
                    if v == old:
                        continue
                    d = np.float32((v - old) * s)
                    qr[j] = v
                    hr = hdt[e, j]
                    for t in range(np.uint64(j + 1) if last else np.uint64(0), kn):
                        gr[t] -= hr[t] * d
