"""GPTQ's `balance_tokens`: a top-up pool of further samples, forwarded after the calibration samples, from
which every expert routed fewer than N tokens takes the rows routed to it, in order, until it has N. Held
against a computation written here from the experts' inputs, the routing and the router's weight alone."""

import warnings

import pytest
import torch

from quantkit.calib import moe
from quantkit.calib.data import CalibrationWarning, load_calibration_data
from quantkit.calib.executor import LayerExecutor
from quantkit.calib.hessians import ExpertStats, HessianOptions
from quantkit.calib.spool import primary_tokens, run_calibrated
from quantkit.errors import CalibrationError, RecipeError
from quantkit.match.recipe import parse_recipe
from quantkit.testing import make_tiny_model

from calib.test_passes import TARGETS, recipe


def _data(n=4, t=40, pool=3, vocab=512):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        return load_calibration_data(None, vocab_size=vocab, num_samples=n, seq_len=t, pool_samples=pool)


def _reference(experts, router, calls, primary, balance, holdout):
    """(h_gu, h_down, counts, pool counts) in float64: the calibration rows (the first `primary` of the calls,
    in order) as routed rows less every holdout-th of each expert, or with `router` every row weighted by
    the router's softmax affinity; then the pool's rows, each expert under `balance` taking its routed rows
    in order (and with `router` every row, weighted) until the one that brings it to `balance`."""
    gu_w = experts.gate_up_proj.detach().double()
    n_exp, p, h = gu_w.shape
    half = p // 2
    i_dim = experts.down_proj.shape[-1]
    h_gu = torch.zeros(n_exp, h, h, dtype=torch.float64)
    h_down = torch.zeros(n_exp, i_dim, i_dim, dtype=torch.float64)
    counts = torch.zeros(n_exp, dtype=torch.long)
    pool = torch.zeros(n_exp, dtype=torch.long)
    x = torch.cat([c[0] for c in calls]).double()
    idx = torch.cat([c[1] for c in calls])
    aff = torch.softmax(x @ router.weight.detach().double().T, -1) if router is not None else None

    def add(e, rows, weights=None):
        xs = x[rows]
        d = torch.nn.functional.silu(xs @ gu_w[e, :half].T) * (xs @ gu_w[e, half:].T)
        a = torch.ones(len(rows), 1, dtype=torch.float64) if weights is None else weights[:, None]
        h_gu[e] += (xs * a).T @ xs
        h_down[e] += (d * a).T @ d

    for e in range(n_exp):
        routed = [t for t in range(primary) if e in idx[t].tolist()]
        held = {t for k, t in enumerate(routed) if holdout and k % holdout == holdout - 1}
        counts[e] = len(routed)
        if aff is None:
            rows = [t for t in routed if t not in held]
            if rows:
                add(e, rows)
        else:
            rows = [t for t in range(primary) if t not in held]
            add(e, rows, aff[rows, e])
        took, rows, n = [], [], int(counts[e])
        for t in range(primary, x.shape[0]):  # while it has fewer than `balance`, each pool row counts for it
            if n >= balance:
                break
            rows.append(t)
            if e in idx[t].tolist():
                took.append(t)
                n += 1
        counts[e] += len(took)
        pool[e] = len(took)
        if aff is None and took:
            add(e, took)
        elif aff is not None and rows:
            add(e, rows, aff[rows, e])
    return h_gu, h_down, counts, pool


@pytest.mark.parametrize("affinity", [False, True])
def test_top_up_against_an_independent_computation(tmp_path, affinity):
    path = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8, layers=2)
    data = _data()
    lengths = [len(s) for s in data.samples]
    # batches of 3 samples: [0, 1, 2], [3 | 4, 5] (across the boundary), [6]
    ex = LayerExecutor(path, batch_tokens=120)
    primary = primary_tokens(lengths, data.pool, ex.batch_tokens)
    assert primary == 4 * 40
    checked = 0
    for step in ex.layers(list(data.samples)):
        experts = next(m for m in step.layer.modules() if moe.is_routed_experts(m))
        router = step.layer.mlp.gate
        calls = []
        grab = experts.register_forward_pre_hook(lambda m, a: calls.append((a[0].detach().float().reshape(
            -1, a[0].shape[-1]).clone(), a[1].detach().clone())))
        plain = ExpertStats(experts, need_hessians=True, sample_tokens=64, options=HessianOptions(holdout=4))
        st0 = ExpertStats(experts, need_hessians=True, sample_tokens=64,
                          options=HessianOptions(holdout=4, primary_tokens=primary, balance_tokens=0))
        step.observe(stop_at=experts)
        plain.remove(), st0.remove()
        balance = int(st0.counts.float().median()) + 1  # about half the experts are topped up
        st = ExpertStats(experts, need_hessians=True, sample_tokens=64, options=HessianOptions(
            holdout=4, primary_tokens=primary, balance_tokens=balance, router=router if affinity else None))
        # fit_down: down_proj's statistics from the rows kept, the pool's included (one batch straddles it)
        fd = ExpertStats(experts, need_hessians=True, sample_tokens=64, options=HessianOptions(
            holdout=4, primary_tokens=primary, balance_tokens=balance, router=router if affinity else None,
            fit_down=True))
        step.observe(stop_at=experts)
        st.remove(), fd.remove(), grab.remove()
        step.forward()
        assert len(calls) == 6  # 3 batches, observed twice
        h_gu, h_down, counts, pool = _reference(experts, router if affinity else None, calls[3:], primary, balance, 4)
        assert torch.equal(st.counts, counts)
        assert torch.equal(st.pool_counts, pool)
        assert int((pool > 0).sum()) >= 2  # topped up
        assert bool((counts[pool > 0] <= balance).all()) and bool((counts == balance).any())  # never past it
        torch.testing.assert_close(st.h_gu.double(), h_gu, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(st.h_down.double(), h_down, rtol=1e-4, atol=1e-5)
        assert torch.equal(fd.h_gu, st.h_gu) and torch.equal(fd.counts, st.counts)
        for e in range(8):  # the unquantized gate/up on both sides, count 2: the unscaled sums
            w = experts.gate_up_proj[e].detach()
            hd, ad = fd.down_statistics(e, w, w, 2.0)
            torch.testing.assert_close(hd.double(), h_down[e], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ad, hd, rtol=0, atol=0)
        assert st.total == primary and st0.total == primary and plain.total == sum(lengths)
        # without a pool to read, the calibration rows' statistics are the plain ones over those rows
        assert torch.equal(st0.pool_counts, torch.zeros(8, dtype=torch.long))
        for e in range(8):  # the held-out rows are the calibration samples' only
            assert torch.equal(st.heldout_inputs(e)[0], st0.heldout_inputs(e)[0])
        checked += 1
    assert checked == 2
    ex.final.close()


def test_pool_samples_are_new_full_length_and_leave_the_calibration_samples_alone():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        base = load_calibration_data(None, vocab_size=512, num_samples=4, seq_len=32)
    data = _data(4, 32, pool=5)
    assert data.pool == 5 and data.num_samples == 4 and len(data.samples) == 9
    assert all(torch.equal(a, b) for a, b in zip(base.samples, data.samples[:4]))
    assert data.num_tokens == base.num_tokens and data.describe()["pool_samples"] == 5
    rows = {tuple(s.tolist()) for s in data.samples}
    assert len(rows) == 9 and all(len(s) == 32 for s in data.samples[4:])
    assert [s.tolist() for s in _data(4, 32, pool=5).samples] == [s.tolist() for s in data.samples]
    with pytest.warns(CalibrationWarning, match="top-up pool of 100000"):
        big = load_calibration_data(None, vocab_size=512, num_samples=4, seq_len=32, pool_samples=100000)
    assert 0 < big.pool < 100000 and "pool" in big.notes[-1]


def test_pool_order_is_checked():
    assert primary_tokens([40, 40, 40], 0, 120) is None
    assert primary_tokens([40, 40, 40], 1, 80) == 80
    with pytest.raises(CalibrationError, match="top-up pool"):
        primary_tokens([40, 40, 30], 1, 80)  # a short pool sample would be forwarded first


def test_pass_tops_up_starved_experts_only(tmp_path):
    src = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8, layers=2)
    data = _data(4, 32, pool=4)
    calib = list(data.samples[:4])
    plain = run_calibrated(src, recipe("gptq"), calib, tmp_path / "a")
    bal = run_calibrated(src, recipe("gptq", balance_tokens=40), list(data.samples), tmp_path / "b", pool=4)
    name = "model.layers.0.mlp.experts.{}.{}"
    topped = 0
    for e in range(8):
        a, b = plain["modules"][name.format(e, "gate_proj")], bal["modules"][name.format(e, "gate_proj")]
        if a["tokens"] >= 40:  # covered: the same statistics, the same solve
            assert "pool_tokens" not in b and b["tokens"] == a["tokens"]
            for kind in ("gate_proj", "up_proj", "down_proj"):
                assert bal["modules"][name.format(e, kind)] == plain["modules"][name.format(e, kind)]
        else:
            topped += 1
            assert b["tokens"] == a["tokens"] + b["pool_tokens"] and 0 < b["pool_tokens"] <= 40 - a["tokens"]
    assert topped >= 2
    assert any(m.get("pool_tokens") for n, m in bal["modules"].items() if ".layers.1." in n)


def test_balance_options_and_what_may_read_the_pool(tmp_path):
    assert recipe("gptq", balance_tokens=64).groups[0].options.balance_tokens == 64
    r = recipe("gptq", balance_tokens=64, balance_pool=16)
    assert r.balance_pool(128) == 16 and recipe("gptq", balance_tokens=64).balance_pool(128) == 128
    assert recipe("gptq").balance_pool(128) == 0
    for bad in (0, -1, '"5"', "true", 1.5, "[1]"):
        with pytest.raises(RecipeError, match="balance_tokens"):
            recipe("gptq", balance_tokens=bad)
    with pytest.raises(RecipeError, match="balance_pool"):
        recipe("gptq", balance_pool=8)
    for bad in (0, -3, '"8"', "false", 2.5):
        with pytest.raises(RecipeError, match="balance_pool"):
            recipe("gptq", balance_tokens=8, balance_pool=bad)
    with pytest.raises(RecipeError, match="balance_tokens"):
        recipe("awq", balance_tokens=8)
    two = (f"groups:\n  experts:\n    targets: {TARGETS}\n    method: gptq\n    scheme: {{group_size: 32}}\n"
           f"    options: {{balance_tokens: 8}}\n  attn:\n    targets: ['re:.*self_attn\\.o_proj$']\n"
           f"    method: gptq\n    scheme: {{group_size: 32}}\n")
    with pytest.raises(RecipeError, match="only one GPTQ group of routed experts"):
        parse_recipe(two)
    rtn_beside = two[:two.index("  attn:")] + "  attn:\n    targets: ['re:.*self_attn\\.o_proj$']\n    method: rtn\n"
    assert parse_recipe(rtn_beside).balance_pool(4) == 4  # an RTN group beside it reads nothing
    # one group reaching a dense module as well: refused by the pass, before any solve
    src = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8, layers=1)
    wide = parse_recipe("groups:\n  all:\n    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$', "
                        "'re:.*self_attn\\.o_proj$']\n    method: gptq\n    scheme: {group_size: 32}\n"
                        "    options: {balance_tokens: 8}\n")
    data = _data(2, 32, pool=2)
    with pytest.raises(CalibrationError, match="top-up pool"):
        run_calibrated(src, wide, list(data.samples), tmp_path / "w", pool=2)
