"""The fused FP4 RTN kernel (quantkit.quant._fp4_native) against the torch definition in quant/fp4.py:
packed bytes and scales bit for bit over shapes, magnitudes and the edge cases of both formats (every
finite bf16 value, zero groups, subnormal weights and scales, E8M0 extremes, E2M1 and e4m3 ties),
error sums to float rounding, amax and fitted (mse) scales; the cases it hands back (NaN/Inf, FP16, a
bad global scale);
QUANTKIT_NATIVE=0. Then end to end: FP4 converts from BF16, FP8 and INT4 sources write the same bytes
with and without it."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from quantkit.quant import fp4, int4
from harness import run_bounded
from .helpers import break_kernel

pytest.importorskip("numba")


def _both(w, fmt, global_scale=None, search="amax"):
    if fmt == "nvfp4":
        return (fp4.rtn_nvfp4(w, global_scale, search), fp4.rtn_nvfp4(w, global_scale, search, native=False))
    return fp4.rtn_mxfp4(w, search), fp4.rtn_mxfp4(w, search, native=False)


def _assert_same(fast, ref, sums=True):
    assert torch.equal(fast.packed, ref.packed)
    assert fast.scale.dtype == ref.scale.dtype
    assert torch.equal(fast.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    assert (fast.global_scale is None) == (ref.global_scale is None)
    if ref.global_scale is not None:
        assert torch.equal(fast.global_scale, ref.global_scale)
    assert torch.equal(fast.finite, ref.finite)
    if sums:  # the torch path sums rows in float32 (may underflow or overflow), the kernel in float64
        assert torch.allclose(fast.signal, ref.signal, rtol=1e-5, atol=1e-30)
        assert torch.allclose(fast.noise, ref.noise, rtol=1e-4, atol=1e-30)
        if ref.noise_amax is not None:
            assert torch.allclose(fast.noise_amax, ref.noise_amax, rtol=1e-4, atol=1e-30)


def test_kernel_is_used():
    w = torch.randn(2, 16, 64).to(torch.bfloat16)
    assert fp4._native_module()
    assert fp4._rtn_native(w.reshape(-1, 64), True, torch.ones(32)) is not None
    assert fp4._rtn_native(w.reshape(-1, 64), False, None) is not None


@pytest.mark.parametrize("search", ["amax", "mse"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 32), (3, 5, 64), (2, 40, 256), (1, 7, 1024)])
def test_matches_torch_path(fmt, dtype, shape, search):
    g = torch.Generator().manual_seed(sum(shape))
    # rows of very different magnitudes, an all-zero group, an all-negative and an all-positive group
    w = torch.randn(*shape, generator=g) * torch.logspace(-8, 4, shape[-2]).reshape(-1, 1)
    w.view(-1, shape[-1])[0, :32] = 0
    if w.reshape(-1, shape[-1]).shape[0] > 2:
        w.view(-1, shape[-1])[1, :32] = -w.view(-1, shape[-1])[1, :32].abs()
        w.view(-1, shape[-1])[2, :32] = w.view(-1, shape[-1])[2, :32].abs()
    _assert_same(*_both(w.to(dtype), fmt, search=search))


@pytest.mark.parametrize("search", ["amax", "mse"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_every_finite_bf16_value(fmt, search):
    """All 65,280 finite bf16 bit patterns (signs, subnormals, the largest), shuffled into groups so each
    is divided by many different scales, plus sorted so each binade is grouped with its neighbours."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = bits[torch.isfinite(bits)]
    n = finite.numel() // 256 * 256
    g = torch.Generator().manual_seed(1)
    for order in (torch.randperm(finite.numel(), generator=g), torch.arange(finite.numel())):
        w = finite[order][:n].reshape(-1, 256)
        fast, ref = _both(w, fmt, search=search)
        _assert_same(fast, ref, sums=False)  # sums of squares of 1e38 overflow float32, not float64


@pytest.mark.parametrize("search", ["amax", "mse"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_magnitude_sweep(fmt, dtype, search):
    """Rows from 1e-38 (subnormal scales, quotients that underflow) to 1e38 (E8M0 254/255, e4m3 448)."""
    g = torch.Generator().manual_seed(3)
    mags = torch.logspace(-44, 38, 160, dtype=torch.float64).float().reshape(-1, 1)
    w = (torch.randn(160, 128, generator=g) * mags).to(dtype)
    fast, ref = _both(w[torch.isfinite(w).all(-1)], fmt, search=search)
    _assert_same(fast, ref, sums=False)


def test_e2m1_ties_and_saturation():
    # MXFP4: amax 6 -> E8M0 127 (scale 1), so values sit exactly on the rounding thresholds
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0,
            0.2499, 0.7501, 1.2501, 1.7499, 2.5001, 3.4999, 5.0001, -6.0, 1e-30, -1e-30, 0.5, 4.0, 3.0, 2.0, 1.0, 1.5]
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.tensor([ties] * 2, dtype=dtype)
        fast, ref = _both(w, "mxfp4")
        _assert_same(fast, ref)
        assert fast.scale[0, 0].item() == 127
        # NVFP4 with global scale 448 * 6 / 6 = 448 over amax 6: each group's scale is 448 -> effective 1
        fast, ref = _both(w, "nvfp4", torch.tensor([448.0]))
        _assert_same(fast, ref)


@pytest.mark.parametrize("levels", [15, 16])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fitted_scales_on_int4_grids(fmt, levels):
    """Fitted scales where they are the default: weights decoded from INT4 (Kimi's 15 levels, or 16),
    whose groups hold few distinct values, so candidate errors tie exactly or nearly; rows whose pick
    the kernel cannot prove are recomputed by torch (and some are: both branches run)."""
    g = torch.Generator().manual_seed(levels)
    lo = -7 if levels == 15 else -8
    q = torch.randint(lo, 8, (6, 64, 256), generator=g).float()
    s = (torch.rand(6, 64, 8, 1, generator=g) * 0.01).to(torch.bfloat16).float()
    w = (q.reshape(6, 64, 8, 32) * s).reshape(6, 64, 256).to(torch.bfloat16)
    w[0, :3, :64] = w[0, :3, :64].sign() * w[0, :3, :64].abs().amax()  # constant-magnitude groups
    gs = fp4.choose_global_scale(w)
    rows = w.reshape(-1, 256)
    res = fp4._rtn_native(rows, fmt == "nvfp4", gs.expand(6, 64).reshape(-1), fit=True)
    assert res is not None
    _assert_same(*_both(w, fmt, search="mse"))


def test_e4m3_scale_rounding_at_every_tie():
    """Group amaxes whose scale gs * amax / 6 lands on, and one float32 step either side of, the midpoint
    between every pair of neighbouring e4m3 values (subnormal ones included): round to nearest even."""
    e4m3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (e4m3[:-1] + e4m3[1:]) / 2
    targets = torch.cat([mid, torch.nextafter(mid, torch.tensor(0.0)), torch.nextafter(mid, torch.tensor(1e3)),
                         e4m3, torch.tensor([448.0, 460.0, 1e-12, 2.0 ** -10, 2.0 ** -9 * 0.5])])
    gs = torch.tensor([6.0])  # scale = 6 * (amax / 6): amax is the target, up to float32 rounding
    w = torch.zeros(targets.numel(), 16)
    w[:, 0] = targets
    w[:, 1:] = targets.unsqueeze(-1) * torch.linspace(-1, 1, 15)
    fast, ref = _both(w, "nvfp4", gs)
    _assert_same(fast, ref)
    # and through the e4m3 conversion itself, a strided scan of float32 bit patterns 0 .. 448
    top = int(torch.tensor(448.0).view(torch.int32))
    s = torch.arange(0, top + 1, 4099, dtype=torch.int32).view(torch.float32)
    w = torch.zeros(s.numel(), 16)
    w[:, 0] = s
    fast, ref = _both(w, "nvfp4", gs)
    _assert_same(fast, ref, sums=False)


def test_subnormal_weights_and_zero_groups():
    w = torch.zeros(4, 64)
    w[1] = 1e-39  # float32 subnormal
    w[2] = torch.linspace(-3e-38, 3e-38, 64)
    w[3, 5] = -1e-45  # the smallest subnormal, alone in its group
    for dtype in (torch.float32, torch.bfloat16):
        for fmt in ("nvfp4", "mxfp4"):
            _assert_same(*_both(w.to(dtype), fmt), sums=False)


def test_shared_and_tiny_global_scales():
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(3, 8, 64, generator=g) * 0.02).to(torch.bfloat16)
    gs = fp4.choose_global_scale(w, w * 4)  # a gate/up pair's shared scale
    _assert_same(*_both(w, "nvfp4", gs))
    for value in (1e-30, 1e30, 3e38):  # scales that clamp at 448 or round to e4m3 zero -> 0.125
        _assert_same(*_both(w, "nvfp4", torch.full((3, 1), value)), sums=False)


def _amax_torch(w):
    wc = w.to(fp4._stat_dtype(w))
    return torch.maximum(-wc.amin(dim=(-2, -1)), wc.amax(dim=(-2, -1))).clamp_(min=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_global_amax_is_torchs(dtype, monkeypatch):
    """The NVFP4 global scale's amax: one pass over the magnitudes' bit patterns (bf16 / float32) gives
    torch's max(-amin, amax) exactly, Inf, -0 and subnormals included; NaN goes to torch's reduction."""
    calls = []
    mod = fp4._native_module()
    for fn in ("absmax_bits16", "absmax_bits32"):
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, _real=real, _fn=fn: (calls.append(_fn), _real(*a))[1])
    g = torch.Generator().manual_seed(7)
    for shape in [(16, 32), (3, 8, 64), (2, 3, 4, 16)]:
        w = (torch.randn(shape, generator=g) * torch.logspace(-40, 30, shape[-1])).to(dtype)
        flat = w.view(-1, shape[-2] * shape[-1])
        flat[0] = -flat[0].abs()  # a matrix whose largest magnitude is negative
        if flat.shape[0] > 2:
            flat[1] = 0.0
            flat[1, 3] = -0.0
            flat[2, 5] = float("-inf")
        got = fp4._matrix_amax(w)
        assert got.dtype == _amax_torch(w).dtype and torch.equal(got, _amax_torch(w)), shape
        n = len(calls)
        assert torch.equal(fp4._matrix_amax(w.transpose(-1, -2)), _amax_torch(w))
        assert len(calls) == n  # a transposed view: torch's reduction
        assert torch.equal(fp4.choose_global_scale(w, w * 2), fp4.global_scale_from_amax(_amax_torch(w * 2)))
    # the kernel of the statistics dtype (FP16 is widened to float32), except for the transposed views
    assert set(calls) == {"absmax_bits16" if dtype == torch.bfloat16 else "absmax_bits32"}
    w = torch.randn(3, 4, 16).to(dtype)
    w[1, 2, 3] = float("nan")
    got, want = fp4._matrix_amax(w), _amax_torch(w)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[1].isnan()) and torch.equal(got[[0, 2]], want[[0, 2]])


def test_global_amax_kernel_failure_falls_back(monkeypatch):
    break_kernel(monkeypatch, fp4, "absmax_bits16")
    w = torch.randn(2, 8, 32).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="fused RTN kernel unavailable"):
        got = fp4._matrix_amax(w)
    assert torch.equal(got, _amax_torch(w)) and fp4._NATIVE is False


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_non_finite_falls_back_to_torch_path(bad, fmt):
    w = torch.randn(4, 64)
    w[2, 5] = bad
    assert fp4._rtn_native(w, fmt == "nvfp4", torch.ones(4)) is None
    fast, ref = _both(w, fmt)
    assert torch.equal(fast.packed, ref.packed) and not bool(fast.finite.all())


def test_what_takes_the_torch_path():
    w = torch.randn(4, 64)
    assert fp4._rtn_native(w.half(), True, torch.ones(4)) is None  # FP16: statistics widened, torch path
    for gs in (0.0, -1.0, float("inf"), float("nan")):
        assert fp4._rtn_native(w, True, torch.full((4,), gs)) is None
    fast, ref = fp4.rtn_nvfp4(w.half()), fp4.rtn_nvfp4(w.half(), native=False)
    _assert_same(fast, ref)
    # fitted scales: the same bytes both ways
    for fn in (fp4.rtn_nvfp4, fp4.rtn_mxfp4):
        _assert_same(fn(w, scale_search="mse"), fn(w, scale_search="mse", native=False))


def test_threads_split_rows_identically():
    w = torch.randn(8, 96, 128).to(torch.bfloat16)
    for fmt in ("nvfp4", "mxfp4"):
        with int4.native_threads(1):
            one = _both(w, fmt)[0]
        with int4.native_threads(3):
            three = _both(w, fmt)[0]
        _assert_same(one, three)
        assert torch.equal(one.signal, three.signal) and torch.equal(one.noise, three.noise)


def test_switch_off_with_environment():
    code = ("from quantkit.quant import fp4, int4; import torch; w = torch.randn(4, 64);"
            "print(bool(fp4._native_module()), bool(int4._native_module()),"
            "torch.equal(fp4.rtn_nvfp4(w).packed, fp4.rtn_nvfp4(w, native=False).packed))")
    for flag, want in (("0", "False False True"), ("1", "True True True")):
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "QUANTKIT_NATIVE": flag},
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == want.split()


def test_kernel_failure_falls_back_to_torch_path(monkeypatch):
    break_kernel(monkeypatch, fp4, "fp4_pack_bf16")
    w = torch.randn(4, 64).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="fused RTN kernel unavailable"):
        fast = fp4.rtn_nvfp4(w)
    _assert_same(fast, fp4.rtn_nvfp4(w, native=False))
    assert fp4._NATIVE is False  # the rest of the run uses the torch path


# One process per QUANTKIT_NATIVE value converts every (source, recipe) pair; the FP4 modules come
# from BF16 (read as is), block FP8 (dequantized on read) and a Kimi-style INT4 release (decoded on read).
_CONVERTS = r"""
import sys
from pathlib import Path
from quantkit.convert import ConvertOptions, convert
from quantkit.match.recipe import parse_recipe
from importlib import resources

root, out = Path(sys.argv[1]), Path(sys.argv[2])
def recipe(name, search):
    text = (resources.files("quantkit") / "data" / "recipes" / f"{name}.yaml").read_text()
    if search:
        text = text.replace("strategy: tensor_group}", f"strategy: tensor_group, scale_search: {search}}}")
        text = text.replace("strategy: group}", f"strategy: group, scale_search: {search}}}")
    return parse_recipe(text, name)
for src in ("bf16", "fp8", "int4"):
    for name, search in (("nvfp4-experts", None), ("nvfp4-experts", "amax"), ("mxfp4-experts", None)):
        convert(root / src, out / f"{src}-{name}-{search}", ConvertOptions(recipe=recipe(name, search)))
"""


def test_convert_output_identical_without_kernel(tmp_path):
    from quantkit.testing import make_tiny_model, write_block_fp8_checkpoint

    make_tiny_model("qwen3_moe", tmp_path / "bf16")
    write_block_fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    make_tiny_model("kimi_k25", tmp_path / "int4", int4_experts="qat")
    outs = {}
    for flag in ("1", "0"):
        out = tmp_path / f"out{flag}"
        r = run_bounded([sys.executable, "-c", _CONVERTS, str(tmp_path), str(out)],
                        env={**os.environ, "QUANTKIT_NATIVE": flag}, timeout=900)
        assert r.returncode == 0, r.stderr
        outs[flag] = out
    runs = sorted(p.name for p in outs["0"].iterdir())
    assert len(runs) == 9 and runs == sorted(p.name for p in outs["1"].iterdir())
    for run in runs:
        files = sorted(p.name for p in (outs["0"] / run).glob("*.safetensors"))
        assert files
        for name in files:
            h = [hashlib.sha256((outs[f] / run / name).read_bytes()).hexdigest() for f in ("0", "1")]
            assert h[0] == h[1], f"{run}/{name}"
        m0 = json.loads((outs["0"] / run / "quantkit_manifest.json").read_text())
        m1 = json.loads((outs["1"] / run / "quantkit_manifest.json").read_text())
        assert m1["shards"] == m0["shards"]
        assert "fp4-pack-quantized" in (outs["0"] / run / "config.json").read_text(), run
        for name, e in m0["tensors"].items():
            if "sqnr_db" in e:
                assert abs(m1["tensors"][name]["sqnr_db"] - e["sqnr_db"]) < 1e-3
