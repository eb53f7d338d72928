"""GPTQ's `stats: affinity`: each expert's Hessians sum x x^T over every token (or the router's top-k' for it),
weighted by the router's affinity for that (token, expert) pair, while the forward follows the router.
Held against a computation written here from the experts' inputs and the router's weight alone."""

import warnings

import pytest
import torch

from quantkit.calib import moe
from quantkit.calib.data import CalibrationWarning, load_calibration_data
from quantkit.calib.executor import LayerExecutor
from quantkit.calib.hessians import ExpertStats, HessianOptions
from quantkit.calib.spool import run_calibrated
from quantkit.errors import RecipeError
from quantkit.match.recipe import affinity_experts
from quantkit.testing import make_tiny_model

from calib.test_passes import recipe


def _samples(n=4, t=40, vocab=512):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        return list(load_calibration_data(None, vocab_size=vocab, num_samples=n, seq_len=t).samples)


def _reference(experts, router, calls, top_k, holdout):
    """(h_gu [E, H, H], h_down [E, I, I], tokens per expert in the affinity set, held-out ones included) in
    float64, from the calls' (x, top-k index)."""
    w = router.weight.detach().double()
    bias = getattr(router, "e_score_correction_bias", None)
    gu_w = experts.gate_up_proj.detach().double()
    dn = experts.down_proj.detach()
    n_exp, p, h = gu_w.shape
    half = p // 2
    h_gu = torch.zeros(n_exp, h, h, dtype=torch.float64)
    h_down = torch.zeros(n_exp, dn.shape[-1], dn.shape[-1], dtype=torch.float64)
    tokens = torch.zeros(n_exp, dtype=torch.long)
    seen = [0] * n_exp
    for x, idx in calls:
        x = x.double()
        logits = x @ w.T
        if bias is None:
            aff = prefer = torch.softmax(logits, -1)
        else:
            aff = torch.sigmoid(logits)
            prefer = aff + bias.detach().double()
        take = torch.ones_like(aff, dtype=torch.bool)
        if top_k is not None:
            take = torch.zeros_like(take).scatter_(1, prefer.topk(top_k, -1).indices, True)
        held = torch.zeros_like(take)
        for t in range(x.shape[0]):  # every holdout-th routed token of an expert, counted over the pass
            for e in sorted(set(idx[t].tolist())):
                if holdout and seen[e] % holdout == holdout - 1:
                    held[t, e] = True
                seen[e] += 1
        for e in range(n_exp):
            m = take[:, e] & ~held[:, e]
            xs, a = x[m], aff[m, e][:, None]
            d = torch.nn.functional.silu(xs @ gu_w[e, :half].T) * (xs @ gu_w[e, half:].T)
            h_gu[e] += (xs * a).T @ xs
            h_down[e] += (d * a).T @ d
            tokens[e] += int(take[:, e].sum())
    return h_gu, h_down, tokens


@pytest.mark.parametrize("arch,top_k,holdout", [("qwen3_moe", None, 0), ("qwen3_moe", 3, 4),
                                                ("deepseek_v3", None, 4), ("deepseek_v3", 2, 0)])
def test_affinity_hessians_against_an_independent_computation(tmp_path, arch, top_k, holdout):
    path = make_tiny_model(arch, tmp_path / "src", experts=8, layers=2)
    ex = LayerExecutor(path, batch_tokens=80)  # two forward calls per layer: sums over batches
    checked = 0
    for step in ex.layers(_samples()):
        experts = next((m for m in step.layer.modules() if moe.is_routed_experts(m)), None)
        if experts is None:  # deepseek_v3's dense first layer
            step.forward()
            continue
        router = step.layer.mlp.gate
        if hasattr(router, "e_score_correction_bias"):  # a bias that changes which experts are preferred
            router.e_score_correction_bias.data.copy_(torch.linspace(-0.2, 0.2, 8))
        calls = []
        grab = experts.register_forward_pre_hook(lambda m, a: calls.append((a[0].detach().float().clone(),
                                                                          a[1].detach().clone())))
        st = ExpertStats(experts, need_hessians=True, sample_tokens=64,
                         options=HessianOptions(holdout=holdout, router=router, affinity_top_k=top_k))
        plain = ExpertStats(experts, need_hessians=True, sample_tokens=64, options=HessianOptions(holdout=holdout))
        step.observe(stop_at=experts)
        st.remove(), plain.remove(), grab.remove()
        step.forward()
        assert len(calls) >= 2
        h_gu, h_down, tokens = _reference(experts, router, calls, top_k, holdout)
        assert torch.equal(st.aff_counts, tokens)
        assert torch.equal(st.counts, plain.counts)  # the real routing still counts the routed tokens
        torch.testing.assert_close(st.h_gu.double(), h_gu, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(st.h_down.double(), h_down, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(st.h_gu, plain.h_gu, rtol=1e-2)  # not the routed tokens' Hessians
        if holdout:  # the held-out routed rows are the same rows with or without affinity
            rows = 0
            for e in range(8):
                a, b = st.heldout_inputs(e)[0], plain.heldout_inputs(e)[0]
                assert torch.equal(a, b)
                rows += len(a)
            assert rows > 0
        checked += 1
    assert checked >= 1
    ex.final.close()


def test_affinity_pass_records_its_tokens_and_changes_the_solve(tmp_path):
    src = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8, layers=1)
    data = load_calibration_data(None, vocab_size=512, num_samples=4, seq_len=32)
    total = sum(int(s.numel()) for s in data.samples)
    routed = run_calibrated(src, recipe("gptq", holdout=0), data.samples, tmp_path / "a")
    aff = run_calibrated(src, recipe("gptq", holdout=0, stats="affinity"), data.samples, tmp_path / "b")
    top3 = run_calibrated(src, recipe("gptq", holdout=0, stats="affinity", affinity_top_k=3), data.samples,
                          tmp_path / "c")
    name = "model.layers.0.mlp.experts.{}.gate_proj"
    for e in range(8):
        assert aff["modules"][name.format(e)]["affinity_tokens"] == total  # every token, every expert
        assert aff["modules"][name.format(e)]["tokens"] == routed["modules"][name.format(e)]["tokens"]
        assert "affinity_tokens" not in routed["modules"][name.format(e)]
    assert sum(top3["modules"][name.format(e)]["affinity_tokens"] for e in range(8)) == 3 * total
    # "nk": n times the router's top-k (2 here), the same statistics and solves as the integer it stands for
    twice = run_calibrated(src, recipe("gptq", holdout=0, stats="affinity", affinity_top_k="2k"), data.samples,
                           tmp_path / "d")
    top4 = run_calibrated(src, recipe("gptq", holdout=0, stats="affinity", affinity_top_k=4), data.samples,
                          tmp_path / "e")
    for e in range(8):
        a, b = twice["modules"][name.format(e)], top4["modules"][name.format(e)]
        assert (a["affinity_tokens"], a["sqnr_db"]) == (b["affinity_tokens"], b["sqnr_db"])
    assert sum(twice["modules"][name.format(e)]["affinity_tokens"] for e in range(8)) == 4 * total
    sq = [(routed["modules"][name.format(e)]["sqnr_db"], aff["modules"][name.format(e)]["sqnr_db"])
          for e in range(8)]
    assert any(a != b for a, b in sq)  # other Hessians, other solves


def test_affinity_options():
    assert recipe("gptq", stats="affinity").groups[0].options.stats == "affinity"
    assert recipe("gptq", stats="affinity", affinity_top_k=4).groups[0].options.affinity_top_k == 4
    assert recipe("gptq", stats="affinity", affinity_top_k="2k").groups[0].options.affinity_top_k == "2k"
    for bad in (0, -1, "0k", "k", "2K", "2.5k", "'2 k'", "true", 1.5, "9" * 5000 + "k"):
        with pytest.raises(RecipeError, match="affinity_top_k"):
            recipe("gptq", stats="affinity", affinity_top_k=bad)
    with pytest.raises(RecipeError, match="affinity"):
        recipe("awq", stats="affinity")
    with pytest.raises(RecipeError, match="applies to stats: affinity"):
        recipe("gptq", affinity_top_k=4)
    with pytest.raises(RecipeError, match="stats"):
        recipe("gptq", stats="weighted")


def test_affinity_experts_resolves_multiples_of_the_routers_top_k():
    assert affinity_experts(None, 8, 384) == 384  # every expert
    assert affinity_experts(16, 8, 384) == 16
    assert affinity_experts(16, 2, 8) == 8  # at most the experts there are
    assert affinity_experts("2k", 8, 384) == 16  # Kimi K2: top-8 of 384
    assert affinity_experts("2k", 4, 32) == 8
    assert affinity_experts("3k", 4, 8) == 8


def test_all_expert_affinities_are_in_token_order_and_skip_the_sort():
    """With every expert in the affinity set, each expert's pairs come in ascending token order already: the
    Routing says so and token_major returns them as they are, equal to the generic sort's result; with a
    top-k' it does not, and the sort runs."""
    from dataclasses import replace

    router = torch.nn.Linear(16, 6, bias=False)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(0))
    every = moe.router_affinities(router, x)
    assert every.token_sorted and every.top_k == 6
    tok, wt = every.token_major()
    ref_tok, ref_wt = replace(every, token_sorted=False).token_major()
    assert torch.equal(tok, ref_tok) and torch.equal(wt, ref_wt)
    some = moe.router_affinities(router, x, top_k=2)
    assert not some.token_sorted
    tok2, _ = some.token_major()
    for e, s, t in some.segments():  # each expert's tokens ascending after the sort
        assert torch.all(tok2[s:t][1:] > tok2[s:t][:-1])


@pytest.mark.parametrize("make", [lambda: torch.nn.Identity(), lambda: torch.nn.Linear(16, 5, bias=False),
                                  lambda: torch.nn.Linear(8, 6, bias=False)])
def test_a_router_without_a_matching_weight_is_refused_before_the_pass(make):
    """No weight, a weight for 5 experts where the layer has 6, a weight over 8 inputs where the hidden size is
    16: a named CalibrationError from ExpertStats up front, and the same rule in router_affinities."""
    from types import SimpleNamespace

    from quantkit.errors import CalibrationError

    experts = SimpleNamespace(gate_up_proj=torch.zeros(6, 8, 16), down_proj=torch.zeros(6, 16, 4),
                              register_forward_pre_hook=lambda hook: None)
    router = make()
    with pytest.raises(CalibrationError, match=r"stats: affinity needs the router's \[6, 16\] weight"):
        ExpertStats(experts, True, 0, options=HessianOptions(router=router))
    if not isinstance(getattr(router, "weight", None), torch.Tensor) or router.weight.shape[1] != 16:
        with pytest.raises(CalibrationError, match="stats: affinity needs the router's"):
            moe.router_affinities(router, torch.zeros(3, 16))
