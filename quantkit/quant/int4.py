"""Group-wise integer weight quantization (RTN), with the packing fused in for speed (the fused kernel).

Verbs follow torchao: `choose_qparams` -> `quantize` -> `dequantize` (the packing is pack/int4.py).
Every function is pure and batched: a weight is `[..., out, in]` (a leading expert dim `E` is allowed),
so all routed experts of a layer are processed in one call.

Conventions (compressed-tensors, see docs/format.md):
- symmetric, b bits: scale = absmax / ((2^b - 1) / 2)  (7.5 for INT4, range [-8, 7]), zero_point = 0
- asymmetric: scale = (max - min) / (2^b - 1) with min <= 0 <= max, zero_point = round(-min/scale) - 2^(b-1)
  clamped to [-2^(b-1), 2^(b-1)-1] (signed, as compressed-tensors stores it)
- meaning: w ~= (q - zero_point) * scale, q = clamp(round(w / scale) + zero_point, qmin, qmax)
- packing: u = q + 8 in [0, 15]; element j of a row -> int32 word j // 8, bits 4*(j % 8).. (LSB first);
  INT8 (num_bits 8): u = q + 128, word j // 4, bits 8*(j % 4)..
"""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .bits import pack_ints

# Legend: E = experts (optional leading dims), N = out_features, K = in_features, G = groups = K / group_size


@dataclass(frozen=True)
class QParams:
    scale: torch.Tensor  # [..., N, G] float32
    zero_point: torch.Tensor | None  # [..., N, G] int32 (signed) or None when symmetric


def qrange(num_bits: int) -> tuple[int, int]:
    return -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1


def _grouped(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """[..., N, K] -> [..., N, G, g]; group_size None means one group per row (channel)."""
    k = w.shape[-1]
    g = k if group_size is None else group_size
    if k % g != 0:
        raise ValueError(f"in_features {k} is not a multiple of group_size {g}")
    return w.reshape(*w.shape[:-1], k // g, g)


def _reduce_last(a: torch.Tensor, op) -> torch.Tensor:
    """max/min over the last dim by pairwise halving: several times faster than amax(-1) over short
    (32-128 wide) groups on CPU, and exact (max/min are order-independent)."""
    while a.shape[-1] > 1:
        h = a.shape[-1] // 2
        if a.shape[-1] % 2:
            a = torch.cat([op(a[..., :h], a[..., h:2 * h]), a[..., 2 * h:]], dim=-1)
        else:
            a = op(a[..., :h], a[..., h:])
    return a[..., 0]


def choose_qparams(w: torch.Tensor, num_bits: int = 4, group_size: int | None = 32, symmetric: bool = True,
                   scale_dtype: torch.dtype = torch.bfloat16) -> QParams:
    """Min/max qparams per (row, group). The scale is rounded to `scale_dtype` (how it is stored) so that
    quantize/dequantize use exactly the stored value."""
    wg = _grouped(w.float(), group_size)  # [..., N, G, g]
    qmin, qmax = qrange(num_bits)
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        absmax = _reduce_last(wg.abs(), torch.maximum)  # [..., N, G]
        scale = (absmax / ((qmax - qmin) / 2)).to(scale_dtype).float()
        scale = torch.where(scale > tiny, scale, torch.ones_like(scale))  # all-zero group: any scale works
        return QParams(scale, None)
    lo = _reduce_last(wg, torch.minimum).clamp(max=0.0)  # 0 must be representable
    hi = _reduce_last(wg, torch.maximum).clamp(min=0.0)
    scale = ((hi - lo) / (qmax - qmin)).to(scale_dtype).float()
    scale = torch.where(scale > tiny, scale, torch.ones_like(scale))
    zp = (qmin - torch.round(lo / scale)).clamp(qmin, qmax).to(torch.int32)
    return QParams(scale, zp)


MSE_RATIOS = tuple(round(1.0 - 0.025 * i, 3) for i in range(17))  # clipping ratios tried: 1.0 down to 0.6


def choose_qparams_mse(w: torch.Tensor, num_bits: int = 4, group_size: int | None = 32, symmetric: bool = True,
                       scale_dtype: torch.dtype = torch.bfloat16, weight: torch.Tensor | None = None,
                       ratios: tuple[float, ...] = MSE_RATIOS, native: bool = True) -> QParams:
    """Qparams per (row, group) that minimize the group's quantization error: the min/max range times the
    best of `ratios` (clipping), each candidate's scale rounded to `scale_dtype` as stored. Symmetric: the
    scale is absmax * r / 7.5 (INT4); asymmetric: the range [min * r, max * r] (0 kept inside, as min/max
    keeps it) with its own scale and zero point, as `choose_qparams` derives them. `weight` [..., K]
    (broadcast over rows, e.g. the Hessian's diagonal per input column): the error is
    sum_k weight_k (w_k - q_k)^2, else unweighted. Ratio 1.0 is always tried first and kept on ties, so the
    error is never above min/max's.

    On the CPU the search runs as one compiled pass per row when it can (quant/_rtn_native.py mse_scales:
    bf16 or float32 scales, finite weights, `weight` None or one row of K per leading index or for all):
    the same candidates and codes; its error sums are float64 where these are float32, so where two
    candidates' errors agree to float32 rounding the other may be chosen. `native=False`: this torch path."""
    if native:
        fast = _mse_native(w, num_bits, group_size, scale_dtype, weight, ratios, symmetric)
        if fast is not None:
            return fast
    wg = _grouped(w.float(), group_size)  # [..., N, G, g]
    wt = None if weight is None else _grouped(weight.float().unsqueeze(-2), group_size)  # [..., 1, G, g]
    qmin, qmax = qrange(num_bits)
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        base = choose_qparams(w, num_bits, group_size, symmetric, scale_dtype).scale
    else:  # the group's range, 0 inside
        lo = _reduce_last(wg, torch.minimum).clamp(max=0.0)
        hi = _reduce_last(wg, torch.maximum).clamp(min=0.0)
    best = None  # [scale, zero point or None, error], per group
    for r in ratios:
        sc = (base * r if symmetric else (hi - lo) * r / (qmax - qmin)).to(scale_dtype).float()
        sc = torch.where(sc > tiny, sc, torch.ones_like(sc))
        q = (wg / sc.unsqueeze(-1)).round_()
        if symmetric:
            zp = None
            q.clamp_(qmin, qmax)
        else:
            zp = (qmin - torch.round(lo * r / sc)).clamp(qmin, qmax)
            q.add_(zp.unsqueeze(-1)).clamp_(qmin, qmax).sub_(zp.unsqueeze(-1))
        d = q.mul_(sc.unsqueeze(-1)).sub_(wg).square_()
        err = (d if wt is None else d.mul_(wt)).sum(-1)  # [..., N, G]
        if best is None:
            best = [sc, zp, err]
        else:
            better = err < best[2]
            best = [None if new is None else torch.where(better, new, old) for new, old in zip((sc, zp, err), best)]
    return QParams(best[0], None if symmetric else best[1].to(torch.int32))


def _mse_native(w: torch.Tensor, num_bits: int, group_size: int | None, scale_dtype: torch.dtype,
                weight: torch.Tensor | None, ratios: tuple[float, ...], symmetric: bool = True) -> QParams | None:
    """choose_qparams_mse's qparams (scales [..., N, G], asymmetric also zero points) from the compiled search,
    or None where it does not apply (not on the CPU, no kernel, another scale dtype, a weight of another
    shape, a non-finite weight)."""
    k = w.shape[-1]
    if (w.device.type != "cpu" or w.ndim < 2 or k == 0 or scale_dtype not in (torch.float32, torch.bfloat16)
            or (weight is not None and (weight.device.type != "cpu"
                                        or tuple(weight.shape) not in ((k,), (*w.shape[:-2], k))))):
        return None
    mod = _native_module()
    if not mod:
        return None
    g = k if group_size is None else group_size
    _grouped(w[..., :1, :], group_size)  # validates divisibility
    rows = w.reshape(-1, k).float().contiguous()
    if weight is None or weight.ndim == 1:  # one row of weights for every row
        wt = (torch.ones(1, k) if weight is None else weight.float().reshape(1, k)).contiguous()
        widx = torch.zeros(rows.shape[0], dtype=torch.int64)
    else:  # one per leading index: row r of w [..., N, K] takes weight row r // N
        wt = weight.float().reshape(-1, k).contiguous()
        widx = torch.arange(rows.shape[0], dtype=torch.int64) // w.shape[-2]
    qmin, qmax = qrange(num_bits)
    sc = torch.empty(rows.shape[0], k // g, dtype=torch.float32)
    bad = torch.zeros(rows.shape[0], dtype=torch.bool)
    mode = mod.SCALE_F32 if scale_dtype == torch.float32 else mod.SCALE_BF16
    zp = torch.zeros(rows.shape[0], k // g, dtype=torch.int32)  # written by asymmetric searches only
    consts = (widx.numpy(), wt.numpy(), g, torch.tensor(ratios, dtype=torch.float32).numpy(), mode,
              float((qmax - qmin) / 2), float(qmin), float(qmax), bool(symmetric))
    if not run_rows(mod.mse_scales, rows.numpy(), consts, (sc.numpy(), zp.numpy(), bad.numpy()),
                    per_row=(0,)) or bad.any():
        return None
    shape = (*w.shape[:-1], k // g)
    return QParams(sc.reshape(shape), None if symmetric else zp.reshape(shape))


def quantize(w: torch.Tensor, qp: QParams, num_bits: int = 4) -> torch.Tensor:
    """w [..., N, K] -> q [..., N, K] int8 in [qmin, qmax]: clamp(round(w / scale) + zero_point)."""
    qmin, qmax = qrange(num_bits)
    wg = _grouped(w.float(), w.shape[-1] // qp.scale.shape[-1])
    if wg.data_ptr() == w.data_ptr():
        wg = wg.clone()
    q = wg.div_(qp.scale.unsqueeze(-1)).round_()
    if qp.zero_point is not None:
        q.add_(qp.zero_point.unsqueeze(-1))
    return q.clamp_(qmin, qmax).to(torch.int8).reshape(w.shape)


# Rows per chunk in `rtn`: ~2 MiB of float32 per step keeps the elementwise passes in cache, which is
# several times faster on CPU than whole-batch passes over [E, N, K] (measured in bench/convert_rtn.py).
CHUNK_ELEMENTS = 1 << 19


@dataclass(frozen=True)
class RTNResult:
    q: torch.Tensor  # [..., N, K] int8, or packed int32 [..., N, ceil(K/8)] (INT8: ceil(K/4)) when pack=True
    qparams: QParams  # scale [..., N, G] float32, zero_point [..., N, G] int32 | None
    signal: torch.Tensor  # [...] float64: sum of w^2 per matrix (for SQNR)
    noise: torch.Tensor  # [...] float64: sum of (w - dequant(q))^2 per matrix

    def sqnr_db(self) -> torch.Tensor:
        return 10 * torch.log10(self.signal / self.noise)


def rtn(w: torch.Tensor, num_bits: int = 4, group_size: int | None = 32, symmetric: bool = True,
        scale_dtype: torch.dtype = torch.bfloat16, pack: bool = False, native: bool = True,
        scale_search: str = "amax") -> RTNResult:
    """Round-to-nearest quantization of a batch of weights [..., N, K] (e.g. all experts [E, N, K]).

    Rows are independent (groups run along K), so the batch is flattened to rows and processed in
    cache-sized chunks; q and qparams equal `quantize(w, choose_qparams(w))` exactly. With pack=True
    the result holds `pack_ints(q, num_bits)` (num_bits 4 or 8). Also returns the per-matrix quantization
    error energy.

    With pack=True and num_bits 4 the fused kernel of quantkit.quant._rtn_native runs when it can (numba installed,
    bf16/float32 rows on CPU, bf16/float32 scales, all values finite); native=False forces this torch
    path, which is the definition the kernel is tested against.

    `scale_search` "mse": every group's clipping searched for the least squared error
    (`choose_qparams_mse`, never above min/max's error); the torch path runs (the kernel is min/max)."""
    *lead, n, k = w.shape
    rows = w.reshape(-1, k)
    n_groups = 1 if group_size is None else k // group_size
    _grouped(rows[:1], group_size)  # validates divisibility before any work
    if pack and num_bits not in (4, 8):
        raise ValueError("pack=True needs num_bits 4 or 8")
    if scale_search not in ("amax", "mse"):
        raise ValueError(f"scale_search must be amax or mse, got {scale_search!r}")
    res = (_rtn_native(rows, group_size or k, symmetric, scale_dtype)
           if pack and native and num_bits == 4 and scale_search == "amax" else None)
    out, scale, zp, sig, noise = res or _rtn_rows(rows, num_bits, group_size, symmetric, scale_dtype, pack,
                                                  scale_search)
    lead_n = (*lead, n)
    qp = QParams(scale.reshape(*lead_n, n_groups), None if zp is None else zp.reshape(*lead_n, n_groups))
    return RTNResult(out.reshape(*lead_n, out.shape[-1]), qp,
                     sig.reshape(lead_n).sum(-1), noise.reshape(lead_n).sum(-1))


def _rtn_rows(rows: torch.Tensor, num_bits: int, group_size: int | None, symmetric: bool, scale_dtype: torch.dtype,
              pack: bool, scale_search: str = "amax"):
    """The torch definition over rows [R, K] -> (q or packed [R, *], scale [R, G], zp [R, G] | None,
    sum w^2 [R], sum err^2 [R]), in cache-sized chunks. `scale_search` "mse": each group's scale is the
    min/max scale times the clipping ratio with the least squared error (`choose_qparams_mse`)."""
    k = rows.shape[-1]
    n_groups = 1 if group_size is None else k // group_size
    qmin, qmax = qrange(num_bits)
    per_word = 32 // num_bits
    out = (torch.empty(rows.shape[0], -(-k // per_word), dtype=torch.int32) if pack
           else torch.empty(rows.shape, dtype=torch.int8))
    scale = torch.empty(rows.shape[0], n_groups, dtype=torch.float32)
    zp = None if symmetric else torch.empty(rows.shape[0], n_groups, dtype=torch.int32)
    sig = torch.empty(rows.shape[0], dtype=torch.float64)
    noise = torch.empty(rows.shape[0], dtype=torch.float64)
    step = max(1, CHUNK_ELEMENTS // max(k, 1))
    for i in range(0, rows.shape[0], step):
        wf = _grouped(rows[i:i + step].float(), group_size)  # [r, G, g]
        qp = (choose_qparams_mse(wf.flatten(-2), num_bits, group_size, symmetric, scale_dtype)
              if scale_search == "mse" else choose_qparams(wf.flatten(-2), num_bits, group_size, symmetric, scale_dtype))
        s = qp.scale.unsqueeze(-1)
        qf = (wf / s).round_()
        if qp.zero_point is not None:
            qf.add_(qp.zero_point.unsqueeze(-1))
        qf.clamp_(qmin, qmax)
        q8 = qf.to(torch.int8).flatten(-2)
        # error of the dequantized value (q - zp) * scale, computed while the chunk is in cache
        if qp.zero_point is not None:
            qf.sub_(qp.zero_point.unsqueeze(-1))
        err = qf.mul_(s).sub_(wf)
        # per-row sums in float32 (K terms: ample precision), accumulated across rows in float64 below
        sig[i:i + step] = wf.square().sum(dim=(-1, -2))
        noise[i:i + step] = err.square_().sum(dim=(-1, -2))
        out[i:i + step] = pack_ints(q8, num_bits) if pack else q8
        scale[i:i + step] = qp.scale
        if zp is not None:
            zp[i:i + step] = qp.zero_point
    return out, scale, zp, sig, noise


_NATIVE = None  # the kernel module once imported, False when unavailable


def _native_module():
    global _NATIVE
    if _NATIVE is None:
        _NATIVE = False
        if os.environ.get("QUANTKIT_NATIVE", "1") != "0":
            try:
                from quantkit.quant import _rtn_native

                _NATIVE = _rtn_native
            except Exception:  # noqa: BLE001 - no numba, or it cannot compile/cache here: the torch path
                pass
    return _NATIVE


_POOL = None
_THREADS: int | None = None  # threads for the fused kernel; None: torch.get_num_threads()


@contextmanager
def native_threads(n: int | None):
    """Run the fused kernel on `n` threads inside the block (convert runs torch single-threaded)."""
    global _THREADS
    prev, _THREADS = _THREADS, n
    try:
        yield
    finally:
        _THREADS = prev


def _pool():
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max(1, (os.cpu_count() or 1)), thread_name_prefix="quantkit-rtn")
    return _POOL


def native_available() -> bool:
    """Whether `rtn(..., pack=True)` can use the fused kernel (numba importable, not disabled)."""
    return bool(_native_module())


def optional_native(module: str):
    """The compiled-kernel module quantkit.quant.<module> (numba), or None where native kernels are off or
    unavailable (native_available) or the module cannot compile or load here: its caller's torch path."""
    if not native_available():
        return None
    try:
        return importlib.import_module(f"quantkit.quant.{module}")
    except Exception:  # noqa: BLE001 - numba cannot compile/cache here
        return None


def run_rows(fn, src, consts: tuple, arrays: tuple, per_row: tuple[int, ...] = (), min_rows: int = 64) -> bool:
    """Run a row kernel `fn(src, *consts, *arrays)` over rows src [R, ...] and outputs `arrays` [R, ...],
    the rows split over the native thread count (rows are independent; the kernels release the GIL), at
    least `min_rows` rows per thread. `per_row`: the positions in `consts` that hold one value per row
    (split with the rows). False when the kernel failed (numba cannot compile here): the caller and the
    rest of the run use the torch path."""
    split = set(per_row)

    def part(a, b):
        return (src[a:b], *(c[a:b] if i in split else c for i, c in enumerate(consts)), *(x[a:b] for x in arrays))

    return _run_split(src.shape[0], lambda a, b: fn(*part(a, b)), min_rows)


def run_span(fn, n: int, args: tuple, min_items: int = 64) -> bool:
    """Run a kernel `fn(*args, lo, hi)` over the index range [0, n) split into one contiguous [lo, hi) per
    native thread (at least `min_items` each): for kernels that take whole arrays and a range of their own
    (contiguous arrays keep numba's unit-stride loops vectorized, where a sliced view would not). False as
    run_rows."""
    return _run_split(n, lambda a, b: fn(*args, a, b), min_items)


def _run_split(r: int, call, min_items: int) -> bool:
    n_threads = max(1, min(_THREADS or torch.get_num_threads(), r // max(1, min_items)))
    try:
        if n_threads == 1:
            call(0, r)
        else:
            bounds = [r * i // n_threads for i in range(n_threads + 1)]
            parts = list(zip(bounds, bounds[1:]))
            jobs = [_pool().submit(call, a, b) for a, b in parts[1:]]
            call(*parts[0])  # the calling thread takes a share too
            for j in jobs:
                j.result()
    except Exception as e:  # noqa: BLE001 - the kernel failed to compile here: use the torch path from now on
        global _NATIVE
        _NATIVE = False
        import warnings

        warnings.warn(f"fused RTN kernel unavailable ({type(e).__name__}: {str(e)[:200]}); using torch ops")
        return False
    return True


def _rtn_native(rows: torch.Tensor, g: int, symmetric: bool, scale_dtype: torch.dtype):
    """Fused kernel for rows [R, K] -> (packed int32 [R, W], scale [R, G], zp [R, G] | None, sig, noise),
    or None when the kernel does not apply (the caller then runs the torch path)."""
    mod = _native_module()
    if not mod or rows.device.type != "cpu" or rows.dtype not in (torch.bfloat16, torch.float32):
        return None
    mode = {torch.float32: mod.SCALE_F32, torch.bfloat16: mod.SCALE_BF16}.get(scale_dtype)
    if mode is None:
        return None
    rows = rows.contiguous()
    r, k = rows.shape
    n_groups = k // g
    out = torch.empty(r, (k + 7) // 8, dtype=torch.int32)
    scale = torch.empty(r, n_groups, dtype=torch.float32)
    zp = torch.empty(r, n_groups if not symmetric else 1, dtype=torch.int32)
    sig = torch.empty(r, dtype=torch.float64)
    noise = torch.empty(r, dtype=torch.float64)
    bad = torch.empty(r, dtype=torch.bool)
    fn, src = ((mod.rtn_pack_bf16, rows.view(torch.int16).numpy().view("uint16")) if rows.dtype == torch.bfloat16
               else (mod.rtn_pack_f32, rows.numpy()))
    arrays = (out.numpy().view("uint32"), scale.numpy(), zp.numpy(), sig.numpy(), noise.numpy(), bad.numpy())
    if not run_rows(fn, src, (g, symmetric, mode), arrays):
        return None
    if bool(bad.any()):
        return None  # NaN/Inf: the torch path defines what happens
    return out, scale, None if symmetric else zp, sig, noise


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., N, K] int, scale [..., N, G] -> w [..., N, K] in `dtype` (computed in float32)."""
    g = q.shape[-1] // scale.shape[-1]
    qg = q.reshape(*q.shape[:-1], scale.shape[-1], g).float()
    if zero_point is not None:
        qg = qg - zero_point.float().unsqueeze(-1)
    return (qg * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)



def sqnr_db(ref: torch.Tensor, approx: torch.Tensor, dim=None) -> torch.Tensor:
    """Signal-to-quantization-noise ratio, 20*log10(|x| / |x - y|), in dB (inf when equal)."""
    ref = ref.double()
    err = (ref - approx.double())
    if dim is None:
        num, den = ref.norm(), err.norm()
    else:
        num, den = ref.norm(dim=dim), err.norm(dim=dim)
    return 20 * torch.log10(num / den)
