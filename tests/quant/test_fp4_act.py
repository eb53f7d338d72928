"""NVFP4 activations (W4A4): the calibrated input global scale and the dynamic per-16 block quantization
(quant/fp4_act.py), against a brute-force reference written from the format's definition."""

from __future__ import annotations

import math

import pytest
import torch

from quantkit.quant.fp4_act import (CALIBRATED, LAYER_MAX, expert_input_scales, fake_quantize_act_nvfp4,
                                    input_global_scale, quantize_act_nvfp4)

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _nearest_e2m1(v: float) -> float:
    """The E2M1 magnitude nearest |v| (saturating at 6), ties to the even index, with v's sign."""
    a = min(abs(v), 6.0)
    d = (GRID - a).abs()
    best = [i for i in range(8) if d[i] == d.min()]
    i = best[0] if len(best) == 1 else next(j for j in best if j % 2 == 0)
    return math.copysign(float(GRID[i]), v)


def _reference(x: torch.Tensor, gs: float) -> torch.Tensor:
    """Element by element: block scale e4m3(min(gs * amax_b / 6, 448)) (float32 products), value
    nearest_e2m1(x / (s_b / gs)), result value * (s_b / gs)."""
    out = torch.empty_like(x, dtype=torch.float32)
    g = torch.tensor(gs, dtype=torch.float32)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], 16):
            blk = x[r, b:b + 16].float()
            s = (g * (blk.abs().max() * torch.tensor(1 / 6.0))).clamp(max=448.0).to(torch.float8_e4m3fn).float()
            step = s * (1.0 / g)
            inv = 1.0 / step if float(step) != 0 else torch.tensor(0.0)
            for j in range(16):
                q = _nearest_e2m1(float(blk[j] * inv))
                out[r, b + j] = torch.tensor(q, dtype=torch.float32) * (s / g)
    return out.to(x.dtype)


def test_global_scale_is_compressed_tensors_formula():
    amax = torch.tensor([1.0, 3.5, 1e-3])
    assert torch.equal(input_global_scale(amax), (448.0 * 6.0) / amax)
    assert input_global_scale(amax).dtype == torch.float32


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_global_scale_refuses_what_would_be_nan_inf_or_zero(bad):
    with pytest.raises(ValueError):
        input_global_scale(torch.tensor([1.0, bad]))


def test_global_scale_of_a_tiny_amax_stays_finite():
    gs = input_global_scale(torch.tensor([1e-40]))  # a float32 subnormal: 2688 / it overflows float32
    assert torch.isfinite(gs).all() and (gs > 0).all()


def test_experts_without_tokens_get_the_layers_largest_amax():
    amax = torch.tensor([2.0, 0.0, 5.0, 3.0, 0.0])
    tokens = torch.tensor([4, 0, 7, 0, 3])  # expert 3: a stale amax without tokens; expert 4: all-zero inputs
    scales, used, src = expert_input_scales(amax, tokens)
    assert src == [CALIBRATED, LAYER_MAX, CALIBRATED, LAYER_MAX, LAYER_MAX]
    assert used.tolist() == [2.0, 5.0, 5.0, 5.0, 5.0]
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert torch.equal(scales, 2688.0 / used)
    # the smallest scale of the layer (what FlashInfer backends share) is unchanged by the fallback
    assert float(scales.min()) == float(scales[2])


def test_no_expert_calibrated_or_nan_is_an_error():
    with pytest.raises(ValueError, match="no calibration token"):
        expert_input_scales(torch.zeros(3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="NaN or Inf"):
        expert_input_scales(torch.tensor([1.0, float("nan")]), torch.tensor([1, 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_fake_quant_matches_the_definition(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 64, generator=gen) * 2).to(dtype)
    x[0, :16] = 0  # an all-zero block: scale 0, values 0
    x[1, 16:32] *= 50  # beyond the calibrated amax: block scale saturates at 448, values at +-6
    gs = float(input_global_scale(x[2:].float().abs().amax().reshape(1)))
    got = fake_quantize_act_nvfp4(x, torch.tensor([gs]))
    assert got.dtype == dtype
    assert torch.equal(got, _reference(x, gs))
    assert torch.equal(got[0, :16], torch.zeros(16, dtype=dtype))


def test_per_row_global_scales_equal_row_by_row():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, generator=gen)
    gs = torch.tensor([[100.0], [800.0], [2688.0], [31.0]])
    got = fake_quantize_act_nvfp4(x, gs)
    for r in range(4):
        assert torch.equal(got[r:r + 1], fake_quantize_act_nvfp4(x[r:r + 1], gs[r]))


def test_codes_and_scales_decode_to_the_fake_quantized_values():
    from quantkit.quant.fp4 import decode_e2m1

    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2))
    gs = torch.tensor([500.0])
    codes, s = quantize_act_nvfp4(x, gs)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and s.shape == (3, 3)
    assert torch.equal(s, s.to(torch.float8_e4m3fn).float())  # the block scales are e4m3 values
    v = decode_e2m1(codes).unflatten(-1, (-1, 16)) * (s / gs).unsqueeze(-1)
    assert torch.equal(v.flatten(-2), fake_quantize_act_nvfp4(x, gs))
