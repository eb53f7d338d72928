"""Numeric helpers and naive (loop-based, float64) references shared by the runtime tests.

The naive references re-derive the format from docs/format.md bit by bit and never call
quantkit.runtime, so they check the torch references independently."""

from __future__ import annotations

import math
import os

import pytest
import torch

try:
    import triton  # noqa: F401  (TRITON_INTERPRET is already set by conftest.py)

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (max |a - b| when b is all zero)."""
    a, b = a.double().cpu(), b.double().cpu()
    den = b.abs().max().item() if b.numel() else 0.0
    num = (a - b).abs().max().item() if b.numel() else 0.0
    return num / den if den > 0 else num


def naive_dequant(packed, scale, zero_point, n: int, k: int, group_size: int) -> torch.Tensor:
    """float64 [n, k] from one 2-D packed weight, element by element (formats.md, pack-quantized)."""
    packed, scale = packed.cpu().tolist(), scale.double().cpu().tolist()
    zp = zero_point.cpu().tolist() if zero_point is not None else None
    w = [[0.0] * k for _ in range(n)]
    for r in range(n):
        for c in range(k):
            word = packed[r][c // 8] & 0xFFFFFFFF
            q = ((word >> (4 * (c % 8))) & 0xF) - 8
            z = 0
            if zp is not None:
                zw = zp[r // 8][c // group_size] & 0xFFFFFFFF
                z = ((zw >> (4 * (r % 8))) & 0xF) - 8
            w[r][c] = (q - z) * scale[r][c // group_size]
    return torch.tensor(w, dtype=torch.float64)


def naive_dequant_weight(w) -> torch.Tensor:
    """naive_dequant over a PackedInt4 (2-D or 3-D) -> float64 [E?, N, K]."""
    n, k = w.shape
    if w.packed.ndim == 2:
        return naive_dequant(w.packed, w.scale, w.zero_point, n, k, w.group_size)
    return torch.stack([naive_dequant(w.packed[e], w.scale[e], None if w.zero_point is None else w.zero_point[e],
                                      n, k, w.group_size) for e in range(w.packed.shape[0])])


def gather_context(cache: torch.Tensor, table_row, ctx: int) -> torch.Tensor:
    """The first ctx tokens of one request, walked token by token: cache [P, S, ...] -> [ctx, ...] float64."""
    s = cache.shape[1]
    return torch.stack([cache[int(table_row[t // s]), t % s].double() for t in range(ctx)])


def naive_attention(q, k, v, sm_scale: float) -> torch.Tensor:
    """Dense float64 attention for one request: q [Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] -> [Hq, Dv]."""
    hq, hkv = q.shape[0], k.shape[1]
    out = torch.zeros(hq, v.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kh = h // (hq // hkv)
        s = (k[:, kh, :] @ q[h].double()) * sm_scale  # [T]
        p = torch.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[:, kh, :]
    return out


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
