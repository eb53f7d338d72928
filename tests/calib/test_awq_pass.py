"""What keeps AWQ's searches cheap, against direct computations: the norm-scale search's two rounds (every
candidate on a token subset, then the finalists and s = 1 on every token), the per-expert down-scale loss as
a quadratic form (equal to the router-weighted output error computed token by token), and the MoE block
outputs recorded by the statistics pass (equal to running the block again)."""

import warnings

import torch

from quantkit.calib import awq_pass
from quantkit.calib.awq_pass import _search_norm_scale, down_scale_loss
from quantkit.calib.data import CalibrationWarning, load_calibration_data
from quantkit.calib.executor import LayerExecutor
from quantkit.calib.hessians import ExpertStats
from quantkit.match.recipe import Scheme
from quantkit.quant.awq import fake_quant, scale_candidates


def _candidates(x_mean, w_mean, n_grid):
    return [torch.ones_like(x_mean)] + [s for _, s in scale_candidates(x_mean, w_mean, n_grid)]


def _index(cands, s):
    return next(i for i, c in enumerate(cands) if torch.equal(c, s))


def _norm_search_case(monkeypatch, seed: int):
    """1000 tokens of width 16, a 10-point grid; the subset round on 64 tokens, 2 finalists."""
    monkeypatch.setattr(awq_pass, "NORM_SEARCH_TOKENS", 64)
    monkeypatch.setattr(awq_pass, "NORM_SEARCH_FINALISTS", 2)
    g = torch.Generator().manual_seed(seed)
    n_grid, h = 10, 16
    x = torch.randn(1000, h, generator=g).abs() + 0.1
    fp_out = torch.randn(1000, h, generator=g)
    x_mean, w_mean = x.abs().mean(0), torch.rand(h, generator=g) + 0.1
    return n_grid, x, fp_out, x_mean, w_mean, _candidates(x_mean, w_mean, n_grid)


def test_norm_search_two_rounds(monkeypatch):
    n_grid, x, fp_out, x_mean, w_mean, cands = _norm_search_case(monkeypatch, seed=0)
    seen = []

    def run(sub_loss, full_loss):
        seen.clear()

        def loss_on(s, xs, ref):
            i = _index(cands, s)
            seen.append((i, xs.shape[0]))
            if xs.shape[0] == 64:  # the strided subset, with its reference outputs
                assert torch.equal(ref, fp_out[torch.linspace(0, 999, 64).round().long()])
                return torch.tensor(sub_loss[i])
            assert xs is x and ref is fp_out
            return torch.tensor(full_loss[i])

        return _search_norm_scale(x_mean, w_mean, loss_on, x, fp_out, n_grid)

    # the subset ranks 5 first and 7 second; on every token 7 is better: 7 wins, s = 1 was tried again too
    sub = [9.0] * len(cands)
    sub[5], sub[7] = 1.0, 2.0
    full = [8.0] * len(cands)
    full[5], full[7] = 3.0, 2.5
    s, a = run(sub, full)
    assert torch.equal(s, cands[7]) and a == 6 / n_grid
    assert sorted(i for i, n in seen if n == 64) == list(range(len(cands)))
    assert sorted(i for i, n in seen if n == 1000) == [0, 5, 7]
    # s = 1 is the worst on the subset but the best on every token: plain RTN wins (a = -1)
    sub = [float(len(cands) - i) for i in range(len(cands))]
    sub[0] = 100.0
    full = [5.0] * len(cands)
    full[0] = 1.0
    s, a = run(sub, full)
    assert torch.equal(s, cands[0]) and a == -1.0
    # ties: the earlier candidate (s = 1 first), as search_scales
    s, a = run([1.0] * len(cands), [1.0] * len(cands))
    assert a == -1.0
    # few tokens: one round, exactly search_scales over every candidate
    x_small = x[:64]
    seen.clear()
    s, a = _search_norm_scale(x_mean, w_mean, lambda s, xs, ref: seen.append(xs.shape[0]) or
                              torch.tensor(float(_index(cands, s) != 4)), x_small, fp_out[:64], n_grid)
    assert seen == [64] * len(cands) and torch.equal(s, cands[4])


def test_norm_search_coarse_to_fine(monkeypatch):
    """grid_stride 2: the subset round tries s = 1 and every other grid point, then the neighbours of the best
    grid point; the finalists come from both; with few tokens both rounds run on every token."""
    n_grid, x, fp_out, x_mean, w_mean, cands = _norm_search_case(monkeypatch, seed=3)
    seen = []

    def loss_on(s, xs, ref):  # unimodal in the candidate index, least at 8 (grid point 7); s = 1 worst
        i = _index(cands, s)
        seen.append((i, xs.shape[0]))
        return torch.tensor(50.0 if i == 0 else abs(i - 8) + (0.5 if xs.shape[0] == 1000 and i == 8 else 0.0))

    s, a = _search_norm_scale(x_mean, w_mean, loss_on, x, fp_out, n_grid, stride=2)
    sub = [i for i, n in seen if n == 64]
    assert sorted(sub[:6]) == [0, 1, 3, 5, 7, 9] and sorted(sub[6:]) == [6, 8]
    # finalists on every token: s = 1 and the subset's two best (8, then 7 before 9 on the tie)
    assert sorted(i for i, n in seen if n == 1000) == [0, 7, 8]
    assert torch.equal(s, cands[8]) and a == 7 / n_grid  # 8 costs 0.5 on all tokens, 7 costs 1
    # few tokens: both rounds on every token, no finalists round; the same pick as the whole grid
    seen.clear()
    s2, a2 = _search_norm_scale(x_mean, w_mean, loss_on, x[:64], fp_out[:64], n_grid, stride=2)
    assert len(seen) == 8 and {n for _, n in seen} == {64}
    s1, a1 = _search_norm_scale(x_mean, w_mean, loss_on, x[:64], fp_out[:64], n_grid, stride=1)
    assert a2 == a1 == 7 / n_grid and torch.equal(s2, s1)


def test_down_scale_loss_is_the_weighted_output_error():
    g = torch.Generator().manual_seed(1)
    e, t, h, i = 3, 50, 64, 32
    he = torch.randn(e, t, i, generator=g)
    dn = torch.randn(e, h, i, generator=g) * 0.05
    wt = torch.rand(e, t, generator=g)
    wt[:, 40:] = 0  # padding
    scheme = Scheme(num_bits=4, group_size=32, symmetric=True)
    loss = down_scale_loss(he, wt, dn, scheme)
    for _ in range(3):
        s = torch.rand(e, i, generator=g) + 0.5
        dq = fake_quant(dn * s[:, None, :], 4, 32, True) / s[:, None, :]
        out_err = torch.bmm(he, dq.transpose(1, 2)) - torch.bmm(he, dn.transpose(1, 2))  # [e, t, H]
        direct = (out_err.double().square() * wt.double().square()[..., None]).sum((1, 2)) / wt.double().square().sum(1)
        torch.testing.assert_close(loss(s).double(), direct, rtol=1e-4, atol=0)


def test_block_outputs_recorded_by_the_statistics_pass(tiny_models):
    path = tiny_models("deepseek_v3", layers=2, experts=8)  # a shared expert: part of the block's output
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        samples = list(load_calibration_data(None, vocab_size=512, num_samples=4, seq_len=32).samples)
    ex = LayerExecutor(path, batch_tokens=64)
    for step in ex.layers(samples):
        if step.index == 0:
            continue
        mlp = step.layer.mlp
        stats = ExpertStats(mlp.experts, need_hessians=False, sample_tokens=100, block=mlp)  # 100 of 128 tokens
        step.forward()
        stats.remove()
        x, _ = stats.samples()
        y = stats.block_outputs()
        assert x.shape == y.shape == (100, 128)
        with torch.no_grad():
            ref = awq_pass._mlp_out(mlp, x, mlp.experts.gate_up_proj.dtype)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
        bare = ExpertStats(mlp.experts, False, 10)
        assert bare.block_outputs() is None  # no block hooked
        bare.remove()
    ex.final.close()
