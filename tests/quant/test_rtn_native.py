"""The fused RTN kernel (quantkit.quant._rtn_native) against the torch definition in quant/int4.py:
packed words, scales and zero points bit for bit, error sums to float rounding, and the cases it must
hand back (NaN/Inf, unsupported scale dtypes). Then end to end: convert with and without it writes
the same bytes."""

import json
import os
import sys

import pytest
import torch

from quantkit.quant import int4
from quantkit.quant.int4 import dequantize, rtn
from quantkit.pack.int4 import pack_int4, unpack_int4
from harness import run_bounded
from .helpers import break_kernel

pytest.importorskip("numba")


def _both(w, group_size, symmetric, scale_dtype=torch.bfloat16):
    fast = rtn(w, 4, group_size, symmetric, scale_dtype, pack=True)
    ref = rtn(w, 4, group_size, symmetric, scale_dtype, pack=True, native=False)
    return fast, ref


def _assert_same(fast, ref):
    assert torch.equal(fast.q, ref.q)
    assert torch.equal(fast.qparams.scale, ref.qparams.scale)
    if ref.qparams.zero_point is None:
        assert fast.qparams.zero_point is None
    else:
        assert torch.equal(fast.qparams.zero_point, ref.qparams.zero_point)
    assert torch.allclose(fast.signal, ref.signal, rtol=1e-5, atol=1e-30)  # torch sums in float32: may underflow
    assert torch.allclose(fast.noise, ref.noise, rtol=1e-4, atol=1e-30)


def test_kernel_is_used():
    assert int4.native_available()
    w = torch.randn(2, 16, 64).to(torch.bfloat16)
    assert int4._rtn_native(w.reshape(-1, 64), 32, True, torch.bfloat16) is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_matches_torch_path(dtype, symmetric, group_size, scale_dtype):
    g = torch.Generator().manual_seed(7)
    # rows of very different magnitudes, an all-zero group, an all-negative and an all-positive group
    w = torch.randn(3, 40, 256, generator=g) * torch.logspace(-6, 1, 40).reshape(1, 40, 1)
    w[0, 0, :128] = 0
    w[1, 1, :128] = -w[1, 1, :128].abs()
    w[2, 2, :128] = w[2, 2, :128].abs()
    w = w.to(dtype)
    fast, ref = _both(w, group_size, symmetric, scale_dtype)
    _assert_same(fast, ref)


def test_per_channel_width_not_a_multiple_of_8():
    w = torch.randn(5, 37).to(torch.bfloat16)
    fast, ref = _both(w, None, True)
    _assert_same(fast, ref)
    assert torch.equal(unpack_int4(fast.q, 37), unpack_int4(ref.q, 37))


def test_ties_round_half_to_even():
    # absmax 7.5 -> scale exactly 1.0: w / s lands on .5 ties, which round to the even neighbour
    w = torch.tensor([[7.5, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] + [0.0] * 24], dtype=torch.bfloat16)
    fast, ref = _both(w, 32, True)
    _assert_same(fast, ref)
    q = unpack_int4(fast.q, 32)[0, :8].tolist()
    assert fast.qparams.scale[0, 0].item() == 1.0
    assert q == [7, 0, 2, 2, 0, -2, -2, 4]  # 7.5 -> 8 clamps to 7


def test_subnormal_and_tiny_scales():
    w = torch.full((2, 32), 1e-39, dtype=torch.float32)
    w[1] = torch.linspace(-3e-38, 3e-38, 32)
    for scale_dtype in (torch.bfloat16, torch.float32):
        fast, ref = _both(w, 32, True, scale_dtype)
        _assert_same(fast, ref)
        fast, ref = _both(w, 32, False, scale_dtype)
        _assert_same(fast, ref)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("symmetric", [True, False])
def test_non_finite_falls_back_to_torch_path(bad, symmetric):
    w = torch.randn(4, 64)
    w[2, 5] = bad
    assert int4._rtn_native(w, 32, symmetric, torch.bfloat16) is None
    fast, ref = _both(w, 32, symmetric)
    assert torch.equal(fast.q, ref.q)
    assert not torch.isfinite(fast.signal).all() or not torch.isfinite(fast.noise).all()


def test_float16_scales_take_torch_path():
    w = torch.randn(4, 64, dtype=torch.float16)
    assert int4._rtn_native(w.float(), 32, True, torch.float16) is None
    fast, ref = _both(w, 32, True, torch.float16)
    _assert_same(fast, ref)


def test_threads_split_rows_identically():
    w = torch.randn(8, 96, 128).to(torch.bfloat16)
    with int4.native_threads(1):
        one = rtn(w, 4, 32, True, pack=True)
    with int4.native_threads(3):
        three = rtn(w, 4, 32, True, pack=True)
    _assert_same(one, three)
    assert torch.equal(one.signal, three.signal) and torch.equal(one.noise, three.noise)


def test_dequantized_equals_independent_reference():
    w = (torch.randn(6, 128) * 0.02).to(torch.bfloat16)
    fast = rtn(w, 4, 32, True, pack=True)
    q = unpack_int4(fast.q, 128)
    wg = w.double().reshape(6, 4, 32)
    scale = (wg.abs().amax(-1) / 7.5).to(torch.bfloat16).double()
    ref_q = torch.clamp(torch.round(wg / scale[..., None]), -8, 7).reshape(6, 128)
    assert torch.equal(q.double(), ref_q)
    assert torch.equal(pack_int4(ref_q.to(torch.int8)), fast.q)
    deq = dequantize(q, fast.qparams.scale, None, torch.float64)
    noise = ((deq - w.double()) ** 2).sum()  # one matrix: one sum
    assert torch.allclose(fast.noise, noise, rtol=1e-6)


def test_convert_output_identical_without_kernel(tmp_path):
    from quantkit.testing import make_tiny_model

    src = tmp_path / "src"
    make_tiny_model("qwen3_moe", src)
    outs = {}
    for flag in ("1", "0"):
        out = tmp_path / f"out{flag}"
        env = {**os.environ, "QUANTKIT_NATIVE": flag}
        r = run_bounded([sys.executable, "-m", "quantkit.cli", "convert", str(src), str(out), "--json"],
                        env=env, timeout=600)
        assert r.returncode == 0, r.stderr
        outs[flag] = out
    files = sorted(p.name for p in outs["1"].glob("*.safetensors"))
    assert files and files == sorted(p.name for p in outs["0"].glob("*.safetensors"))
    for name in files:
        assert (outs["1"] / name).read_bytes() == (outs["0"] / name).read_bytes(), name
    m1 = json.loads((outs["1"] / "quantkit_manifest.json").read_text())
    m0 = json.loads((outs["0"] / "quantkit_manifest.json").read_text())
    assert m1["shards"] == m0["shards"]
    for name, e in m0["tensors"].items():
        if "sqnr_db" in e:
            assert abs(m1["tensors"][name]["sqnr_db"] - e["sqnr_db"]) < 1e-3


def test_kernel_failure_falls_back_to_torch_path(monkeypatch):
    break_kernel(monkeypatch, int4, "rtn_pack_bf16")
    w = torch.randn(4, 64).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="fused RTN kernel unavailable"):
        fast = rtn(w, 4, 32, True, pack=True)
    _assert_same(fast, rtn(w, 4, 32, True, pack=True, native=False))
    assert int4._NATIVE is False  # the rest of the run uses the torch path


# --- choose_qparams_mse: the compiled clipping search against its torch path ---

def _group_errors(w, scale, group_size, weight, num_bits=4, zp=None):
    """Each group's weighted squared error under `scale` [..., N, G] (and zero points zp), in float64 (an
    independent sum)."""
    from quantkit.quant.int4 import _grouped, qrange

    qmin, qmax = qrange(num_bits)
    wg = _grouped(w.double(), group_size)
    s = scale.double().unsqueeze(-1)
    z = 0 if zp is None else zp.double().unsqueeze(-1)
    d = (((wg / s).round() + z).clamp(qmin, qmax).sub(z) * s - wg).square()
    if weight is not None:
        d = d * _grouped(weight.double().unsqueeze(-2), group_size)
    return d.sum(-1)


def _assert_mse_agrees(w, group_size, weight, scale_dtype=torch.bfloat16, num_bits=4, symmetric=True):
    """The compiled search ran and chose torch's scale (and zero point) in every group, except where the two
    choices' errors are equal to float32 rounding (the sums differ: float64 there, float32 here)."""
    from quantkit.quant.int4 import _mse_native, choose_qparams_mse, MSE_RATIOS

    assert _mse_native(w, num_bits, group_size, scale_dtype, weight, MSE_RATIOS, symmetric) is not None
    fast = choose_qparams_mse(w, num_bits, group_size, symmetric, scale_dtype, weight=weight)
    ref = choose_qparams_mse(w, num_bits, group_size, symmetric, scale_dtype, weight=weight, native=False)
    assert fast.scale.shape == ref.scale.shape and fast.scale.dtype == ref.scale.dtype
    assert (fast.zero_point is None) == (ref.zero_point is None) == symmetric
    differ = fast.scale != ref.scale
    if not symmetric:
        assert fast.zero_point.dtype == ref.zero_point.dtype == torch.int32
        differ |= fast.zero_point != ref.zero_point
    if differ.any():
        ef = _group_errors(w, fast.scale, group_size, weight, num_bits, fast.zero_point)
        er = _group_errors(w, ref.scale, group_size, weight, num_bits, ref.zero_point)
        assert torch.allclose(ef[differ], er[differ], rtol=1e-5, atol=0), "a different scale with a different error"
    assert differ.float().mean() < 1e-3


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
def test_mse_search_matches_torch_path(group_size, scale_dtype, symmetric):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 40, 256, generator=g) * torch.rand(3, 40, 1, generator=g)
    w[0, :, ::7] *= 6.0  # heavy tails: clipping pays off in many groups
    w[1, 3, :64] = 0.0  # all-zero groups: scale 1
    w[2, :20] += 0.5 * w[2, :20].abs().amax(-1, keepdim=True)  # off-centre rows: zero points away from the middle
    diag = torch.rand(3, 256, generator=g) + 0.05
    _assert_mse_agrees(w, group_size, diag, scale_dtype, symmetric=symmetric)  # one weight row per expert
    _assert_mse_agrees(w, group_size, diag[0], scale_dtype, symmetric=symmetric)  # one for every row
    _assert_mse_agrees(w[1], group_size, None, scale_dtype, symmetric=symmetric)  # unweighted, 2-D


def test_mse_search_8_bit_and_odd_width():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(70, 96, generator=g).pow(3)
    _assert_mse_agrees(w, 32, None, num_bits=8)
    _assert_mse_agrees(w[:, :48], None, torch.rand(48, generator=g))  # per channel, width 48


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("actorder", [True, False])
def test_mse_search_gptq_scales_match_torch_path(monkeypatch, actorder, symmetric):
    """GPTQ with `observer: mse` (its scale picks through the compiled search) gives the same result as
    with the torch search: static groups picked up front (act-order) and groups picked in the sweep."""
    from quantkit.quant import gptq as G

    g = torch.Generator().manual_seed(5)
    w = torch.randn(4, 64, 128, generator=g) + (0 if symmetric else 0.3)
    x = torch.randn(4, 512, 128, generator=g)
    h = torch.bmm(x.transpose(1, 2), x) / 256
    fast = G.gptq(w, h, G.GPTQArgs(4, 32, symmetric, actorder=actorder, observer="mse"))
    monkeypatch.setattr(G, "choose_qparams_mse", lambda *a, **k: int4.choose_qparams_mse(*a, **k, native=False))
    ref = G.gptq(w, h, G.GPTQArgs(4, 32, symmetric, actorder=actorder, observer="mse"))
    assert torch.equal(fast.qparams.scale, ref.qparams.scale) and torch.equal(fast.q, ref.q)
    if not symmetric:
        assert torch.equal(fast.qparams.zero_point, ref.qparams.zero_point)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_mse_search_non_finite_takes_torch_path(bad, symmetric):
    from quantkit.quant.int4 import _mse_native, choose_qparams_mse, MSE_RATIOS

    w = torch.randn(8, 64)
    w[5, 9] = bad
    assert _mse_native(w, 4, 32, torch.bfloat16, None, MSE_RATIOS, symmetric) is None
    got = choose_qparams_mse(w, 4, 32, symmetric).scale
    ref = choose_qparams_mse(w, 4, 32, symmetric, native=False).scale
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())


def test_mse_search_cases_it_hands_back():
    from quantkit.quant.int4 import _mse_native, MSE_RATIOS

    w = torch.randn(2, 8, 64)
    assert _mse_native(w, 4, 32, torch.float16, None, MSE_RATIOS) is None  # fp16 scales
    assert _mse_native(w, 4, 32, torch.bfloat16, torch.ones(8, 64), MSE_RATIOS) is None  # weight per row
    with pytest.raises(ValueError, match="multiple of group_size"):
        _mse_native(w, 4, 48, torch.bfloat16, None, MSE_RATIOS)


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_search_kernel_failure_falls_back(monkeypatch, symmetric):
    from quantkit.quant.int4 import choose_qparams_mse

    break_kernel(monkeypatch, int4, "mse_scales")
    w = torch.randn(16, 64)
    with pytest.warns(UserWarning, match="fused RTN kernel unavailable"):
        got = choose_qparams_mse(w, 4, 32, symmetric)
    ref = choose_qparams_mse(w, 4, 32, symmetric, native=False)
    assert torch.equal(got.scale, ref.scale) and int4._NATIVE is False
    if not symmetric:
        assert torch.equal(got.zero_point, ref.zero_point)
