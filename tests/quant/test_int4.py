"""INT4 math and packing: golden bytes, round trips, and RTN against a plain float64 reference."""

import pytest
import torch

from quantkit.quant.int4 import choose_qparams, dequantize, quantize, rtn, sqnr_db
from quantkit.pack.int4 import pack_int4, unpack_int4


def test_pack_golden_bytes():
    # formats.md: row [1,2,3,4,5,6,7,0] -> nibbles (q+8) 9,A,B,C,D,E,F,8 LSB first -> 0x8FEDCBA9
    p = pack_int4(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]]))
    assert p.dtype == torch.int32 and p.shape == (1, 1)
    assert p.item() & 0xFFFFFFFF == 0x8FEDCBA9
    assert p.item() == 0x8FEDCBA9 - 2**32  # stored as a signed int32
    assert pack_int4(torch.full((1, 8), -8)).item() == 0
    assert pack_int4(torch.full((1, 8), 7)).item() == -1  # 0xFFFFFFFF
    # element j -> word j // 8: the 9th element starts the second word
    p2 = pack_int4(torch.tensor([[0] * 8 + [1] + [0] * 7]))
    assert p2[0, 1].item() & 0xF == 9 and p2[0, 0].item() & 0xFFFFFFFF == 0x88888888


def test_pack_matches_bitwise_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 5, 37), generator=g)
    words = []
    for row in q.reshape(-1, 37).tolist():
        row = row + [-8] * (40 - 37)
        words.append([sum(((v + 8) & 0xF) << (4 * j) for j, v in enumerate(row[w * 8:(w + 1) * 8])) for w in range(5)])
    ref = torch.tensor(words, dtype=torch.int64)
    ref = torch.where(ref >= 2**31, ref - 2**32, ref).to(torch.int32).reshape(3, 5, 5)
    assert torch.equal(pack_int4(q), ref)
    assert torch.equal(unpack_int4(pack_int4(q), 37), q.to(torch.int8))


@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_matches_float64_reference(group_size, symmetric):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(3, 24, 256, generator=g) * 0.05).to(torch.bfloat16)
    res = rtn(w, 4, group_size, symmetric)
    # independent reference in float64 straight from the definitions in formats.md
    gs = 256 if group_size is None else group_size
    wg = w.double().reshape(3, 24, 256 // gs, gs)
    if symmetric:
        scale = (wg.abs().amax(-1) / 7.5).to(torch.bfloat16).double()
        q = torch.clamp(torch.round(wg / scale[..., None]), -8, 7)
        deq = q * scale[..., None]
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).to(torch.bfloat16).double()
        zp = torch.clamp(-8 - torch.round(lo / scale), -8, 7)
        q = torch.clamp(torch.round(wg / scale[..., None]) + zp[..., None], -8, 7)
        deq = (q - zp[..., None]) * scale[..., None]
        assert torch.equal(res.qparams.zero_point.double(), zp)
    assert torch.equal(res.qparams.scale.double(), scale)
    # q may differ only on exact .5 ties (float32 vs float64 division): allow none on random data
    assert torch.equal(res.q.double(), q.reshape(3, 24, 256))
    mine = dequantize(res.q, res.qparams.scale, res.qparams.zero_point, torch.float64)
    assert torch.allclose(mine, deq.reshape(3, 24, 256), rtol=0, atol=1e-12)
    # batched result == one matrix at a time == unchunked choose_qparams/quantize
    for e in range(3):
        qp = choose_qparams(w[e], 4, group_size, symmetric)
        assert torch.equal(quantize(w[e], qp), res.q[e])
    s = res.sqnr_db()
    for e in range(3):
        assert abs(s[e].item() - sqnr_db(w[e], mine[e]).item()) < 1e-6
    assert (s > 15).all()  # 4-bit RTN on Gaussian weights is ~19-22 dB
    packed = rtn(w, 4, group_size, symmetric, pack=True)
    assert torch.equal(packed.q, pack_int4(res.q))


def test_rtn_zero_group_and_scale_rounding():
    w = torch.zeros(2, 64, dtype=torch.bfloat16)
    w[1, :32] = 0.37
    res = rtn(w, 4, 32, True)
    assert torch.isfinite(res.qparams.scale).all()
    deq = dequantize(res.q, res.qparams.scale)
    assert torch.equal(deq[0], torch.zeros(64))
    # the stored (bf16) scale is the one used for quantization
    assert res.qparams.scale.to(torch.bfloat16).float().equal(res.qparams.scale)


def test_rtn_rejects_indivisible_group():
    with pytest.raises(ValueError, match="not a multiple"):
        rtn(torch.randn(4, 48), 4, 32)


@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_mse_is_the_searched_definition_and_never_worse(symmetric):
    """rtn(scale_search="mse") equals quantize(w, choose_qparams_mse(w)) exactly (scales and, asymmetric, zero
    points), with error <= min/max's per matrix and lower in some; packed or not, the same parameters."""
    from quantkit.quant.int4 import choose_qparams_mse, quantize, rtn

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(3, 40, 128, generator=g) * torch.rand(3, 40, 1, generator=g)).to(torch.bfloat16)
    w[0, 0, :32] = 0  # an all-zero group
    w[1, 2, 5] = 40.0  # an outlier that clipping would ruin
    res = rtn(w, 4, 32, symmetric, torch.bfloat16, scale_search="mse")
    qp = choose_qparams_mse(w, 4, 32, symmetric, torch.bfloat16)
    assert torch.equal(res.q, quantize(w, qp)) and torch.equal(res.qparams.scale, qp.scale)
    assert (qp.zero_point is None) == symmetric
    if not symmetric:
        assert torch.equal(res.qparams.zero_point, qp.zero_point)
    base = rtn(w, 4, 32, symmetric, torch.bfloat16)
    assert bool((res.noise <= base.noise * (1 + 1e-6)).all()) and bool((res.noise < base.noise).any())
    packed = rtn(w, 4, 32, symmetric, torch.bfloat16, pack=True, scale_search="mse")
    assert torch.equal(packed.qparams.scale, qp.scale) and torch.equal(packed.noise, res.noise)
    with pytest.raises(ValueError, match="amax or mse"):
        rtn(w, 4, 32, symmetric, torch.bfloat16, scale_search="best")
