"""The residual-stream rotation R1 (QuaRot, SpinQuant's "R1"): an orthogonal Q [H, H], H = hidden_size, that
the whole residual stream is turned by (x' = x Q) and that is folded into the weights, so that a weight
quantizer sees matrices whose outlier input channels are spread over many channels. Pure math: which
tensors are turned is read/rotate.py's, the names arch/residual.py's.

    Q = diag(s) . blockdiag(Hb, ..., Hb)        s: H random signs (torch.Generator on the CPU, from `seed`)
                                                Hb: the normalized Sylvester Hadamard matrix of order b,
                                                b = the largest power of two dividing H (b <= MAX_BLOCK,
                                                b <= the recipe's rotate.block)

Q is orthogonal (Q Q^T = I): the signs are +-1 and each Hb / sqrt(b) is. A hidden size that is not a power of
two (DeepSeek-V3 / Kimi K2 7168 = 7 x 1024, GLM 5120 = 5 x 1024, 6144 = 3 x 2048) gets a block-diagonal
Hadamard of 1024- or 2048-wide blocks rather than a Kronecker product with a stored H_28 / H_20 / H_12: every
quantization group (16, 32, 128 input channels) lies inside one block, so a block already spreads an outlier
over 32-64 groups' worth of channels, the transform stays an exact fast Walsh-Hadamard transform with no
stored tables, and the random signs span the whole width.

Applied as a row-vector transform `v -> v Q = fwht(v * s)` by a fast Walsh-Hadamard transform, O(H log b)
per row in float32: never a dense H x H product (a 7168-wide model has 384 experts per layer)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import NonFiniteWeight, RecipeError
from .int4 import optional_native, run_rows, run_span

KINDS = ("hadamard",)
MAX_BLOCK = 1 << 15  # a 32768-wide block; wider hidden sizes use several blocks
MAX_SEED = (1 << 63) - 1


@dataclass(frozen=True)
class RotationSpec:
    """A recipe's `rotate:` section: the kind of rotation, the seed of its random signs, and an upper bound on
    the Hadamard block (None: the largest power of two dividing the hidden size; 16 or 32: one block per NVFP4 /
    MXFP4 group)."""

    kind: str = "hadamard"
    seed: int = 0
    block: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise RecipeError(f"rotate.kind must be one of {KINDS}, got {str(self.kind)[:40]!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED:
            raise RecipeError(f"rotate.seed must be an integer from 0 to 2^63 - 1, got {str(self.seed)[:40]}")
        b = self.block
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or not 2 <= b <= MAX_BLOCK or b & (b - 1)):
            raise RecipeError(f"rotate.block must be a power of two from 2 to {MAX_BLOCK}, got {str(b)[:40]}")


def block_size(hidden: int, at_most: int | None = None) -> int:
    """The Hadamard block of a hidden size: its largest power-of-two divisor, at most MAX_BLOCK and `at_most` (a
    power of two: the recipe's rotate.block)."""
    if hidden <= 0:
        raise ValueError(f"hidden size must be positive, got {hidden}")
    return min(hidden & -hidden, MAX_BLOCK, at_most or MAX_BLOCK)


def random_signs(hidden: int, seed: int) -> torch.Tensor:
    """The H random signs of Q [H] (float32 +-1), the same on every machine for one seed (CPU mt19937)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 2, (hidden,), generator=gen, dtype=torch.int64).mul_(2).sub_(1).to(torch.float32)


def fwht(x: torch.Tensor, block: int, native: bool = True) -> torch.Tensor:
    """x [..., H] times blockdiag(Hb / sqrt(b)) along the last dim (b = `block`, a power of two dividing H):
    the normalized fast Walsh-Hadamard transform of each b-wide block of each row, log2(b) butterfly stages.
    Returns a new float tensor in x's dtype (float32 or float64). A float32 CPU tensor goes through the row
    kernel of quant/_rotate_native.py when native kernels are on (`native`): the same bits, ~50x faster."""
    *lead, n = x.shape
    if block & (block - 1) or n % block:
        raise ValueError(f"block {block} must be a power of two dividing the width {n}")
    if native and x.dtype == torch.float32 and x.device.type == "cpu" and block > 1:
        y = x.reshape(-1, n).contiguous().clone()
        if _fwht_native(y, block):
            return y.view(*lead, n)
    y = x.reshape(-1, n // block, block)  # [R, nb, b]
    h = 1
    while h < block:
        # pairs (i, i + h) within each 2h-wide run: [R, nb, b / 2h, 2, h]
        v = y.view(y.shape[0], y.shape[1], block // (2 * h), 2, h)
        a, b = v[:, :, :, 0, :], v[:, :, :, 1, :]
        y = torch.stack((a + b, a - b), dim=3).view(y.shape[0], y.shape[1], block)
        h *= 2
    return y.mul_(_inv_sqrt(block)).view(*lead, n)


def _native():
    """The compiled kernels (quant/_rotate_native.py), or False where native kernels are off or unavailable."""
    global _NATIVE
    if _NATIVE is None:
        _NATIVE = optional_native("_rotate_native") or False
    return _NATIVE


def _turn_cols_native(w: torch.Tensor, mult: torch.Tensor, block: int, out: torch.Tensor) -> bool:
    """Each column of w (bf16 [H, K], contiguous) as `_turn_native` turns a row, into `out` (contiguous bf16
    [H, K]): the butterflies between rows, across a tile of columns at once, so no transposed copies; the column
    ranges split over the native threads (run_span). False when native kernels are off or fail."""
    global _NATIVE
    if not _native():
        return False
    src, dst = w.view(torch.int16).numpy().view("uint16"), out.view(torch.int16).numpy().view("uint16")
    bad = np.zeros(w.shape[1], dtype=np.bool_)
    if not run_span(_NATIVE.turn_cols_bf16, w.shape[1], (src, mult.contiguous().numpy(), block,
                                                         _inv_sqrt(block).reshape(1).numpy(), dst, bad)):
        _NATIVE = False
        return False
    if bool(bad.any()):
        raise NonFiniteWeight("a weight to rotate holds NaN or Inf values")
    return True


def _inv_sqrt(block: int) -> torch.Tensor:
    """1/sqrt(b) as the one float32 value both paths multiply by."""
    return torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32)


_NATIVE = None  # quant/_rotate_native.py once imported, False when unavailable


def _fwht_native(rows: torch.Tensor, block: int) -> bool:
    """The row kernel over rows [R, N] (float32, contiguous), in place; False when native kernels are off or
    fail (rows untouched)."""
    global _NATIVE
    if not _native():
        return False
    if not run_rows(_NATIVE.fwht_rows, rows.numpy(), (block, _inv_sqrt(block).reshape(1).numpy()), ()):
        _NATIVE = False
        return False
    return True


def _turn_native(w: torch.Tensor, mult: torch.Tensor, block: int, out: torch.Tensor | None = None
                 ) -> torch.Tensor | None:
    """fwht(w * mult) in w's dtype (bf16 / float32 rows [R, H], contiguous) by the fused row kernel, into `out`
    (contiguous, w's shape and dtype) or a fresh tensor; None when native kernels are off or fail."""
    global _NATIVE
    if not _native():
        return None
    out = torch.empty_like(w) if out is None else out
    bad = torch.zeros(w.shape[0], dtype=torch.bool)
    if w.dtype == torch.bfloat16:
        fn, src, dst = (_NATIVE.turn_rows_bf16, w.view(torch.int16).numpy().view("uint16"),
                        out.view(torch.int16).numpy().view("uint16"))
    else:
        fn, src, dst = _NATIVE.turn_rows_f32, w.numpy(), out.numpy()
    if not run_rows(fn, src, (mult.contiguous().numpy(), block, _inv_sqrt(block).reshape(1).numpy()),
                    (dst, bad.numpy())):
        _NATIVE = False
        return None
    if bool(bad.any()):
        raise NonFiniteWeight("a weight to rotate holds NaN or Inf values")
    return out


def fwht_(x: torch.Tensor, block: int) -> torch.Tensor:
    """`fwht` in place on a contiguous float32 CPU tensor x [..., H] (the torch path copies its result back)."""
    if not (x.is_contiguous() and x.dtype == torch.float32 and block > 1 and _fwht_native(x.view(-1, x.shape[-1]),
                                                                                          block)):
        x.copy_(fwht(x, block, native=False))
    return x


def hadamard_matrix(block: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of order `block` (a power of two), dense: the tests' reference."""
    m = torch.ones((1, 1), dtype=dtype)
    while m.shape[0] < block:
        m = torch.cat((torch.cat((m, m), 1), torch.cat((m, -m), 1)), 0)
    return m / math.sqrt(block)


def dense_q(hidden: int, seed: int, dtype: torch.dtype = torch.float64, at_most: int | None = None) -> torch.Tensor:
    """Q [H, H] as a dense matrix (the tests' reference; the conversion never builds it)."""
    b = block_size(hidden, at_most)
    hb = torch.block_diag(*[hadamard_matrix(b, dtype)] * (hidden // b))
    return random_signs(hidden, seed).to(dtype)[:, None] * hb


@dataclass(frozen=True)
class Hadamard:
    """Q of one hidden size and seed, applied without building it."""

    hidden: int
    seed: int
    at_most: int | None = None  # the recipe's rotate.block

    @property
    def block(self) -> int:
        return block_size(self.hidden, self.at_most)

    def signs(self) -> torch.Tensor:
        return random_signs(self.hidden, self.seed)

    def rows(self, w: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
        """w [..., H] -> (w * gain) Q in float32, each row a row vector: a reader of the residual (W diag(g) Q),
        a bias or an embedding row (b Q)."""
        if w.shape[-1] != self.hidden:
            raise ValueError(f"width {w.shape[-1]} is not the hidden size {self.hidden}")
        scale = self.signs() if gain is None else self.signs() * gain.to(torch.float32)
        return fwht_(torch.mul(w, scale).contiguous(), self.block)  # w * scale in float32: a fresh tensor

    def turned(self, w: torch.Tensor, gain: torch.Tensor | None = None, dtype: torch.dtype | None = None,
               native: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """`rows(w, gain)` cast once to `dtype` (default: w's), for w [R, H]: one pass of the fused row kernel
        (quant/_rotate_native.py) where it applies (bf16 or float32 in and out, CPU), the torch path else; the
        same bits either way. `out`: where to write it (w's shape, `dtype`), returned."""
        dtype = dtype or w.dtype
        if native and w.dim() == 2 and w.dtype == dtype and dtype in (torch.bfloat16, torch.float32) \
                and w.device.type == "cpu" and self.block > 1 and w.shape[-1] == self.hidden:
            mult = self.signs() if gain is None else self.signs() * gain.to(torch.float32)
            direct = out is not None and out.is_contiguous()
            got = _turn_native(w.contiguous(), mult, self.block, out if direct else None)
            if got is not None:
                return got if out is None or direct else out.copy_(got)
        res = self.rows(w, gain)
        if not bool(torch.isfinite(res).all()):
            raise NonFiniteWeight("a weight to rotate holds NaN or Inf values")
        return res.to(dtype) if out is None else out.copy_(res)

    def turned_cols(self, w: torch.Tensor, dtype: torch.dtype | None = None, native: bool = True,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """`cols(w)` cast once to `dtype` (default: w's), for w [H, K]: the columns turned as rows of w^T (bf16 on
        the CPU: the column kernel, no transposed copies). `out`: where to write it (w's shape, `dtype`)."""
        dtype = dtype or w.dtype
        if native and w.dim() == 2 and w.dtype == dtype == torch.bfloat16 and w.device.type == "cpu" \
                and self.block > 1 and w.shape[0] == self.hidden:
            dst = out if out is not None and out.is_contiguous() else torch.empty(w.shape, dtype=dtype)
            if _turn_cols_native(w.contiguous(), self.signs(), self.block, dst):
                return dst if out is None or dst is out else out.copy_(dst)
        res = self.turned(w.transpose(-1, -2), None, dtype, native).transpose(-1, -2)
        return res.contiguous() if out is None else out.copy_(res)

    def cols(self, w: torch.Tensor) -> torch.Tensor:
        """w [H, K] (or [E, H, K]) -> Q^T w in float32: a writer of the residual. Q^T w = (w^T Q)^T, so each
        column is turned as a row vector."""
        if w.shape[-2] != self.hidden:
            raise ValueError(f"rows {w.shape[-2]} are not the hidden size {self.hidden}")
        return self.rows(w.transpose(-1, -2)).transpose(-1, -2).contiguous()
