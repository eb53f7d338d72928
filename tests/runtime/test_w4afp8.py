"""W4AFP8 numerics (runtime/w4afp8.py): the scale conversion and per-token activation quantization against a
naive float64 re-derivation of vLLM's formulas, the torch reference GEMM against that naive GEMM, and the Triton
kernel (interpreted without a GPU: TRITON_INTERPRET=1, conftest.py) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from quantkit.pack.int4 import pack_int4
from quantkit.runtime.int4 import PackedInt4
from quantkit.runtime.w4afp8 import (W4AFP8Weight, convert_scales, quant_tokens, w4afp8_gemm, w4afp8_gemm_ref,
                                     w4afp8_moe_ref)

from .helpers import DEVICE, needs_triton, rel_err


def _decode_e4m3(code: int) -> float:
    """float8_e4m3fn bit pattern (positive, 0..126) -> value: 4 exponent bits (bias 7), 3 mantissa bits."""
    e, f = code >> 3, code & 7
    return f / 8 * 2.0 ** -6 if e == 0 else (1 + f / 8) * 2.0 ** (e - 7)


GRID = [_decode_e4m3(c) for c in range(127)]  # increasing with the code; 126 = 448


def _e4m3(v: float) -> float:
    """Nearest float8_e4m3fn value of a float, ties to the even code, saturating at 448."""
    mag = min(abs(v), 448.0)
    code = min(range(127), key=lambda c: (abs(GRID[c] - mag), c & 1))
    return GRID[code] if v >= 0 else -GRID[code]


def _weight(n, k, seed=0, e=None):
    g = torch.Generator().manual_seed(seed)
    lead = (e,) if e else ()
    q = torch.randint(-8, 8, (*lead, n, k), generator=g)
    scale = (torch.rand((*lead, n, k // 128), generator=g) * 0.02 + 1e-4).to(torch.bfloat16)
    packed = pack_int4(q) if e is None else torch.stack([pack_int4(x) for x in q])
    return q, scale, PackedInt4(packed, scale, None, (n, k), 128)


def test_scale_conversion_matches_the_formula():
    q, scale, w = _weight(6, 512)
    s8, chan = convert_scales(scale)
    for r in range(6):
        c = max(max(abs(float(v)) for v in scale[r]) / 448.0, 1.0 / (448 * 512))
        assert chan[r].item() == pytest.approx(8 * c, rel=1e-6)
        for gi in range(4):
            s1 = _e4m3(float(torch.tensor(float(scale[r, gi])) * torch.tensor(c, dtype=torch.float32).reciprocal()))
            assert s8[r, gi].item() == _e4m3(s1 / 8), (r, gi)
    # the effective weight stays within e4m3's range and close to the bf16 dequantization
    eff = W4AFP8Weight.from_int4(w).effective() * chan[:, None]
    ref = q.float() * scale.float().repeat_interleave(128, -1)
    assert rel_err(eff, ref) < 0.1 and not torch.equal(eff, ref)


def test_token_quantization_and_reference_gemm_against_naive():
    q, scale, w = _weight(8, 256, seed=1)
    x = torch.randn(5, 256, dtype=torch.float64).to(torch.bfloat16)
    xq, a = quant_tokens(x)
    ww = W4AFP8Weight.from_int4(w)
    eff = ww.effective().double()
    y = torch.zeros(5, 8, dtype=torch.float64)
    for m in range(5):
        am = max(float(x[m].float().abs().max()) / 448.0, 1.0 / (448 * 512))
        assert a[m].item() == pytest.approx(am, rel=1e-6)
        inv = torch.tensor(am, dtype=torch.float32).reciprocal()
        row = [_e4m3(float(torch.tensor(float(v), dtype=torch.float32) * inv)) for v in x[m]]
        assert xq[m].tolist() == row
        for n in range(8):
            y[m, n] = sum(row[k] * float(eff[n, k]) for k in range(256)) * am * float(ww.chan[n])
    assert rel_err(w4afp8_gemm_ref(x.float(), ww), y) < 1e-5


@needs_triton
@pytest.mark.parametrize("m,n,k,dtype", [(1, 64, 256, torch.bfloat16), (7, 96, 384, torch.bfloat16),
                                         (33, 32, 128, torch.float32)])
def test_kernel_matches_reference(m, n, k, dtype):
    _, _, w = _weight(n, k, seed=m)
    ww = W4AFP8Weight.from_int4(w.to(DEVICE))
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3).to(dtype).to(DEVICE)
    y_ref = w4afp8_gemm_ref(x, ww)
    y = w4afp8_gemm(x, ww, backend="triton")
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, y_ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    # the comparison can fail: a weight one nibble off
    bad = W4AFP8Weight(ww.packed ^ 1, ww.s8, ww.chan, ww.shape)
    assert rel_err(w4afp8_gemm(x, bad, backend="triton"), y_ref) > 1e-3


def test_moe_reference_is_close_to_w4a16_and_differs():
    _, _, gu = _weight(2 * 256, 256, seed=3, e=3)
    _, _, dn = _weight(256, 256, seed=4, e=3)
    x = (torch.randn(10, 256) * 0.5).to(torch.bfloat16)
    ids = torch.randint(0, 3, (10, 2), generator=torch.Generator().manual_seed(0))
    wts = torch.rand(10, 2)
    y = w4afp8_moe_ref(x, ids, wts, W4AFP8Weight.from_int4(gu), W4AFP8Weight.from_int4(dn))
    from quantkit.runtime.fused_moe import Int4Experts, fused_moe_int4_ref

    y16 = fused_moe_int4_ref(x, ids, wts, Int4Experts(dn, gate_up=gu))
    assert 0 < rel_err(y, y16) < 0.15
