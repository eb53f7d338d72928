"""AWQ math: grid searches pick what they should, and help where AWQ is meant to help."""

import torch

from quantkit.quant.awq import fake_quant, scale_candidates, search_clip, search_scales
from quantkit.quant.int4 import dequantize, rtn


def test_fake_quant_equals_rtn_without_clip():
    w = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(0))
    for sym in (True, False):
        r = rtn(w, 4, 32, sym)
        assert torch.equal(fake_quant(w, 4, 32, sym), dequantize(r.q, r.qparams.scale, r.qparams.zero_point))


def test_scale_candidates_normalized():
    x, w = torch.rand(2, 16) + 0.1, torch.rand(2, 16) + 0.1
    for a, s in scale_candidates(x, w, 10):
        assert torch.allclose(s.amax(-1) * s.amin(-1), torch.ones(2), rtol=1e-5)
    first = next(scale_candidates(x, w, 10))[1]
    assert torch.allclose(first, (1 / w) / (1 / w).amax(-1, keepdim=True).mul((1 / w).amin(-1, keepdim=True)).sqrt())


def test_search_scales_reduces_output_error_with_outlier_channels():
    """Inputs with a few large channels: protecting them by scaling (and folding 1/s into x) beats RTN."""
    gen = torch.Generator().manual_seed(1)
    e, n, k, t = 2, 32, 128, 256
    w = torch.randn(e, n, k, generator=gen) * 0.05
    x = torch.randn(e, t, k, generator=gen)
    x[:, :, :4] *= 30  # salient channels
    y = torch.einsum("etk,enk->etn", x, w)

    def loss(s):  # [E, K] -> [E]
        wq = fake_quant(w * s[:, None, :], 4, 32, True) / s[:, None, :]
        return (torch.einsum("etk,enk->etn", x, wq) - y).square().mean((1, 2))

    s, a, loss_identity = search_scales(x.abs().mean(1), w.abs().mean(1), loss)
    rtn_loss = loss(torch.ones(e, k))
    best = loss(s)
    assert torch.allclose(loss_identity.float(), rtn_loss)
    assert (best <= loss_identity + 1e-12).all() and (best < 0.9 * rtn_loss).all()
    assert (a >= 0).all()
    # power-of-two scales are exact to fold into binary floats
    s2, _, _ = search_scales(x.abs().mean(1), w.abs().mean(1), loss, power_of_two=True)
    assert torch.equal(torch.exp2(torch.round(torch.log2(s2))), s2) and (loss(s2) < rtn_loss).all()


def test_search_scales_never_worse_than_no_scaling():
    """When scaling cannot help (the loss is minimal at s = 1), the search returns s = 1."""
    x_mean, w_mean = torch.rand(3, 16) + 0.5, torch.rand(3, 16) + 0.5
    s, a, _ = search_scales(x_mean, w_mean, lambda s: (s - 1).square().sum(-1))
    assert torch.equal(s, torch.ones(3, 16)) and (a == -1).all()


def test_search_clip_never_worse_than_no_clip():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(2, 16, 64, generator=gen) * 0.05
    w[:, :, 0] = 0.6  # an outlier weight makes clipping worth it for other rows' groups
    x = torch.randn(2, 64, 64, generator=gen)
    ratio = search_clip(w, x, 4, 32, True)
    assert ratio.shape == (2, 16, 2) and (ratio <= 1).all() and (ratio >= 0.5).all()

    def err(r):
        dq = fake_quant(w, 4, 32, True, r)
        return (torch.einsum("etk,enk->etn", x, w - dq)).square().sum()

    assert err(ratio) <= err(torch.ones_like(ratio)) + 1e-9
