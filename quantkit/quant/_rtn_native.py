"""Fused RTN INT4 quantize + pack + error energy in one pass over each row (numba, compiled once and
cached on disk).

`quantkit.quant.int4.rtn` is the definition; this is its fast path for the common case (INT4, packed,
bf16 or float32 rows on CPU). The torch path makes ~15 passes over every element (convert, abs,
group max, divide, round, clamp, cast, error, squares, sums, nibble packing); here each row is read
once, stays in cache, and every step runs on it. Same arithmetic, in the same order, in float32:

    absmax / 7.5 (or (max - min) / 15) -> rounded to the stored scale dtype -> q = clamp(rint(w / s) + zp)

so packed words, scales and zero points are bit-identical to the torch path (tests/test_rtn_native.py);
the error sums are accumulated in float64 (the torch path sums rows in float32), so SQNR may differ
in its last digits.

`mse_scales` (symmetric, or asymmetric: scales and zero points) is `choose_qparams_mse`'s clipping search
the same way: per group, every candidate's codes and weighted error in one cache-resident loop (the torch
path makes ~8 passes over the whole tensor per candidate). The candidates and codes are the torch path's;
the error sums are float64.

Import is lazy and optional: without numba (or with QUANTKIT_NATIVE=0) `rtn` uses the torch path.
"""

from __future__ import annotations

import numpy as np

from .jit import njit

# scale storage dtypes understood by the kernel (others take the torch path)
SCALE_F32, SCALE_BF16 = 0, 1


@njit(nogil=True, inline="always")
def _round_scale(s, mode, tmp, tmpu):
    """float32 -> the stored dtype -> float32 (round to nearest even), for finite non-negative s."""
    if mode == SCALE_BF16:
        tmp[0] = s
        u = tmpu[0]
        u = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)
        tmpu[0] = u
        return tmp[0]
    return s


_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23: (x + M) - M rounds float32 |x| < 2^22 to nearest even
_ABS = np.uint32(0x7FFFFFFF)
_FINITE_LIMIT = np.uint32(0x7F800000)  # |x| bit patterns at or above this are Inf/NaN


@njit(nogil=True, inline="always")
def _rint(x):
    return (x + _MAGIC) - _MAGIC


@njit(nogil=True, inline="always")
def _sortable(u):
    """float32 bits -> uint32 key whose unsigned order is the float order (NaN aside)."""
    return ~u if u & np.uint32(0x80000000) else u | np.uint32(0x80000000)


@njit(nogil=True, inline="always")
def _unsortable(k):
    return k & np.uint32(0x7FFFFFFF) if k & np.uint32(0x80000000) else ~k


@njit(nogil=True, fastmath={"reassoc"})
def _sumsq(a):
    """sum of a^2 in float64; reassociation only (vectorized), no finite-math assumptions."""
    acc = 0.0
    for j in range(a.shape[0]):
        v = np.float64(a[j])
        acc += v * v
    return acc


@njit(nogil=True, inline="always")
def _quant_row(x, xu, g, symmetric, scale_mode, pk, sc, zp, qbuf, ebuf, tmp, tmpu):
    """Quantize and pack one float32 row x [K] (xu: its uint32 view); returns (sum x^2, sum err^2, finite).

    Group extrema are integer reductions over the bit patterns (exact, vectorizable); each group's
    elementwise loop is branch-free; the error sums run separately with reassociation allowed."""
    k = x.shape[0]
    n_groups = k // g
    qmin = np.float32(-8.0)
    qmax = np.float32(7.0)
    tiny = np.float32(1.1754943508222875e-38)
    finite = True
    for gi in range(n_groups):
        o = gi * g
        z = np.float32(0.0)
        if symmetric:
            m = np.uint32(0)
            for j in range(o, o + g):
                a = xu[j] & _ABS
                m = a if a > m else m
            if m >= _FINITE_LIMIT:
                finite = False
                m = np.uint32(0)
            tmpu[0] = m
            s = tmp[0] / np.float32(7.5)
        else:
            lo_k = np.uint32(0x80000000)  # sortable key of +0.0: min <= 0 <= max
            hi_k = np.uint32(0x80000000)
            bad = np.uint32(0)
            for j in range(o, o + g):
                u = xu[j]
                a = u & _ABS
                bad = a if a > bad else bad
                kk = _sortable(u)
                lo_k = kk if kk < lo_k else lo_k
                hi_k = kk if kk > hi_k else hi_k
            if bad >= _FINITE_LIMIT:
                finite = False
                lo_k = hi_k = np.uint32(0x80000000)
            tmpu[0] = _unsortable(lo_k)
            lo = tmp[0]
            tmpu[0] = _unsortable(hi_k)
            hi = tmp[0]
            s = (hi - lo) / np.float32(15.0)
        s = _round_scale(s, scale_mode, tmp, tmpu)
        if not (s > tiny):
            s = np.float32(1.0)
        if not symmetric:
            z = qmin - _rint(lo / s)
            z = qmin if z < qmin else z
            z = qmax if z > qmax else z
            zp[gi] = np.int32(z)
        sc[gi] = s
        for j in range(o, o + g):
            v = x[j]
            q = _rint(v / s) + z
            q = qmin if q < qmin else q
            q = qmax if q > qmax else q
            qbuf[j] = np.uint8(np.int32(q) + 8)
            ebuf[j] = (q - z) * s - v
    if k % 8 == 0:
        # eight nibble bytes per uint64 (little-endian), pulled together by three shift-or-mask steps
        # into the low 32 bits: element j at bits 4*(j % 8) of word j // 8 (branch-free, vectorizes)
        v8 = qbuf.view(np.uint64)
        for w in range(pk.shape[0]):
            v = v8[w]
            v = (v | (v >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
            v = (v | (v >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
            v = (v | (v >> np.uint64(16))) & np.uint64(0x00000000FFFFFFFF)
            pk[w] = np.uint32(v)
    else:
        for w in range(pk.shape[0]):
            acc = np.uint32(0)
            base = w * 8
            for t in range(8):
                j = base + t
                if j < k:
                    acc |= np.uint32(qbuf[j]) << np.uint32(4 * t)
            pk[w] = acc
    return _sumsq(x), _sumsq(ebuf), finite


@njit(nogil=True)
def _row(x, xu, g, symmetric, scale_mode, pk, sc, zp, qbuf, ebuf, tmp, tmpu):
    """_quant_row with the common group sizes as compile-time constants (fixed trip counts vectorize
    fully: ~2x faster), any other size generic."""
    if g == 32:
        return _quant_row(x, xu, 32, symmetric, scale_mode, pk, sc, zp, qbuf, ebuf, tmp, tmpu)
    if g == 64:
        return _quant_row(x, xu, 64, symmetric, scale_mode, pk, sc, zp, qbuf, ebuf, tmp, tmpu)
    if g == 128:
        return _quant_row(x, xu, 128, symmetric, scale_mode, pk, sc, zp, qbuf, ebuf, tmp, tmpu)
    return _quant_row(x, xu, g, symmetric, scale_mode, pk, sc, zp, qbuf, ebuf, tmp, tmpu)


@njit(nogil=True)
def rtn_pack_bf16(w16, g, symmetric, scale_mode, pk, sc, zp, sig, noise, bad):
    """w16 [R, K] uint16 (bf16 bit patterns) -> pk [R, W] uint32, sc [R, G] float32, zp [R, G] int32."""
    r_total, k = w16.shape
    for r in range(r_total):
        x = np.empty(k, np.float32)
        xu = x.view(np.uint32)
        for j in range(k):
            xu[j] = np.uint32(w16[r, j]) << np.uint32(16)
        qbuf = np.empty(k, np.uint8)
        ebuf = np.empty(k, np.float32)
        tmp = np.empty(1, np.float32)
        s2, n2, ok = _row(x, xu, g, symmetric, scale_mode, pk[r], sc[r], zp[r], qbuf, ebuf, tmp,
                                tmp.view(np.uint32))
        sig[r] = s2
        noise[r] = n2
        bad[r] = not ok


@njit(nogil=True)
def rtn_pack_f32(w32, g, symmetric, scale_mode, pk, sc, zp, sig, noise, bad):
    """As rtn_pack_bf16, for float32 rows (e.g. FP8 sources dequantized on read)."""
    r_total, k = w32.shape
    for r in range(r_total):
        x = w32[r]
        qbuf = np.empty(k, np.uint8)
        ebuf = np.empty(k, np.float32)
        tmp = np.empty(1, np.float32)
        s2, n2, ok = _row(x, x.view(np.uint32), g, symmetric, scale_mode, pk[r], sc[r], zp[r], qbuf, ebuf,
                                tmp, tmp.view(np.uint32))
        sig[r] = s2
        noise[r] = n2
        bad[r] = not ok


@njit(nogil=True, fastmath={"reassoc"})
def _sum64(a):
    """sum of a in float64; reassociation only (vectorized), no finite-math assumptions."""
    acc = 0.0
    for j in range(a.shape[0]):
        acc += np.float64(a[j])
    return acc


@njit(nogil=True, inline="always")
def _mse_group(x, o, g, wr, base, ratios, scale_mode, qmin, qmax, ebuf, tmp, tmpu):
    """The clipped scale of group x[o:o+g] with the least weighted squared error (quant/int4.py
    choose_qparams_mse): each candidate bf16(base * ratio) (1 where not above float32's tiny), codes
    clamp(rint(w / s)), error ((q s - w)^2 * wr) per element in float32 (a branch-free loop), summed in
    float64; the first of equal errors is kept."""
    tiny = np.float32(1.1754943508222875e-38)
    best_s = np.float32(1.0)
    best_e = 0.0
    for ri in range(ratios.shape[0]):
        s = _round_scale(base * ratios[ri], scale_mode, tmp, tmpu)
        if not (s > tiny):
            s = np.float32(1.0)
        for j in range(g):
            v = x[o + j]
            q = _rint(v / s)
            q = qmin if q < qmin else q
            q = qmax if q > qmax else q
            d = q * s - v
            ebuf[j] = d * d * wr[o + j]
        e = _sum64(ebuf[:g])
        if ri == 0 or e < best_e:
            best_s, best_e = s, e
    return best_s


@njit(nogil=True)
def _mse_rows(w, widx, wt, g, ratios, scale_mode, half, qmin, qmax, symmetric, sc, zp, bad):
    """The clipping search of every group of rows w [R, K]: symmetric (`_mse_group`, from the group's absmax)
    into sc, or asymmetric (`_mse_group_asym`, from its range with 0 inside) into sc and zp."""
    half, qmin, qmax = np.float32(half), np.float32(qmin), np.float32(qmax)  # float32 arithmetic throughout
    span = qmax - qmin
    r_total, k = w.shape
    tmp = np.empty(1, np.float32)
    tmpu = tmp.view(np.uint32)
    ebuf = np.empty(g, np.float32)
    out = np.empty(2, np.float32)
    tiny = np.float32(1.1754943508222875e-38)
    for r in range(r_total):
        x = w[r]
        wr = wt[widx[r]]
        for gi in range(k // g):
            o = gi * g
            m = lo = hi = np.float32(0.0)
            finite = True
            if symmetric:
                for j in range(o, o + g):
                    a = abs(x[j])
                    finite = finite and a < np.float32(np.inf)  # False for Inf and NaN
                    m = a if a > m else m
            else:
                for j in range(o, o + g):
                    v = x[j]
                    finite = finite and abs(v) < np.float32(np.inf)
                    lo = v if v < lo else lo
                    hi = v if v > hi else hi
            if not finite:
                bad[r] = True
                sc[r, gi] = np.float32(1.0)
                continue
            if symmetric:
                base = _round_scale(m / half, scale_mode, tmp, tmpu)
                if not (base > tiny):
                    base = np.float32(1.0)
                sc[r, gi] = _mse_group(x, o, g, wr, base, ratios, scale_mode, qmin, qmax, ebuf, tmp, tmpu)
            else:
                _mse_group_asym(x, o, g, wr, lo, hi, ratios, scale_mode, qmin, qmax, span, ebuf, tmp, tmpu, out)
                sc[r, gi] = out[0]
                zp[r, gi] = np.int32(out[1])


@njit(nogil=True)
def mse_scales(w, widx, wt, g, ratios, scale_mode, half, qmin, qmax, symmetric, sc, zp, bad):
    """choose_qparams_mse's scales sc [R, G] float32 (and, not `symmetric`, zero points zp [R, G] int32; a
    symmetric search leaves zp as it is) for float32 rows w [R, K] in groups of g; each row r's errors weighted
    by wt[widx[r]] [K] (rows of ones where unweighted). bad[r]: the row holds Inf or NaN (its scales are not
    set: the caller takes the torch path)."""
    if g == 32:
        _mse_rows(w, widx, wt, 32, ratios, scale_mode, half, qmin, qmax, symmetric, sc, zp, bad)
    elif g == 128:
        _mse_rows(w, widx, wt, 128, ratios, scale_mode, half, qmin, qmax, symmetric, sc, zp, bad)
    else:
        _mse_rows(w, widx, wt, g, ratios, scale_mode, half, qmin, qmax, symmetric, sc, zp, bad)


@njit(nogil=True, inline="always")
def _mse_group_asym(x, o, g, wr, lo, hi, ratios, scale_mode, qmin, qmax, span, ebuf, tmp, tmpu, out):
    """The asymmetric clipping of group x[o:o+g] with the least weighted squared error (quant/int4.py
    choose_qparams_mse): each candidate range [lo r, hi r] gives s = stored((hi - lo) r / span) (1 where not
    above float32's tiny) and zp = clamp(qmin - rint(lo r / s)); codes clamp(rint(w / s) + zp), error
    (((q - zp) s - w)^2 * wr) per element in float32, summed in float64; the first of equal errors is kept.
    out[0], out[1]: the chosen scale and zero point."""
    tiny = np.float32(1.1754943508222875e-38)
    best_e = 0.0
    for ri in range(ratios.shape[0]):
        r = ratios[ri]
        s = _round_scale((hi - lo) * r / span, scale_mode, tmp, tmpu)
        if not (s > tiny):
            s = np.float32(1.0)
        z = qmin - _rint(lo * r / s)
        z = qmin if z < qmin else z
        z = qmax if z > qmax else z
        for j in range(g):
            v = x[o + j]
            q = _rint(v / s) + z
            q = qmin if q < qmin else q
            q = qmax if q > qmax else q
            d = (q - z) * s - v
            ebuf[j] = d * d * wr[o + j]
        e = _sum64(ebuf[:g])
        if ri == 0 or e < best_e:
            out[0], out[1], best_e = s, z, e
