"""Fitted FP4 scales (quant/fp4.py `scale_search="mse"`): judged against a brute-force search written
with the public quantize / dequantize functions, one candidate at a time."""

from __future__ import annotations

import pytest
import torch

from quantkit.pack.fp4 import dequantize_module
from quantkit.quant import fp4


def _int4_grid(e, n, k, levels=7, seed=0):
    """Weights on Kimi's INT4 grid: per group of 32, q in [-levels, levels] times amax / levels (bf16)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(e, n, k, generator=g) * 0.02).unflatten(-1, (-1, 32))
    s = (w.abs().amax(-1, keepdim=True) / levels).to(torch.bfloat16).float()
    return (torch.round(w / s).clamp(-levels, levels) * s).flatten(-2).to(torch.bfloat16)


def test_arithmetic_rounding_equals_the_e2m1_encoder():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, 0.0])
    bf = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()  # every bf16 >= 0
    x = torch.cat([ties, bf, torch.rand(100_000) * 8, torch.nextafter(ties, torch.zeros(())),
                   torch.nextafter(ties, torch.full((), 1e38))])
    assert torch.equal(fp4.round_e2m1_magnitude(x), fp4.round_to_e2m1(x))


def _brute_force(w, kind, gs=None):
    """Per-group squared error of the best candidate, trying each offset with the public functions."""
    weight = torch.ones(w.shape[0], w.shape[-1])
    return _weighted_candidate_errors(w, kind, gs, weight).amin(0).sum((-2, -1)).double()


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("source", ["int4", "gauss"])
def test_fitted_scales_are_the_best_candidate_and_never_worse(kind, source):
    w = _int4_grid(3, 32, 128) if source == "int4" else (torch.randn(3, 32, 128) * 0.02).to(torch.bfloat16)
    gs = fp4.choose_global_scale(w) if kind == "nvfp4" else None
    amax = fp4.rtn_nvfp4(w, gs) if kind == "nvfp4" else fp4.rtn_mxfp4(w)
    fit = fp4.rtn_nvfp4(w, gs, "mse") if kind == "nvfp4" else fp4.rtn_mxfp4(w, "mse")
    assert amax.noise_amax is None and torch.allclose(fit.noise_amax, amax.noise, rtol=1e-6)
    assert torch.equal(fit.global_scale, amax.global_scale) if kind == "nvfp4" else fit.global_scale is None
    assert torch.allclose(fit.noise, _brute_force(w, kind, gs), rtol=1e-6)
    assert (fit.noise <= amax.noise).all()
    # the stored bytes mean what the result says: decoded as the format says, the error is `noise`
    t = {"weight_packed": fit.packed, "weight_scale": fit.scale}
    if kind == "nvfp4":
        t["weight_global_scale"] = fit.global_scale
    d = dequantize_module(kind, t, torch.float32)
    assert torch.allclose((d - w.float()).square().sum((-2, -1)).double(), fit.noise, rtol=1e-6)


def test_fitted_nvfp4_gains_on_the_15_level_grid():
    """The figure docs/format.md states: NVFP4 against a 15-level INT4 grid, fitted vs amax."""
    w = _int4_grid(4, 128, 512)
    fit = fp4.rtn_nvfp4(w, None, "mse")
    gain = 10 * torch.log10(fit.noise_amax.sum() / fit.noise.sum())
    assert gain > 2.0


def test_scale_search_is_an_fp4_and_int4_option():
    from quantkit.errors import RecipeError
    from quantkit.match.recipe import Scheme

    assert Scheme(4, "float", True, "tensor_group", scale_search="mse").scale_search == "mse"
    assert Scheme(4, "int", True, "group", 32, scale_search="mse").scale_search == "mse"  # RTN's clipping search
    assert Scheme(4, "int", False, "group", 32, scale_search="mse").scale_search == "mse"  # and its range's
    with pytest.raises(RecipeError, match="FP4 and INT4"):
        Scheme(8, "int", True, "group", 32, scale_search="mse")
    with pytest.raises(RecipeError, match="FP4 and INT4"):
        Scheme(8, "float", True, "channel", scale_search="mse")
    with pytest.raises(RecipeError, match="amax or mse"):
        Scheme(4, "float", True, "group", scale_search="best")


def _weighted_candidate_errors(w, kind, gs, weight):
    """[C, E, N, G]: each candidate offset's per-group squared error weighted per input column, from the
    public quantize / dequantize functions."""
    errs = []
    if kind == "nvfp4":
        amax_scale, offsets = fp4.choose_qparams_nvfp4(w, gs).scale.view(torch.uint8).int(), fp4.NV_SEARCH
    else:
        amax_scale, offsets = fp4.choose_qparams_mxfp4(w).int(), fp4.MX_SEARCH
    for off in offsets:
        if kind == "nvfp4":
            sc = (amax_scale + off).clamp(1, 0x7E).to(torch.uint8).view(torch.float8_e4m3fn)
            eff = fp4.effective_scale_nvfp4(sc, gs)
        else:
            sc = torch.where(amax_scale == 0, 0, (amax_scale + off).clamp(0, 254)).to(torch.uint8)
            eff = fp4.effective_scale_mxfp4(sc)
        d = fp4.dequantize_fp4(fp4.quantize_fp4(w, eff), eff, torch.float32)
        e = (d - w.float()).square() * weight[:, None, :]
        errs.append(e.unflatten(-1, (eff.shape[-1], -1)).sum(-1))
    return torch.stack(errs)


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_weighted_fit_is_the_best_candidate_under_the_weights(kind):
    """fit_scales with a per-column weight (GPTQ's Hessian diagonal) picks, per group, a candidate whose
    weighted error is the least; unweighted it is RTN's `scale_search: mse`; the weights change picks."""
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(3, 16, 128, generator=g) * 0.02).to(torch.bfloat16)
    weight = torch.rand(3, 128, generator=g).pow(4) * 10 + 1e-3  # far from uniform
    if kind == "nvfp4":
        gs = fp4.choose_global_scale(w)
        amax = fp4.choose_qparams_nvfp4(w, gs).scale
        fitted = fp4.fit_scales(w, amax, gs, weight)
        assert torch.equal(fp4.fit_scales(w, amax, gs).view(torch.uint8), fp4.rtn_nvfp4(w, gs, "mse").scale.view(torch.uint8))
        eff = fp4.effective_scale_nvfp4(fitted, gs)
    else:
        gs = None
        amax = fp4.choose_qparams_mxfp4(w)
        fitted = fp4.fit_scales(w, amax, None, weight)
        assert torch.equal(fp4.fit_scales(w, amax), fp4.rtn_mxfp4(w, "mse").scale)
        eff = fp4.effective_scale_mxfp4(fitted)
    d = fp4.dequantize_fp4(fp4.quantize_fp4(w, eff), eff, torch.float32)
    got = ((d - w.float()).square() * weight[:, None, :]).unflatten(-1, (eff.shape[-1], -1)).sum(-1)
    cands = _weighted_candidate_errors(w, kind, gs, weight)
    assert torch.allclose(got, cands.amin(0), rtol=1e-5, atol=0)
    unweighted = fp4.fit_scales(w, amax, gs)
    as_bytes = (lambda s: s.view(torch.uint8)) if kind == "nvfp4" else (lambda s: s)
    assert not torch.equal(as_bytes(fitted), as_bytes(unweighted))


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_gptq_fp4_observer_mse_fits_its_grid(kind):
    """GPTQ on an FP4 grid with `observer: mse` fixes the scales fitted under the Hessians' diagonals before
    the sweep (it was silently amax before); with minmax the amax scales."""
    from quantkit.calib.gptq_pass import _solve
    from quantkit.quant.gptq import GPTQArgs
    from quantkit.match.recipe import Scheme

    g = torch.Generator().manual_seed(5)
    w = torch.randn(2, 32, 64, generator=g) * 0.02
    x = torch.randn(512, 64, generator=g) * (torch.rand(64, generator=g) * 4)
    h = (x.T @ x / 512).expand(2, 64, 64).clone()
    s = Scheme(num_bits=4, type="float", symmetric=True, strategy="tensor_group" if kind == "nvfp4" else "group",
               group_size=16 if kind == "nvfp4" else 32)
    r_mse, grid_mse = _solve(w, h, s, GPTQArgs(4, s.group_size, observer="mse"))
    r_mm, grid_mm = _solve(w, h, s, GPTQArgs(4, s.group_size))
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    as_bytes = (lambda t: t.view(torch.uint8)) if kind == "nvfp4" else (lambda t: t)
    if kind == "nvfp4":
        amax = fp4.choose_qparams_nvfp4(w)
        want = fp4.fit_scales(w, amax.scale, amax.global_scale, diag)
    else:
        amax = fp4.choose_qparams_mxfp4(w)
        want = fp4.fit_scales(w, amax, None, diag)
    assert torch.equal(as_bytes(grid_mse.scale), as_bytes(want))
    assert torch.equal(as_bytes(grid_mm.scale), as_bytes(amax.scale if kind == "nvfp4" else amax))
    assert not torch.equal(as_bytes(grid_mse.scale), as_bytes(grid_mm.scale))
