"""FP4 (E2M1) weight quantization: compressed-tensors `nvfp4-pack-quantized` and `mxfp4-pack-quantized`.

This file is the math only: E2M1 rounding and codes, nibble packing, the scales of both formats, RTN over
a batch of weights, and a column quantizer for GPTQ. It does not read or write checkpoints, build config
groups or quantize activations (W4A4 `input_global_scale`); amax RTN has a fused kernel beside it
(quant/_fp4_native.py, bit-identical). Verbs as in quant/int4.py:
`choose_qparams_*` -> `quantize_*` -> `dequantize_*` (the packing is pack/fp4.py). Every function is
pure and batched over leading dims: a weight is [..., N, K] (all experts of a layer as [E, N, K]).

The judge is compressed-tensors 0.20.1 (tests/quant/test_fp4.py): its compressors must give the same bytes from
the same BF16/FP32 weight, and decompress ours to the same bits. What it does, and so what we do:

- E2M1 (`quantization/utils/fp4_utils.py: cast_to_fp4`): magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 at index
  0..7, code = sign << 3 | index. Ties go to the even index (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
  2.5 -> 2, 3.5 -> 4, 5 -> 4), beyond 6 saturates. A negative value that rounds to 0 keeps its sign
  (code 8, "-0"); a -0.0 input gives code 0 (torch.sign(-0.0) is +0).
- packing (`compressors/nvfp4/helpers.py: pack_fp4_to_uint8`): two codes per uint8, even column in the
  low nibble: `weight_packed` uint8 [N, K/2].
- NVFP4 (strategy tensor_group, group 16; `quantization/utils/helpers.py: generate_gparam`,
  `calculate_qparams`). Statistics are taken in the weight's own dtype (llm-compressor's observers do):
    global_scale = float32(nan_to_num(448 * 6 / max(amax, tiny), nan/inf -> 1.0))   [1], float32
      (the division runs in the weight's dtype: a BF16 weight gets a BF16-rounded global scale; an
      all-zero weight gets 1.0)
    scale = fp8_e4m3(clamp(global_scale * (amax_group / 6), -448, 448)), and 0 -> 0.125   [N, K/16]
      (amax_group / 6 is rounded to the weight's dtype first, the product is float32)
    q = e2m1(w.float() / (scale.float() / global_scale));  w ~= q * (scale.float() / global_scale)
- MXFP4 (strategy group, group 32, `quantization/utils/mxfp_utils.py: generate_mx_scales`):
    scale = uint8 E8M0 = clamp(127 + log2(p) - 2, 0, 255) with p = amax_group rounded to a power of two:
      down (floor of log2) unless amax's mantissa is >= 1.75, then up. So amax in [1.5, 1.75) * 2^k
      saturates to 6 * 2^(k-2) (up to 1/7 relative error on the largest values); amax = 0 gives 0.
    q = e2m1(w / 2^(scale - 127)) (exact: a power-of-two division);  w ~= q * 2^(scale - 127)
- dequantization (the compressors' `decompress`): float32 product, rounded once to the output dtype
  (compressed-tensors returns BF16).

Fitted scales (`scale_search="mse"`, quantkit's own; compressed-tensors has no such FP4 observer): per
group, the scale is the candidate that minimizes the squared error of the group's float32 dequantization
against the weight, candidates being the amax scale first and its neighbours on the scale grid (NVFP4:
`NV_SEARCH` fp8 e4m3 codes around it, the global scale fixed from amax as above, so a gate/up pair still
shares it; MXFP4: `MX_SEARCH` exponents around it). The amax scale is tried first and kept on ties, so no
group's error exceeds its amax error. Only the scales differ: codes and packing are the same functions,
and compressed-tensors decompresses the result like any other.

FP16 sources are widened to float32 before any statistic: in FP16, 2688 / amax overflows for
amax < 0.041, which compressed-tensors turns into global_scale = 1.0 (nearly every layer); for FP16
only, our scales therefore differ from what compressed-tensors computes from FP16 statistics. NaN/Inf
weights have no defined encoding: `FP4Result.finite` reports them for the caller to refuse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import GroupSizeError
from .bits import E2M1_VALUES, E8M0_BIAS, pack_fp4, unpack_fp4  # noqa: F401  (the RTN functions pack)
from .fp8 import FP8_MAX  # float8_e4m3fn max: NVFP4 group scales are e4m3
from .int4 import optional_native, run_rows

# Legend: N = out_features, K = in_features, G = groups = K / group_size, g = group_size, R = rows

FP4_MAX = 6.0  # largest E2M1 magnitude
NVFP4_GROUP_SIZE = 16
MXFP4_GROUP_SIZE = 32
_MX_EMAX = 2  # floor(log2(FP4_MAX)): what MXFP4 takes off the group's exponent
_ZERO_GROUP_SCALE = 0.125  # compressed-tensors' replacement for a zero fp8 scale (its "eps" of e4m3)

# rounding thresholds between consecutive magnitudes, and whether a tie there goes up (to the even index)
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

# Rows per chunk in the RTN functions: ~2 MiB of float32 temporaries per step (as int4.rtn)
CHUNK_ELEMENTS = 1 << 19
SCALE_SEARCHES = ("amax", "mse")
# Fitted scales: the candidates tried around the amax scale, as offsets on the scale grid, amax (0) first.
# NVFP4: fp8 e4m3 codes (8 a binade: -8 halves the scale, clipping the group's largest values);
# MXFP4: E8M0 exponents (powers of two).
# Measured on random INT4 grids and Gaussian weights (bench/fp4_fit.py) with -2..+8: NVFP4 picks -2..+6
# (+6: the group's largest value lands on E2M1 4 instead of 6; +7 chosen once in 65536 groups, -3 never
# when tried); MXFP4 picks -1..0.
NV_SEARCH = (0, -1, -2, 1, 2, 3, 4, 5, 6)
MX_SEARCH = (0, -1, 1)


# --- E2M1 codes and packing -------------------------------------------------------------------------
def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x [...] float (already divided by its scale) -> uint8 codes [...] in 0..15: round to the nearest
    E2M1 value, ties to the even index, saturating at +-6; sign bit set for x < 0 (also when it rounds
    to 0)."""
    a = x.abs()
    idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, tie_up in _E2M1_BOUNDS:  # count the thresholds passed: index 0..7
        idx += (a >= bound) if tie_up else (a > bound)
    return idx | ((x < 0).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [...] -> float32 E2M1 values [...] (code 8 -> -0.0)."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x [...] -> float32 [...] on the E2M1 grid (fake quantization with scale 1)."""
    return decode_e2m1(encode_e2m1(x))


# --- shared helpers ---------------------------------------------------------------------------------
def _check_group(k: int, group_size: int, fmt: str) -> int:
    if k % group_size:
        raise GroupSizeError(f"{fmt} needs in_features divisible by its group size {group_size}, got {k} "
                             f"({k % group_size} columns left over); {fmt} has no partial groups")
    return k // group_size


def _stat_dtype(w: torch.Tensor) -> torch.dtype:
    """The dtype statistics are computed in: the weight's own (as compressed-tensors does) for BF16 and
    FP32; FP16 and anything else is widened to float32 (see the module docstring)."""
    if not w.is_floating_point():
        raise TypeError(f"FP4 quantization needs a floating-point weight, got {w.dtype}")
    return w.dtype if w.dtype in (torch.bfloat16, torch.float32) else torch.float32


def _group_amax(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [..., N, K] -> max |w| per group [..., N, G], in the statistics dtype."""
    wg = w.to(_stat_dtype(w)).unflatten(-1, (-1, group_size))  # [..., N, G, g]
    return torch.maximum(-wg.amin(-1), wg.amax(-1)).clamp_(min=0)


def quantize_fp4(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [..., N, K] / per-group float32 scale [..., N, G] -> codes uint8 [..., N, K]:
    e2m1(w.float() / scale). The scale is the effective one (`effective_scale_*`)."""
    g = w.shape[-1] // scale.shape[-1]
    x = w.float().unflatten(-1, (-1, g)) / scale.unsqueeze(-1)  # [..., N, G, g]
    return encode_e2m1(x).flatten(-2)


def dequantize_fp4(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """codes [..., N, K] uint8, effective float32 scale [..., N, G] -> w [..., N, K] in `dtype`: the
    float32 product e2m1 * scale, rounded once to `dtype`."""
    g = codes.shape[-1] // scale.shape[-1]
    v = decode_e2m1(codes).unflatten(-1, (-1, g)) * scale.float().unsqueeze(-1)  # [..., N, G, g]
    return v.flatten(-2).to(dtype)


# --- NVFP4 ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NVFP4QParams:
    scale: torch.Tensor  # [..., N, G] float8_e4m3fn, G = K / 16: `weight_scale`
    global_scale: torch.Tensor  # [..., 1] float32: `weight_global_scale`

    def effective(self) -> torch.Tensor:
        return effective_scale_nvfp4(self.scale, self.global_scale)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax [...] (>= 0, in the statistics dtype) -> float32 [..., 1] = 448 * 6 / amax, computed in
    amax's dtype; zero amax is clamped to the dtype's tiny, and a NaN/inf result becomes 1.0."""
    gs = (FP8_MAX * FP4_MAX) / amax.clamp(min=torch.finfo(amax.dtype).tiny)
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).float().unsqueeze(-1)


def choose_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """One NVFP4 global scale per matrix from the amax over all `weights` (each [..., N_i, K_i], the same
    leading dims): float32 [..., 1]. Pass gate and up of each expert to give the pair one global scale,
    as vLLM needs when it fuses them into w13 (an on-disk fused gate_up [E, 2I, H] is one weight)."""
    if not weights:
        raise ValueError("choose_global_scale needs at least one weight")
    amax = None
    for w in weights:
        m = _matrix_amax(w)  # [...]
        amax = m if amax is None else torch.maximum(amax, m)
    return global_scale_from_amax(amax)


_BITS = {torch.bfloat16: (torch.int16, 0x7F80, "absmax_bits16"),  # (bit-pattern dtype, Inf's pattern, kernel)
         torch.float32: (torch.int32, 0x7F800000, "absmax_bits32")}


def _matrix_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| over each matrix of w [..., N, K] -> [...] in the statistics dtype. The fused path (a
    contiguous bf16 / float32 CPU tensor, native kernels on) takes the max of the magnitudes' bit
    patterns in one pass, which is max |w| exactly; a NaN anywhere sends it to torch's amin / amax."""
    global _NATIVE
    wc = w.to(_stat_dtype(w))
    mod = _native_module()
    spec = _BITS.get(wc.dtype)
    if mod and spec and wc.device.type == "cpu" and wc.is_contiguous() and wc.numel() and wc.ndim >= 2:
        ibits, inf_bits, fn = spec
        bits = wc.view(ibits).reshape(-1, wc.shape[-2] * wc.shape[-1]).numpy()
        out = torch.empty(bits.shape[0], dtype=ibits)
        unsigned = out.numpy().view(bits.dtype.str.replace("i", "u"))
        if not run_rows(getattr(mod, fn), bits.view(unsigned.dtype), (), (unsigned,)):
            _NATIVE = False  # the kernel failed (run_rows warned): torch from now on, as _rtn_native
        elif int(unsigned.max()) <= inf_bits:
            return out.view(wc.dtype).reshape(wc.shape[:-2])
    return torch.maximum(-wc.amin(dim=(-2, -1)), wc.amax(dim=(-2, -1))).clamp_(min=0)


def _nvfp4_scale(amax_g: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """amax per group [..., N, G] (statistics dtype), global scale [..., 1] -> float8_e4m3fn [..., N, G]."""
    local = amax_g / FP4_MAX  # rounded to the statistics dtype, as compressed-tensors does
    s = global_scale.float().unsqueeze(-1) * local.float()  # [..., N, G] float32
    s = s.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    s = torch.where(s == 0, torch.full_like(s, _ZERO_GROUP_SCALE), s)  # never divide by zero
    return s.to(torch.float8_e4m3fn)


def choose_qparams_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> NVFP4QParams:
    """w [..., N, K] -> NVFP4 scales. `global_scale` ([..., 1] float32, e.g. `choose_global_scale(gate,
    up)`) replaces the one derived from w alone."""
    *lead, n, k = w.shape
    _check_group(k, NVFP4_GROUP_SIZE, "NVFP4")
    gs = choose_global_scale(w) if global_scale is None else _as_global(global_scale, lead)
    return NVFP4QParams(_nvfp4_scale(_group_amax(w, NVFP4_GROUP_SIZE), gs), gs)


def _as_global(global_scale: torch.Tensor, lead: list[int]) -> torch.Tensor:
    if global_scale.dtype != torch.float32:
        raise TypeError(f"an NVFP4 global scale is float32, got {global_scale.dtype}")
    return global_scale.expand(*lead, 1)


def effective_scale_nvfp4(scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp8 scale [..., N, G], float32 global scale [..., 1] -> float32 [..., N, G] = scale / global_scale
    (the one float32 division both directions of compressed-tensors use)."""
    return scale.float() / global_scale.unsqueeze(-1)


def quantize_nvfp4(w: torch.Tensor, qp: NVFP4QParams) -> torch.Tensor:
    """w [..., N, K] -> codes uint8 [..., N, K]."""
    return quantize_fp4(w, qp.effective())


def dequantize_nvfp4(codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """codes [..., N, K], fp8 scale [..., N, G], global scale [..., 1] -> w [..., N, K] in `dtype`."""
    return dequantize_fp4(codes, effective_scale_nvfp4(scale, global_scale), dtype)


# --- MXFP4 ------------------------------------------------------------------------------------------
def _mx_exponent(amax_g: torch.Tensor) -> torch.Tensor:
    """amax per group [...] -> E8M0 uint8 [...]. compressed-tensors rounds amax to a power of two by
    adding a quarter of the leading binade to the float bits and masking the mantissa away (mantissa
    >= 1.75 rounds up), then takes the E2M1 max exponent (2) off. In float32 bits that is exponent
    field - 2, clamped to [0, 255]; BF16 amax widened to float32 rounds identically."""
    bits = amax_g.float().view(torch.int32).to(torch.int64)
    field = ((bits + (1 << 21)) >> 23) & 0xFF  # biased exponent of the rounded amax; 0 for amax = 0
    e = torch.where(field == 0xFF, torch.full_like(field, 255), (field - _MX_EMAX).clamp_(0, 254))
    return e.to(torch.uint8)


def choose_qparams_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """w [..., N, K] -> E8M0 scale uint8 [..., N, G], G = K / 32: `weight_scale`."""
    _check_group(w.shape[-1], MXFP4_GROUP_SIZE, "MXFP4")
    return _mx_exponent(_group_amax(w, MXFP4_GROUP_SIZE))


def effective_scale_mxfp4(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 uint8 [..., N, G] -> float32 2^(scale - 127), built from its bits (exact, 2^-127 included)."""
    e = scale.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)  # e = 0: the subnormal 2^-127
    return bits.view(torch.float32)


def quantize_mxfp4(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [..., N, K], E8M0 scale [..., N, G] -> codes uint8 [..., N, K]. The division runs in the
    statistics dtype, as compressed-tensors runs it (for BF16 this decides the sign of values that
    underflow to zero)."""
    dt = _stat_dtype(w)
    s = effective_scale_mxfp4(scale).to(dt).unsqueeze(-1)  # [..., N, G, 1], exact in bf16 too
    x = w.to(dt).unflatten(-1, (-1, MXFP4_GROUP_SIZE)) / s  # [..., N, G, g]
    return encode_e2m1(x.float()).flatten(-2)


def dequantize_mxfp4(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """codes [..., N, K], E8M0 scale [..., N, G] -> w [..., N, K] in `dtype`."""
    return dequantize_fp4(codes, effective_scale_mxfp4(scale), dtype)


# --- GPTQ -------------------------------------------------------------------------------------------
def quantize_column(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None):
    """Quantize-dequantize columns onto the FP4 grid with fixed group scales, for GPTQ's sweep:
    w [..., N] (one column) or [..., N, B] (a block within one group), float32 effective scale of the
    column's group broadcastable to w ([..., N] or [..., N, 1]; `effective_scale_nvfp4/_mxfp4`) ->
    (codes uint8 like w, dequantized float32 like w). FP4 is symmetric: `zero_point` must be None."""
    if zero_point is not None:
        raise ValueError("FP4 is symmetric: no zero point")
    codes = encode_e2m1(w.float() / scale)
    return codes, decode_e2m1(codes) * scale


# --- fitted scales ----------------------------------------------------------------------------------
def round_e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """a [...] float32 >= 0 -> the E2M1 magnitude encode_e2m1 rounds it to, in arithmetic: steps of 0.5
    below 2, 1 below 4, 2 above, each rounded half to even (which is ties to the even index), saturating
    at 6. Equal to round_to_e2m1(a) for every a >= 0 (tests/quant/test_fp4_fit.py), ~4x fewer passes."""
    step = (a >= 2).to(torch.float32).add_(1).mul_((a >= 4).to(torch.float32).add_(1)).mul_(0.5)  # .5, 1, 2
    return torch.round(a / step).mul_(step).clamp_(max=FP4_MAX)


def _candidate_errors(wg: torch.Tensor, eff: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """wg [R, G, g] float32, candidate effective scales [R, G, C] -> squared error [R, G, C] of each
    candidate's float32 dequantization (the same arithmetic as quantize_fp4 / dequantize_fp4: the sign
    plays no part in the error, so magnitudes are rounded). `weight` [R, G, g] (or broadcastable): each
    element's squared error weighted by it (GPTQ's Hessian diagonal)."""
    a = wg.abs().unsqueeze(-2)  # [R, G, 1, g]
    e = eff.unsqueeze(-1)  # [R, G, C, 1]
    err = round_e2m1_magnitude(a / e).mul_(e).sub_(a).square_()
    return (err if weight is None else err.mul_(weight.unsqueeze(-2))).sum(-1)


def search_scales_nvfp4(w: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                        weight: torch.Tensor | None = None):
    """Rows w [R, K], their amax fp8 scales [R, G] and float32 global scales [R] (one per row's matrix)
    -> (fitted fp8 scales [R, G], squared error [R] with them, squared error [R] with the amax scales).
    `weight` [R, K] or [K]: the squared errors weighted per input column."""
    wg = w.float().unflatten(-1, (-1, NVFP4_GROUP_SIZE))  # [R, G, 16]
    wt = None if weight is None else weight.float().unflatten(-1, (-1, NVFP4_GROUP_SIZE))
    code = scale.view(torch.uint8).to(torch.int16)  # positive e4m3: codes are ordered like their values
    offs = torch.tensor(NV_SEARCH, dtype=torch.int16)
    cand = (code.unsqueeze(-1) + offs).clamp_(1, 0x7E)  # [R, G, C]: never 0 (no scale) nor 0x7F (NaN)
    fp8 = cand.to(torch.uint8).view(torch.float8_e4m3fn)
    err = _candidate_errors(wg, fp8.float() / global_scale.reshape(-1, 1, 1), wt)
    best = err.argmin(-1, keepdim=True)  # the first minimum: the amax scale on ties
    chosen = cand.gather(-1, best).squeeze(-1).to(torch.uint8).view(torch.float8_e4m3fn)
    return chosen, err.gather(-1, best).squeeze(-1).sum(-1).double(), err[..., 0].sum(-1).double()


def search_scales_mxfp4(w: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor | None = None):
    """Rows w [R, K] and their amax E8M0 scales [R, G] -> (fitted E8M0 scales [R, G], squared error [R]
    with them, squared error [R] with the amax scales). `weight` [R, K] or [K]: as search_scales_nvfp4's."""
    wg = w.float().unflatten(-1, (-1, MXFP4_GROUP_SIZE))  # [R, G, 32]
    wt = None if weight is None else weight.float().unflatten(-1, (-1, MXFP4_GROUP_SIZE))
    e = scale.to(torch.int16).unsqueeze(-1) + torch.tensor(MX_SEARCH, dtype=torch.int16)
    e = torch.where(scale.unsqueeze(-1) == 0, torch.zeros_like(e), e.clamp_(0, 254)).to(torch.uint8)  # [R, G, C]
    err = _candidate_errors(wg, effective_scale_mxfp4(e), wt)
    best = err.argmin(-1, keepdim=True)
    return e.gather(-1, best).squeeze(-1), err.gather(-1, best).squeeze(-1).sum(-1).double(), \
        err[..., 0].sum(-1).double()


def fit_scales(w: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None = None,
               weight: torch.Tensor | None = None) -> torch.Tensor:
    """Fitted group scales of whole matrices: w [..., N, K] with its amax scales [..., N, G] (NVFP4: fp8
    e4m3 with `global_scale` [..., 1]; MXFP4: E8M0 uint8, global_scale None) -> the scales search_scales_*
    picks for every row, each group's squared error weighted per input column by `weight` [..., K] (GPTQ's
    Hessian diagonal; None: unweighted). Row chunks of CHUNK_ELEMENTS / candidates, matrix by matrix."""
    *lead, n, k = w.shape
    nv = global_scale is not None
    m = math.prod(lead)
    ws, sc = w.reshape(m, n, k), scale.reshape(m, n, -1)
    gs = global_scale.reshape(m) if nv else None
    wt = None if weight is None else weight.reshape(m, k)
    out = torch.empty_like(sc)
    step = max(1, CHUNK_ELEMENTS // max(k, 1) // len(NV_SEARCH if nv else MX_SEARCH))
    for j in range(m):
        for i in range(0, n, step):
            wc, s = ws[j, i:i + step], sc[j, i:i + step]
            wj = None if wt is None else wt[j]
            if nv:
                out[j, i:i + step] = search_scales_nvfp4(wc, s, gs[j].expand(wc.shape[0]), wj)[0]
            else:
                out[j, i:i + step] = search_scales_mxfp4(wc, s, wj)[0]
    return out.reshape(scale.shape)


# --- RTN over a batch ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FP4Result:
    packed: torch.Tensor  # [..., N, K/2] uint8: `weight_packed`
    scale: torch.Tensor  # [..., N, G] float8_e4m3fn (NVFP4) or uint8 E8M0 (MXFP4): `weight_scale`
    global_scale: torch.Tensor | None  # [..., 1] float32 (NVFP4 `weight_global_scale`), None for MXFP4
    finite: torch.Tensor  # [...] bool: the matrix held no NaN/Inf (their encoding is undefined)
    signal: torch.Tensor  # [...] float64: sum of w^2 per matrix
    noise: torch.Tensor  # [...] float64: sum of (w - float32 dequantization)^2 per matrix
    noise_amax: torch.Tensor | None = None  # [...] float64: the noise amax scales give (fitted scales only)

    def sqnr_db(self) -> torch.Tensor:
        return 10 * torch.log10(self.signal / self.noise)

    def sqnr_amax_db(self) -> torch.Tensor | None:
        return None if self.noise_amax is None else 10 * torch.log10(self.signal / self.noise_amax)


_NATIVE = None  # quant/_fp4_native.py once imported, False when unavailable


def _native_module():
    global _NATIVE
    if _NATIVE is None:  # numba importable and QUANTKIT_NATIVE not 0, as for INT4
        _NATIVE = optional_native("_fp4_native") or False
    return _NATIVE


def _rtn_native(rows: torch.Tensor, nv: bool, gs_rows: torch.Tensor | None, fit: bool = False):
    """The fused kernel (quant/_fp4_native.py) over rows [R, K] -> (packed [R, K/2], scale [R, G],
    sum w^2 [R], sum err^2 [R], sum err^2 with amax scales [R] | None), or None when it does not apply
    (not bf16/float32 on CPU, a global scale that is not finite and positive, NaN/Inf weights): the
    torch path then runs. With `fit` (fitted scales) the rows whose choice the kernel cannot prove equal
    to torch's (near ties, see _fp4_native._pick) are recomputed by the torch path."""
    mod = _native_module()
    if not mod or rows.device.type != "cpu" or rows.dtype not in (torch.bfloat16, torch.float32):
        return None
    r, k = rows.shape
    if nv:
        gs_rows = gs_rows.float().contiguous()
        if not bool((torch.isfinite(gs_rows) & (gs_rows > 0)).all()):
            return None
    else:
        gs_rows = torch.ones(r, dtype=torch.float32)  # unused by MXFP4
    rows = rows.contiguous()
    offs = torch.tensor((NV_SEARCH if nv else MX_SEARCH) if fit else (), dtype=torch.int64)
    packed = torch.empty(r, k // 2, dtype=torch.uint8)
    scale = torch.empty(r, k // (NVFP4_GROUP_SIZE if nv else MXFP4_GROUP_SIZE), dtype=torch.uint8)
    sig, noise, noise0 = (torch.empty(r, dtype=torch.float64) for _ in range(3))
    unsure = torch.empty(r, dtype=torch.bool)
    bad = torch.empty(r, dtype=torch.bool)
    fn, src = ((mod.fp4_pack_bf16, rows.view(torch.int16).numpy().view("uint16")) if rows.dtype == torch.bfloat16
               else (mod.fp4_pack_f32, rows.numpy()))
    arrays = tuple(t.numpy() for t in (packed, scale, sig, noise, noise0, unsure, bad))
    if not run_rows(fn, src, (nv, gs_rows.numpy(), offs.numpy()), arrays, per_row=(1,)):
        global _NATIVE
        _NATIVE = False
        return None
    if bool(bad.any()):
        return None  # NaN/Inf: the torch path defines what happens
    if fit and bool(unsure.any()):
        idx = unsure.nonzero().squeeze(-1)
        sub = rows[idx].unsqueeze(1)  # [U, 1, K]: each row its own matrix, with its own global scale
        ref = (_rtn(sub, "NVFP4", gs_rows[idx].unsqueeze(-1), "mse", native=False) if nv
               else _rtn(sub, "MXFP4", None, "mse", native=False))
        packed[idx] = ref.packed.squeeze(1)
        scale[idx] = ref.scale.squeeze(1).view(torch.uint8)
        sig[idx], noise[idx], noise0[idx] = ref.signal.double(), ref.noise.double(), ref.noise_amax.double()
    return packed, scale.view(torch.float8_e4m3fn) if nv else scale, sig, noise, noise0 if fit else None


def _rtn(w: torch.Tensor, fmt: str, global_scale: torch.Tensor | None, scale_search: str = "amax",
         native: bool = True) -> FP4Result:
    """Rows are independent once the global scale is fixed, so the batch is flattened to rows [R, K] and
    processed in cache-sized chunks (float32 temporaries stay small whatever the batch; a fitted-scale
    search holds one error per candidate, so its chunks are that much smaller). With amax scales the
    fused kernel (quant/_fp4_native.py) runs when it can; native=False forces this torch path, the
    definition it is tested against."""
    if scale_search not in SCALE_SEARCHES:
        raise ValueError(f"scale_search must be one of {SCALE_SEARCHES}, got {scale_search!r}")
    fit = scale_search == "mse"
    *lead, n, k = w.shape
    nv = fmt == "NVFP4"
    groups = _check_group(k, NVFP4_GROUP_SIZE if nv else MXFP4_GROUP_SIZE, fmt)
    rows = w.reshape(-1, k)
    r = rows.shape[0]
    gs = gs_rows = None
    if nv:
        gs = choose_global_scale(w) if global_scale is None else _as_global(global_scale, lead)
        gs_rows = gs.expand(*lead, n).reshape(r)  # [R]: row r's matrix's global scale
    lead_n = (*lead, n)
    res = _rtn_native(rows, nv, gs_rows, fit) if native else None
    if res is not None:
        packed, scale, sig, noise, noise0 = res
        return FP4Result(packed.reshape(*lead_n, k // 2), scale.reshape(*lead_n, groups), gs,
                         torch.ones(lead, dtype=torch.bool), sig.reshape(lead_n).sum(-1),
                         noise.reshape(lead_n).sum(-1), None if noise0 is None else noise0.reshape(lead_n).sum(-1))
    packed = torch.empty(r, k // 2, dtype=torch.uint8)
    scale = torch.empty(r, groups, dtype=torch.float8_e4m3fn if nv else torch.uint8)
    finite = torch.empty(r, dtype=torch.bool)
    sig = torch.empty(r, dtype=torch.float64)
    noise = torch.empty(r, dtype=torch.float64)
    noise_amax = torch.empty(r, dtype=torch.float64) if fit else None
    step = max(1, CHUNK_ELEMENTS // max(k, 1) // (len(NV_SEARCH if nv else MX_SEARCH) if fit else 1))
    for i in range(0, r, step):
        wc = rows[i:i + step]  # [r, K]
        if nv:
            s = _nvfp4_scale(_group_amax(wc, NVFP4_GROUP_SIZE), gs_rows[i:i + step])
            if fit:
                s, _, noise_amax[i:i + step] = search_scales_nvfp4(wc, s, gs_rows[i:i + step])
            eff = effective_scale_nvfp4(s, gs_rows[i:i + step])
            codes = quantize_fp4(wc, eff)
        else:
            s = _mx_exponent(_group_amax(wc, MXFP4_GROUP_SIZE))
            if fit:
                s, _, noise_amax[i:i + step] = search_scales_mxfp4(wc, s)
            eff = effective_scale_mxfp4(s)
            codes = quantize_mxfp4(wc, s)
        wf = wc.float()
        err = dequantize_fp4(codes, eff, torch.float32).sub_(wf)
        packed[i:i + step] = pack_fp4(codes)
        scale[i:i + step] = s
        finite[i:i + step] = torch.isfinite(wf).all(-1)
        sig[i:i + step] = wf.square().sum(-1)  # per row in float32, summed per matrix in float64
        noise[i:i + step] = err.square_().sum(-1)
    return FP4Result(packed.reshape(*lead_n, k // 2), scale.reshape(*lead_n, groups), gs,
                     finite.reshape(lead_n).all(-1), sig.reshape(lead_n).sum(-1), noise.reshape(lead_n).sum(-1),
                     None if noise_amax is None else noise_amax.reshape(lead_n).sum(-1))


def rtn_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None, scale_search: str = "amax",
              native: bool = True) -> FP4Result:
    """Round-to-nearest NVFP4 of a batch [..., N, K] (K % 16 == 0), packed. `global_scale` [..., 1]
    float32 shares one global scale across several weights (`choose_global_scale(gate, up)`).
    `scale_search` "mse": fitted group scales (module docstring; torch path only). `native` False: never
    the fused kernel (bit-identical either way)."""
    return _rtn(w, "NVFP4", global_scale, scale_search, native)


def rtn_mxfp4(w: torch.Tensor, scale_search: str = "amax", native: bool = True) -> FP4Result:
    """Round-to-nearest MXFP4 of a batch [..., N, K] (K % 32 == 0), packed. `scale_search` and `native`
    as rtn_nvfp4."""
    return _rtn(w, "MXFP4", None, scale_search, native)
