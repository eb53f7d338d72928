"""compressed-tensors codes -> GGML blocks (quantkit/export/blocks.py), judged by gguf-py's own dequantization
(`gguf.quants.dequantize`, GGML's definitions in numpy) against quantkit's compressed-tensors decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

from quantkit.export import blocks as B  # noqa: E402
from quantkit.pack.fp4 import dequantize_module as fp4_decode, pack_fp4  # noqa: E402
from quantkit.pack.int4 import dequantize_int4, pack_int4, pack_ints, pack_zero_point  # noqa: E402

Q = gguf.GGMLQuantizationType


def _int4(rng, n, k, g, dtype=torch.bfloat16, lo=1e-3, hi=1e-2):
    q = torch.from_numpy(rng.integers(-8, 8, (n, k))).to(torch.int8)
    s = (torch.from_numpy(rng.uniform(lo, hi, (n, k // g))).float()).to(dtype)
    return q, s


@pytest.mark.parametrize("g", [32, 64, 128, 256])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_q4_0_is_compressed_tensors_decode(g, lead):
    rng = np.random.default_rng(g)
    n, k = 16, 256
    q, s = _int4(rng, n * (lead[0] if lead else 1), k, g)
    q, s = q.reshape(*lead, n, k), s.reshape(*lead, n, k // g)
    packed = pack_int4(q)
    want = dequantize_int4(packed, s, shape=(n, k)).numpy()
    counts = B.Inexact()
    got = B.q4_0(B.int4_nibbles(packed.numpy(), k), s.float().numpy(), counts)
    assert got.shape == (*lead, n, k // 32 * 18)
    assert np.array_equal(dequantize(got, Q.Q4_0), want)
    assert counts.total == s.numel() * (g // 32) and counts.changed == 0


def test_q4_0_counts_fp16_losses():
    """bf16 scales below fp16's normal range lose mantissa bits: counted, and the decoded weights then differ."""
    rng = np.random.default_rng(1)
    q, s = _int4(rng, 8, 64, 32, lo=1e-7, hi=2e-7)  # fp16 subnormals: 2^-24 granularity
    counts = B.Inexact()
    got = B.q4_0(B.int4_nibbles(pack_int4(q).numpy(), 64), s.float().numpy(), counts)
    assert counts.subnormal == s.numel() and counts.changed > 0 and counts.worst_rel > 0
    want = dequantize_int4(pack_int4(q), s, shape=(8, 64)).numpy()
    assert not np.array_equal(dequantize(got, Q.Q4_0), want)
    with pytest.raises(ValueError, match="fp16"):
        B.q4_0(B.int4_nibbles(pack_int4(q).numpy(), 64), np.full((8, 2), 1e5, np.float32), B.Inexact())


@pytest.mark.parametrize("g", [32, 128])
def test_q4_1_is_the_asymmetric_decode(g):
    rng = np.random.default_rng(2)
    n, k = 16, 128
    q, s = _int4(rng, n, k, g)
    z = torch.from_numpy(rng.integers(-8, 8, (n, k // g))).to(torch.int8)
    packed = pack_int4(q)
    want = dequantize_int4(packed, s, pack_zero_point(z), shape=(n, k)).numpy()
    counts = B.Inexact()
    got = dequantize(B.q4_1(B.int4_nibbles(packed.numpy(), k), s.float().numpy(), z.numpy(), counts), Q.Q4_1)
    # m = -(8 + z) s rounds to fp16 where it needs more than 11 significant bits: counted exactly
    m = -(8.0 + z.double()) * s.double()
    assert counts.minimum == int((m.to(torch.float16).double() != m).sum()) * (g // 32) > 0  # per GGML block
    # GGML computes u d + m, which rounds differently from (u - 8 - z) s in float32 even where m is exact: a few ulp
    # of the largest term; where m was rounded, half an fp16 ulp of m more
    m_err = (m.to(torch.float16).double() - m).abs().repeat_interleave(g, -1).numpy()
    ulp = np.finfo(np.float32).eps * 16 * float(s.float().max())
    assert (np.abs(got - want) <= m_err + 2 * ulp).all()
    assert np.mean(got == want) > 0.5
    s2 = torch.full((n, k // g), 1.0 / 3.0)  # float32 scales fp16 cannot hold
    c2 = B.Inexact()
    got2 = dequantize(B.q4_1(B.int4_nibbles(packed.numpy(), k), s2.numpy(), z.numpy(), c2), Q.Q4_1)
    want2 = dequantize_int4(packed, s2, pack_zero_point(z), shape=(n, k)).numpy()
    assert c2.changed == s2.numel() * (g // 32) and c2.minimum > 0
    assert np.abs(got2 - want2).max() < 16 * 2.0 ** -11 and not np.array_equal(got2, want2)


def test_q8_0():
    rng = np.random.default_rng(3)
    q = torch.from_numpy(rng.integers(-128, 128, (8, 96))).to(torch.int8)
    s = torch.from_numpy(rng.uniform(1e-3, 1e-2, (8, 3))).float().to(torch.bfloat16)
    want = dequantize_int4(pack_ints(q, 8), s, shape=(8, 96), num_bits=8).numpy()
    assert np.array_equal(dequantize(B.q8_0(q.numpy(), s.float().numpy(), B.Inexact()), Q.Q8_0), want)


def test_mxfp4_bit_for_bit_every_exponent():
    """Every code and every E8M0 byte but 255 (NaN in MX): GGML's doubled table x 2^(e - 128) is e2m1 x 2^(e - 127),
    e = 0 included."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(255 * 2, 2).reshape(255, 64)  # [255 rows, 64]
    e = torch.arange(255, dtype=torch.uint8).reshape(255, 1).repeat(1, 2)
    packed = pack_fp4(codes)
    want = fp4_decode("mxfp4", {"weight_packed": packed, "weight_scale": e}, torch.float32).numpy()
    got = dequantize(B.mxfp4(B.fp4_codes(packed.numpy()), e.numpy()), Q.MXFP4)
    assert np.array_equal(got, want)


def test_nvfp4_blocks_with_unit_global_scale():
    rng = np.random.default_rng(4)
    codes = torch.from_numpy(rng.integers(0, 16, (4, 128))).to(torch.uint8)
    s8 = torch.from_numpy(rng.uniform(0.1, 400, (4, 8))).float().to(torch.float8_e4m3fn)
    packed = pack_fp4(codes)
    want = fp4_decode("nvfp4", {"weight_packed": packed, "weight_scale": s8,
                                "weight_global_scale": torch.ones(1)}, torch.float32).numpy()
    got = dequantize(B.nvfp4(B.fp4_codes(packed.numpy()), s8.view(torch.uint8).numpy()), Q.NVFP4)
    assert np.array_equal(got, want)


def test_group_not_a_block_multiple_is_refused():
    with pytest.raises(ValueError, match="multiple of the GGML block"):
        B.q4_0(np.zeros((2, 64), np.uint8), np.ones((2, 4), np.float32), B.Inexact())  # group 16


@pytest.mark.parametrize("native", ["1", "0"])
def test_fused_kernel_is_the_definition(monkeypatch, native):
    """The numba kernels (quantkit/export/_blocks_native.py) write the bytes the numpy definitions write; with
    QUANTKIT_NATIVE=0 the definitions run."""
    monkeypatch.setenv("QUANTKIT_NATIVE", native)
    rng = np.random.default_rng(5)
    q = torch.from_numpy(rng.integers(-8, 8, (3, 40, 256))).to(torch.int8)
    s = torch.from_numpy(rng.uniform(1e-3, 1e-2, (3, 40, 4))).float().to(torch.bfloat16)
    packed = pack_int4(q).numpy()
    c1, c2 = B.Inexact(), B.Inexact()
    assert np.array_equal(B.q4_0_packed(packed, 256, s.float().numpy(), c1),
                          B.q4_0(B.int4_nibbles(packed, 256), s.float().numpy(), c2))
    assert c1 == c2
    codes = torch.from_numpy(rng.integers(0, 16, (3, 40, 256))).to(torch.uint8)
    e = rng.integers(0, 255, (3, 40, 8)).astype(np.uint8)
    fp4 = pack_fp4(codes).numpy()
    assert np.array_equal(B.mxfp4_packed(fp4, e), B.mxfp4(B.fp4_codes(fp4), e))
    assert (B._native() is None) == (native == "0")
