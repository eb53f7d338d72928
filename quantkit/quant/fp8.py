"""FP8 (float8_e4m3fn) weight quantization: per-tensor, per-channel and block (e.g. 128x128) scales.

One convention serves both directions (docs/format.md):
- compressed-tensors `float-quantized` (what convert writes): `weight` float8_e4m3fn [N, K] + `weight_scale`
  float32, scale = amax / 448 (448 = e4m3fn max), q = fp8(clamp(w / scale, -448, 448)), w ~= q * scale.
- DeepSeek-V3 / Kimi-K2 / GLM block-FP8 releases (what convert reads): `weight` float8_e4m3fn +
  `weight_scale_inv` float32; despite the name, w ~= q * scale_inv, one scale per 128x128 block.
Edge blocks are partial (N or K not a multiple of the block): the last block row/column simply has
fewer elements; nothing is padded on disk.

Verbs follow torchao (as quant/int4.py): `choose_scale` -> `quantize` -> `dequantize`. Every function
is pure and takes a batch [..., N, K] (a leading expert/batch dim is allowed). Work is done in row
strips so that a float32 temporary never exceeds ~`STRIP_ELEMENTS` per strip, whatever the weight size
(a 18432 x 7168 dense MLP weight would otherwise need >1 GB of float32 temporaries).

The arithmetic matches compressed-tensors' `quantize`/`dequantize` exactly (x / scale, clamp, cast;
q.to(float32) * scale), so its decompressor reproduces our dequantization bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Legend: N = out_features, K = in_features, b0 x b1 = block, R = rows of one strip

FP8_DTYPE = torch.float8_e4m3fn
# torch.finfo(torch.float8_e4m3fn).max, the one definition (pack/, calib/, runtime/ import it); fnuz (AMD) is 240
FP8_MAX = 448.0
STRIP_ELEMENTS = 1 << 21  # float32 elements per strip (8 MiB)


@dataclass(frozen=True)
class FP8Layout:
    """Where the scales of an FP8 weight live: `strategy` tensor | channel | block (with `block`)."""

    strategy: str
    block: tuple[int, int] | None = None

    def __post_init__(self):
        if self.strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"FP8 strategy must be tensor, channel or block, got {self.strategy!r}")
        if (self.strategy == "block") != (self.block is not None):
            raise ValueError("a block layout needs `block`, and only a block layout has one")

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        """Shape of the scale of one [N, K] weight: [1], [N, 1] or [ceil(N/b0), ceil(K/b1)]."""
        if self.strategy == "tensor":
            return (1,)
        if self.strategy == "channel":
            return (n, 1)
        b0, b1 = self.block
        return (-(-n // b0), -(-k // b1))


def _strips(n: int, k: int, row_multiple: int) -> range:
    """Row strip starts: strips hold a multiple of `row_multiple` rows and ~STRIP_ELEMENTS elements."""
    rows = max(row_multiple, (STRIP_ELEMENTS // max(k, 1)) // row_multiple * row_multiple)
    return range(0, n, rows), rows


def _col_blocks(x: torch.Tensor, b1: int):
    """Split [..., R, K] along K into a [..., R, K//b1, b1] view of the full blocks and the [..., R, K%b1]
    tail (the partial edge block), without copying."""
    k = x.shape[-1]
    k_full = k // b1 * b1
    main = x[..., :k_full].unflatten(-1, (k // b1, b1))
    tail = x[..., k_full:] if k_full < k else None
    return main, tail


def _block_rows(scale: torch.Tensor, r0: int, r1: int, b0: int) -> torch.Tensor:
    """Per-row scales [..., r1 - r0, nbK] for rows r0:r1 of a block scale [..., nbN, nbK]."""
    rows = torch.arange(r0, r1, device=scale.device) // b0
    return scale[..., rows, :]


def _amax(w: torch.Tensor, layout: FP8Layout) -> torch.Tensor:
    """max |w| per scale element: [..., 1], [..., N, 1] or [..., nbN, nbK] (float32)."""
    *lead, n, k = w.shape
    if layout.strategy == "tensor":
        starts, rows = _strips(n, k, 1)
        parts = [w[..., r:r + rows, :].float().abs().amax(dim=(-1, -2)) for r in starts]
        return torch.stack(parts, -1).amax(-1, keepdim=True) if parts else torch.zeros(*lead, 1)
    if layout.strategy == "channel":
        starts, rows = _strips(n, k, 1)
        out = torch.empty(*lead, n, 1, dtype=torch.float32)
        for r in starts:
            out[..., r:r + rows, :] = w[..., r:r + rows, :].float().abs().amax(-1, keepdim=True)
        return out
    b0, b1 = layout.block
    nbn, nbk = layout.scale_shape(n, k)
    out = torch.empty(*lead, nbn, nbk, dtype=torch.float32)
    starts, rows = _strips(n, k, b0)
    for r in starts:
        a = w[..., r:r + rows, :].float().abs_()  # [..., R, K]
        main, tail = _col_blocks(a, b1)
        per_row = main.amax(-1)  # [..., R, K//b1]
        if tail is not None:
            per_row = torch.cat([per_row, tail.amax(-1, keepdim=True)], -1)  # [..., R, nbK]
        r_len = per_row.shape[-2]
        full = r_len // b0 * b0
        blocks = [per_row[..., :full, :].unflatten(-2, (full // b0, b0)).amax(-2)] if full else []
        if full < r_len:  # the partial last block row
            blocks.append(per_row[..., full:, :].amax(-2, keepdim=True))
        out[..., r // b0:r // b0 + -(-r_len // b0), :] = torch.cat(blocks, -2)
    return out


def choose_scale(w: torch.Tensor, layout: FP8Layout, power_of_two: bool = False) -> torch.Tensor:
    """scale = amax / 448 in float32 per tensor/row/block; an all-zero one gets 1.0 (any scale works).
    `power_of_two`: rounded up to the next power of two (the `ue8m0` scale format; nothing clips)."""
    scale = _amax(w, layout) / FP8_MAX
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _apply(x: torch.Tensor, scale: torch.Tensor, layout: FP8Layout, op, out: torch.Tensor) -> torch.Tensor:
    """out[..., N, K] = op(x.float(), scale broadcast to x), strip by strip."""
    *lead, n, k = x.shape
    row_multiple = layout.block[0] if layout.strategy == "block" else 1
    starts, rows = _strips(n, k, row_multiple)
    for r in starts:
        xs = x[..., r:r + rows, :].float()  # [..., R, K]
        if layout.strategy == "tensor":
            res = op(xs, scale.unsqueeze(-1))  # scale [..., 1] -> [..., 1, 1]
        elif layout.strategy == "channel":
            res = op(xs, scale[..., r:r + rows, :])  # [..., R, 1]
        else:
            b0, b1 = layout.block
            s = _block_rows(scale, r, min(r + rows, n), b0)  # [..., R, nbK]
            main, tail = _col_blocks(xs, b1)
            res = op(main, s[..., :main.shape[-2]].unsqueeze(-1)).flatten(-2)
            if tail is not None:
                res = torch.cat([res, op(tail, s[..., -1:])], -1)
        out[..., r:r + rows, :] = res
    return out


def quantize(w: torch.Tensor, scale: torch.Tensor, layout: FP8Layout) -> torch.Tensor:
    """w [..., N, K] (any float dtype) -> float8_e4m3fn [..., N, K]: fp8(clamp(w / scale, -448, 448))."""
    out = torch.empty(w.shape, dtype=FP8_DTYPE)
    return _apply(w, scale, layout, lambda x, s: (x / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), out)


def dequantize(q: torch.Tensor, scale: torch.Tensor, layout: FP8Layout, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """q [..., N, K] fp8 -> w [..., N, K] in `dtype`: q.float() * scale, rounded once to `dtype`.
    `out` (shape of q, `dtype`) receives the result in place, e.g. one slot of a batch."""
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    return _apply(q, scale.float(), layout, lambda x, s: (x * s).to(dtype), out)


@dataclass(frozen=True)
class FP8Result:
    q: torch.Tensor  # [..., N, K] float8_e4m3fn
    scale: torch.Tensor  # [..., *layout.scale_shape(N, K)] float32
    finite: torch.Tensor  # [...] bool: the matrix held no NaN/Inf (a NaN block would otherwise get scale 1)
    signal: torch.Tensor  # [...] float64: sum of w^2 per matrix
    noise: torch.Tensor  # [...] float64: sum of (w - dequantize(q))^2 per matrix

    def sqnr_db(self) -> torch.Tensor:
        return 10 * torch.log10(self.signal / self.noise)


def quantize_fp8(w: torch.Tensor, layout: FP8Layout) -> FP8Result:
    """choose_scale + quantize for a batch [..., N, K], with the per-matrix error energy (for SQNR)."""
    *lead, n, k = w.shape
    amax = _amax(w, layout)
    finite = torch.isfinite(amax).reshape(*lead, -1).all(-1)
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = quantize(w, scale, layout)
    sig = torch.zeros(lead, dtype=torch.float64)
    noise = torch.zeros(lead, dtype=torch.float64)
    starts, rows = _strips(n, k, layout.block[0] if layout.block else 1)
    for r in starts:
        sl = slice(r, r + rows)
        ref = w[..., sl, :].float()
        if layout.strategy == "tensor":
            s = scale
        elif layout.strategy == "channel":
            s = scale[..., sl, :]
        else:
            s = scale[..., r // layout.block[0]:, :]
        deq = dequantize(q[..., sl, :], s, layout)
        sig += ref.square().sum(dim=(-1, -2), dtype=torch.float64)
        noise += (ref - deq).square_().sum(dim=(-1, -2), dtype=torch.float64)
    return FP8Result(q, scale, finite, sig, noise)


def is_power_of_two(scale: torch.Tensor) -> bool:
    """True when every scale is a positive power of two (the `scale_fmt: ue8m0` promise)."""
    s = scale.float()
    mantissa, _ = torch.frexp(s)
    return bool(((s > 0) & (mantissa == 0.5)).all())
