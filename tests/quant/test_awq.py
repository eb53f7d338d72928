"""AWQ math: grid searches pick what they should, and help where AWQ is meant to help."""

import pytest
import torch

from quantkit.quant.awq import clip_ratios, fake_quant, scale_candidates, search_clip, search_scales
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


def test_search_scales_coarse_to_fine():
    """stride 2: s = 1 and every other grid point, then per batch entry the neighbours of its best grid point.
    On a loss unimodal in the grid index it finds what the whole grid finds, with fewer loss calls; a tie goes
    to the lower candidate index, s = 1 first; stride 1 is the whole grid in one call per candidate."""
    n_grid, k = 10, 8
    x_mean, w_mean = torch.rand(4, k) + 0.5, torch.rand(4, k) + 0.5
    grid = torch.stack([torch.ones(4, k)] + [s for _, s in scale_candidates(x_mean, w_mean, n_grid)])  # [11, 4, K]
    target = torch.tensor([3, 8, 10, 1])  # each entry's best candidate index: grid points 2, 7, 9, 0

    def index_of(s):  # [4, K] -> the candidate index each entry was given
        hit = (grid == s[None]).all(-1)  # [11, 4]
        assert (hit.sum(0) >= 1).all()
        return hit.float().argmax(0)

    calls = []

    def loss(s):
        calls.append(1)
        i = index_of(s)
        return torch.where(i == 0, 100.0, (i - target).abs().float())  # s = 1 never wins here

    for stride, n_calls in [(1, 11), (2, 1 + 5 + 2), (3, 1 + 4 + 4)]:
        calls.clear()
        s, a, first = search_scales(x_mean, w_mean, loss, n_grid, stride=stride)
        assert len(calls) == n_calls, stride
        assert torch.equal(index_of(s), target) and torch.equal(s, grid[target, torch.arange(4)])
        assert torch.equal(a, (target - 1).double() / n_grid) and (first == 100).all()
    # grid point 7 (index 8) is best; with stride 2 the first round sees a tie between indices 7 and 9 and
    # refines around the lower one, which still reaches 8
    calls.clear()
    flat = lambda s: torch.where(index_of(s) == 0, 100.0, (index_of(s) - 8).abs().float().clamp(min=0.5))
    s, a, _ = search_scales(x_mean, w_mean, flat, n_grid, stride=2)
    assert (a == 0.7).all()
    # every candidate ties: s = 1 keeps it
    s, a, _ = search_scales(x_mean, w_mean, lambda s: torch.zeros(4), n_grid, stride=2)
    assert torch.equal(s, torch.ones(4, k)) and (a == -1).all()
    # a tie across the rounds: indices 6, 7 and 8 least, 7 found first (coarse), 6 and 8 by the refinement;
    # the lowest index wins as with the whole grid
    tie = lambda s: torch.where((index_of(s) - 7).abs() <= 1, 0.0, 1.0 + index_of(s).float())
    for stride in (1, 2):
        s, a, _ = search_scales(x_mean, w_mean, tie, n_grid, stride=stride)
        assert (a == 0.5).all(), stride


def test_search_clip_never_worse_than_no_clip():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(2, 16, 64, generator=gen) * 0.05
    w[:, :, 0] = 0.6  # an outlier weight makes clipping worth it for other rows' groups
    x = torch.randn(2, 64, 64, generator=gen)
    ratio = search_clip(w, x, 4, 32, True)
    assert ratio.shape == (2, 16, 2) and (ratio <= 15 / 14 + 1e-9).all() and (ratio >= 0.5 * 15 / 14 - 1e-9).all()

    def err(r):
        dq = fake_quant(w, 4, 32, True, r)
        return (torch.einsum("etk,enk->etn", x, w - dq)).square().sum()

    assert err(ratio) <= err(torch.ones_like(ratio)) + 1e-9


def test_clip_ratios_grid():
    """Symmetric 4-bit stores scale = absmax * r / 7.5: the grid starts where the absmax lands exactly on
    qmax = 7 (r = 15/14), shrinks in 1/n_grid steps to max_shrink of that, and always holds r = 1 (RTN)."""
    rs = clip_ratios(4, True, n_grid=20, max_shrink=0.5)
    assert rs[0] == pytest.approx(15 / 14) and 1.0 in rs and rs == sorted(rs, reverse=True)
    assert min(rs) >= 0.5 * 15 / 14 - 1e-9 and len(rs) == 12
    w = torch.tensor([[0.7, -0.1] + [0.0] * 30])
    assert fake_quant(w, 4, 32, True, torch.full((1, 1), rs[0]))[0, 0] == pytest.approx(0.7, rel=1e-2)
    assert clip_ratios(4, False, 20, 0.5)[0] == 1.0  # asymmetric ranges already map min/max onto the codes


def _clip_reference(w, x, ratios, num_bits=4, group=32, sym=True):
    """Brute force: per (row, group), the ratio minimizing that group's output error computed from the
    inputs directly; then the row guard against r = 1 on the whole row's output error."""
    e, n, k = w.shape
    gs = k // group
    best = torch.ones(e, n, gs)
    best_err = torch.full((e, n, gs), float("inf"), dtype=torch.float64)
    for r in [1.0] + [r for r in ratios if r != 1.0]:
        dq = fake_quant(w, num_bits, group, sym, torch.full((e, n, gs), r))
        for gi in range(gs):
            sl = slice(gi * group, (gi + 1) * group)
            err = torch.einsum("etk,enk->etn", x[..., sl].double(), (w - dq)[..., sl].double()).square().sum(1)
            better = err < best_err[..., gi]
            best_err[..., gi][better] = err[better]
            best[..., gi][better] = r

    def row_err(ratio):
        dq = fake_quant(w, num_bits, group, sym, ratio)
        return torch.einsum("etk,enk->etn", x.double(), (w - dq).double()).square().sum(1)

    best[~(row_err(best) < row_err(torch.ones_like(best)))] = 1.0
    return best


def test_search_clip_matches_brute_force_and_can_widen():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(2, 24, 64, generator=gen) * 0.05
    w[:, ::3, 5] = 0.4  # large positive weights: r = 1 puts them half a step above the top code
    x = torch.randn(2, 80, 64, generator=gen)
    x[:, :, 5] *= 8  # ... and their input channel matters most
    r = search_clip(w, x, 4, 32, True)
    ref = _clip_reference(w, x, clip_ratios(4, True))
    assert torch.equal(r, ref)
    assert (r[:, ::3, 0] > 1).float().mean() > 0.5  # the widened range wins where the absmax weight matters
    assert (r < 1).any()


def test_search_clip_weighted_tokens():
    """x_mask weights tokens: a token with weight 0 does not count, weight 2 counts as that token x 2."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(1, 16, 64, generator=gen) * 0.05
    x = torch.randn(1, 40, 64, generator=gen)
    m = torch.rand(1, 40, generator=gen).round() * 2
    assert torch.equal(search_clip(w, x, 4, 32, True, x_mask=m), search_clip(w, x * m[..., None], 4, 32, True))
    keep = m[0] > 0
    assert torch.equal(search_clip(w, x, 4, 32, True, x_mask=m), search_clip(w, 2 * x[:, keep], 4, 32, True))


def test_search_clip_chunked_over_experts_equals_whole(monkeypatch):
    from quantkit.quant import awq

    g = torch.Generator().manual_seed(3)
    w = torch.randn(5, 16, 64, generator=g) * 0.05
    x = torch.randn(5, 40, 64, generator=g)
    whole = awq.search_clip(w, x, 4, 32, True)
    monkeypatch.setattr(awq, "CLIP_GRAM_BYTES", 2 * 64 * 64 * 4)  # two experts per chunk
    assert torch.equal(awq.search_clip(w, x, 4, 32, True), whole)


def test_search_clip_row_chunks_do_not_change_the_result():
    # rows are independent: any chunking of them gives the same ratios, bit for bit
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3, 70, 128, generator=gen) * torch.rand(128, generator=gen) ** 2
    x = torch.randn(3, 90, 128, generator=gen)
    whole = search_clip(w, x, 4, 32, True, row_chunk=70)
    assert torch.equal(search_clip(w, x, 4, 32, True), whole)
    assert torch.equal(search_clip(w, x, 4, 32, True, row_chunk=9), whole)
    assert (whole != 1).any()  # the search clipped something: the comparison is not between all-ones


def test_fake_quant_into_a_buffer_and_in_place():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(2, 16, 64, generator=gen)
    for sym in (True, False):
        ref = fake_quant(w, 4, 32, sym)
        buf = torch.empty_like(w)
        assert fake_quant(w, 4, 32, sym, out=buf).data_ptr() == buf.data_ptr() and torch.equal(buf, ref)
        v = w.clone()
        assert torch.equal(fake_quant(v, 4, 32, sym, out=v), ref) and torch.equal(v, ref)
