"""Fused FP4 RTN (NVFP4 and MXFP4, amax scales): group scales, E2M1 codes, nibble packing and error
energy in one pass over each row (numba, compiled once and cached on disk, as quant/_rtn_native.py).

`quantkit.quant.fp4.rtn_nvfp4` / `rtn_mxfp4` are the definition; this is their fast path for amax
scales on bf16 or float32 rows on CPU. Same arithmetic, in the same order and precision, as the torch
path in quant/fp4.py (see its module docstring for where each step comes from):

    NVFP4 (group 16), given the row's float32 global scale gs:
        amax_g = max |w| over the group                     (exact: an integer max over the bit patterns)
        local  = amax_g / 6, rounded to the weight's dtype  (float32 division, then RNE to bf16 for bf16)
        scale  = e4m3(min(gs * local, 448)), 0 -> 0.125     (float32 product, RNE to float8_e4m3fn)
        code   = e2m1(w / (scale / gs))                     (two float32 divisions)
    MXFP4 (group 32):
        scale  = E8M0 from amax_g's bits (+ 2^21, exponent field - 2, clamped), no float arithmetic
        code   = e2m1(w / 2^(scale - 127)), the quotient rounded to the weight's dtype (bf16: RNE)

E2M1 rounding is the threshold count of `fp4.encode_e2m1` (ties to the even index, sign of x < 0).
So packed bytes and scales are bit-identical to the torch path (tests/quant/test_fp4_native.py); the
error sums are accumulated in float64 (the torch path sums rows in float32), so SQNR may differ in its
last digits. The global scale spans rows: the caller computes it (fp4.choose_global_scale) from the
amax that `absmax_bits16` / `absmax_bits32` take in one pass over the magnitudes' bit patterns.

Fitted scales (`scale_search: mse`): per group, each candidate scale of fp4.NV_SEARCH / MX_SEARCH is
tried as fp4._candidate_errors does, term by term in float32, and summed in float64. torch picks the first
minimum of float32 sums in its own (CPU-dependent) reduction order, which the kernel does not copy; it
keeps its pick only where that pick provably equals torch's (`_pick`: every other candidate's error is
more than a relative 1e-5 above the minimum, against a float32 summation error below 1e-6), and marks
the row otherwise; marked rows are recomputed by the torch path (fp4._rtn_native). So fitted scales are
bit-identical too.

Import is lazy and optional: without numba (or with QUANTKIT_NATIVE=0) the torch path runs.
"""

from __future__ import annotations

import numpy as np
import torch

from ._rtn_native import _sumsq  # the INT4 kernel's float64 sum of squares
from .jit import njit

# the float32 value of each positive e4m3 code
_E4M3 = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy().copy()

_ABS = np.uint32(0x7FFFFFFF)
_FINITE_LIMIT = np.uint32(0x7F800000)  # |x| bit patterns at or above this are Inf/NaN
_MIN_NORMAL_E4M3 = np.uint32(0x3C800000)  # 2^-6 as float32 bits: below it e4m3 is subnormal
_DENORM = np.float32(16384.0)  # 2^14: adding it rounds a float32 < 2^-6 to a multiple of 2^-9 (RNE)
_DENORM_BITS = np.uint32(141 << 23)
_ZERO_SCALE_CODE = np.uint8(0x20)  # e4m3 0.125, compressed-tensors' replacement for a zero scale


@njit(nogil=True, inline="always")
def _bf16(x, tmp, tmpu):
    """float32 -> nearest-even bf16 -> float32 (finite x), as torch rounds a bf16 result."""
    tmp[0] = x
    u = tmpu[0]
    tmpu[0] = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    return tmp[0]


@njit(nogil=True, inline="always")
def _e4m3_code(s, tmp, tmpu):
    """finite float32 s in [0, 448] -> float8_e4m3fn code, round to nearest even (torch's conversion)."""
    tmp[0] = s
    u = tmpu[0]
    if u < _MIN_NORMAL_E4M3:
        tmp[0] = s + _DENORM
        return np.uint8(tmpu[0] - _DENORM_BITS)
    odd = (u >> np.uint32(20)) & np.uint32(1)
    u = u - np.uint32(120 << 23) + np.uint32(0x7FFFF) + odd  # rebias 127 -> 7, round the 20 dropped bits
    return np.uint8(u >> np.uint32(20))


@njit(nogil=True, inline="always")
def _e2m1(v):
    """float32 (already divided by its scale) -> (E2M1 code, its float32 value): the threshold count of
    fp4.encode_e2m1, the value built from the same comparisons (steps .5 x4, 1 x2, 2), no table lookup
    (a gather would keep the loop from vectorizing). Code 8 ("-0") has the value -0.0, as decoded."""
    a = abs(v)
    b1 = a > np.float32(0.25)
    b2 = a >= np.float32(0.75)
    b3 = a > np.float32(1.25)
    b4 = a >= np.float32(1.75)
    b5 = a > np.float32(2.5)
    b6 = a >= np.float32(3.5)
    b7 = a > np.float32(5.0)
    idx = np.uint8(b1) + np.uint8(b2) + np.uint8(b3) + np.uint8(b4) + np.uint8(b5) + np.uint8(b6) + np.uint8(b7)
    mag = (np.float32(0.5) * (np.float32(b1) + np.float32(b2) + np.float32(b3) + np.float32(b4))
           + (np.float32(b5) + np.float32(b6)) + np.float32(2.0) * np.float32(b7))
    neg = v < np.float32(0.0)
    return idx | (np.uint8(8) if neg else np.uint8(0)), -mag if neg else mag


@njit(nogil=True, inline="always")
def _group_absmax(xu, o, g):
    m = np.uint32(0)
    for j in range(o, o + g):
        a = xu[j] & _ABS
        m = a if a > m else m
    return m


@njit(nogil=True, fastmath={"reassoc"})
def _sum64(a, n):
    """sum of a[:n] in float64; reassociation only (vectorized)."""
    acc = 0.0
    for j in range(n):
        acc += np.float64(a[j])
    return acc


@njit(nogil=True, inline="always")
def _cand_error(x, o, g, e, tb):
    """float64 sum over the group x[o:o+g] of the float32 squared error of scale e, term by term as
    fp4._candidate_errors computes it (|w| / e rounded to E2M1, times e, minus |w|, squared): the terms
    in tb first (an elementwise loop that vectorizes), then their sum."""
    for j in range(g):
        a = abs(x[o + j])
        _, val = _e2m1(a / e)
        t = val * e - a
        tb[j] = t * t
    return _sum64(tb, g)


@njit(nogil=True, inline="always")
def _pick(dv, cv):
    """First minimum of the candidates' float64 errors dv -> (index, sure). torch picks the first minimum
    of float32 sums of the same float32 terms, each within 15 * 2^-24 (relative; the terms are >= 0) of the
    exact sum: the pick is the same when every other candidate's error exceeds the minimum by a relative
    1e-5, or is the same scale (cv), or both are exactly 0 (identical sums: the first wins in both). Else
    (or NaN) not sure: the caller recomputes the row with torch."""
    b = 0
    for c in range(1, dv.shape[0]):
        if dv[c] < dv[b]:
            b = c
    sure = dv[b] == dv[b]
    for c in range(dv.shape[0]):
        if c == b or cv[c] == cv[b] or (dv[b] == 0.0 and dv[c] == 0.0):
            continue
        if not (dv[c] > dv[b] * (1.0 + 1e-5)):
            sure = False
    return b, sure


@njit(nogil=True, error_model="numpy")
def _nv_row(x, xu, bf16, gs, offs, pk, sc, cbuf, ebuf, tmp, tmpu, dv, cv, tb):
    """One float32 row x [K] (xu: its bits) -> packed codes pk [K/2], e4m3 codes sc [K/16]; `offs`
    (fitted scales, empty for amax): the e4m3 code offsets tried, fp4.NV_SEARCH. Returns (sum x^2,
    sum err^2, sum err^2 with the amax scales, finite, sure)."""
    finite = True
    sure = True
    d0 = 0.0
    for gi in range(x.shape[0] // 16):
        o = gi * 16
        m = _group_absmax(xu, o, 16)
        if m >= _FINITE_LIMIT:
            finite = False
            m = np.uint32(0)
        tmpu[0] = m
        local = tmp[0] / np.float32(6.0)
        if bf16:
            local = _bf16(local, tmp, tmpu)
        s = gs * local
        s = np.float32(448.0) if s > np.float32(448.0) else s
        code = _e4m3_code(s, tmp, tmpu)
        if code == 0:
            code = _ZERO_SCALE_CODE
        if offs.shape[0]:
            for c in range(offs.shape[0]):
                cc = np.int64(code) + offs[c]
                cc = 1 if cc < 1 else (0x7E if cc > 0x7E else cc)  # never 0 (no scale) nor 0x7F (NaN)
                cv[c] = cc
                dv[c] = _cand_error(x, o, 16, _E4M3[cc] / gs, tb)
            d0 += dv[0]
            b, ok = _pick(dv, cv)
            sure = sure and ok
            code = np.uint8(cv[b])
        sc[gi] = code
        eff = _E4M3[code] / gs
        for j in range(o, o + 16):
            c, val = _e2m1(x[j] / eff)
            cbuf[j] = c
            ebuf[j] = val * eff - x[j]
    for w in range(pk.shape[0]):
        pk[w] = cbuf[2 * w] | (cbuf[2 * w + 1] << np.uint8(4))
    return _sumsq(x), _sumsq(ebuf), d0, finite, sure


@njit(nogil=True, inline="always")
def _e8m0_value(e, tmp, tmpu):
    tmpu[0] = np.uint32(1 << 22) if e == 0 else np.uint32(e) << np.uint32(23)  # 2^(e - 127), exact
    return tmp[0]


@njit(nogil=True, error_model="numpy")
def _mx_row(x, xu, bf16, offs, pk, sc, cbuf, ebuf, tmp, tmpu, dv, cv, tb):
    """As _nv_row for MXFP4: E8M0 scales sc [K/32]; `offs`: exponent offsets, fp4.MX_SEARCH."""
    finite = True
    sure = True
    d0 = 0.0
    eu = ebuf.view(np.uint32)
    for gi in range(x.shape[0] // 32):
        o = gi * 32
        m = _group_absmax(xu, o, 32)
        if m >= _FINITE_LIMIT:
            finite = False
            m = np.uint32(0)
        field = ((m + np.uint32(1 << 21)) >> np.uint32(23)) & np.uint32(0xFF)
        if field == 0xFF:
            e = np.uint32(255)
        else:
            e = field - np.uint32(2) if field > 2 else np.uint32(0)
        if offs.shape[0]:
            for c in range(offs.shape[0]):
                ee = np.int64(e) + offs[c]
                ee = 0 if (e == 0 or ee < 0) else (254 if ee > 254 else ee)
                cv[c] = ee
                dv[c] = _cand_error(x, o, 32, _e8m0_value(ee, tmp, tmpu), tb)
            d0 += dv[0]
            b, ok = _pick(dv, cv)
            sure = sure and ok
            e = np.uint32(cv[b])
        sc[gi] = np.uint8(e)
        eff = _e8m0_value(e, tmp, tmpu)
        # the quotients in ebuf first: rounded to bf16 on their bits in a separate loop (vectorizes)
        for j in range(o, o + 32):
            ebuf[j] = x[j] / eff
        if bf16:
            for j in range(o, o + 32):
                u = eu[j]
                eu[j] = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)
        for j in range(o, o + 32):
            c, val = _e2m1(ebuf[j])
            cbuf[j] = c
            ebuf[j] = val * eff - x[j]
    for w in range(pk.shape[0]):
        pk[w] = cbuf[2 * w] | (cbuf[2 * w + 1] << np.uint8(4))
    return _sumsq(x), _sumsq(ebuf), d0, finite, sure


@njit(nogil=True)
def fp4_pack_bf16(w16, nv, gs, offs, pk, sc, sig, noise, noise0, unsure, bad):
    """w16 [R, K] uint16 (bf16 bit patterns), gs [R] float32 (NVFP4; unused for MXFP4) ->
    pk [R, K/2] uint8, sc [R, G] uint8 (e4m3 or E8M0 codes), sig/noise [R] float64, bad [R] bool."""
    r_total, k = w16.shape
    x = np.empty(k, np.float32)
    xu = x.view(np.uint32)
    cbuf = np.empty(k, np.uint8)
    ebuf = np.empty(k, np.float32)
    tmp = np.empty(1, np.float32)
    tmpu = tmp.view(np.uint32)
    dv = np.empty(offs.shape[0], np.float64)
    cv = np.empty(offs.shape[0], np.int64)
    tb = np.empty(32, np.float32)
    for r in range(r_total):
        for j in range(k):
            xu[j] = np.uint32(w16[r, j]) << np.uint32(16)
        if nv:
            s2, n2, n0, ok, sure = _nv_row(x, xu, True, gs[r], offs, pk[r], sc[r], cbuf, ebuf, tmp, tmpu, dv, cv, tb)
        else:
            s2, n2, n0, ok, sure = _mx_row(x, xu, True, offs, pk[r], sc[r], cbuf, ebuf, tmp, tmpu, dv, cv, tb)
        sig[r] = s2
        noise[r] = n2
        noise0[r] = n0
        unsure[r] = not sure
        bad[r] = not ok


@njit(nogil=True)
def fp4_pack_f32(w32, nv, gs, offs, pk, sc, sig, noise, noise0, unsure, bad):
    """As fp4_pack_bf16, for float32 rows."""
    r_total, k = w32.shape
    cbuf = np.empty(k, np.uint8)
    ebuf = np.empty(k, np.float32)
    tmp = np.empty(1, np.float32)
    tmpu = tmp.view(np.uint32)
    dv = np.empty(offs.shape[0], np.float64)
    cv = np.empty(offs.shape[0], np.int64)
    tb = np.empty(32, np.float32)
    for r in range(r_total):
        x = w32[r]
        xu = x.view(np.uint32)
        if nv:
            s2, n2, n0, ok, sure = _nv_row(x, xu, False, gs[r], offs, pk[r], sc[r], cbuf, ebuf, tmp, tmpu, dv, cv, tb)
        else:
            s2, n2, n0, ok, sure = _mx_row(x, xu, False, offs, pk[r], sc[r], cbuf, ebuf, tmp, tmpu, dv, cv, tb)
        sig[r] = s2
        noise[r] = n2
        noise0[r] = n0
        unsure[r] = not sure
        bad[r] = not ok


@njit(nogil=True)
def absmax_bits16(u, out):
    """u [B, M] uint16 (bf16 bit patterns) -> out [B] uint16: the largest |x| bit pattern of each row, which
    is the bit pattern of max |x| (NaN patterns sort above Inf: the caller checks). An integer max: exact."""
    for b in range(u.shape[0]):
        m = np.uint16(0)
        for j in range(u.shape[1]):
            a = u[b, j] & np.uint16(0x7FFF)
            m = a if a > m else m
        out[b] = m


@njit(nogil=True)
def absmax_bits32(u, out):
    """As absmax_bits16 for float32 rows [B, M] uint32."""
    for b in range(u.shape[0]):
        m = np.uint32(0)
        for j in range(u.shape[1]):
            a = u[b, j] & _ABS
            m = a if a > m else m
        out[b] = m
