"""GPTQ's `fit_unquantized`: each routed expert fitted to what the unquantized model computes for the same
tokens (asymmetric calibration). Its statistics are held against a float64 computation written here from the
experts' inputs, the unquantized model's inputs and the routing; its target against a least-squares solve;
the pass against plain GPTQ where the two must agree (layer 0, whose inputs are the same in both models) and
where they must not. `fit_down` (down_proj alone, to its unquantized gate/up on the same inputs, no second
stream) against the same computation, plain GPTQ and fit_unquantized's layer 0."""

import json

import pytest
import torch

from quantkit.calib import moe
from quantkit.calib.executor import LayerExecutor
from quantkit.calib.hessians import ExpertStats, HessianOptions
from quantkit.calib.layer import statistics_bytes
from quantkit.calib.spool import _read_progress, reference_name, run_calibrated
from quantkit.errors import CalibrationError, RecipeError
from quantkit.match.recipe import parse_recipe
from quantkit.quant.gptq import GPTQArgs, gptq
from quantkit.testing import make_tiny_model

from calib.test_passes import TARGETS, recipe, spool_weights


def _samples(n=4, t=40, vocab=512, seed=3):
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, vocab, (n, t), generator=g))


def _reference(experts, router, calls, refs, holdout, quantized_gu):
    """(h_gu, a_gu, h_down, a_down, held-out reference rows) in float64, unscaled sums: each expert's routed
    rows less every holdout-th (or with `router` every row but those, weighted by its softmax affinity);
    X its rows of the quantized model's inputs, R the unquantized model's: h_gu = X^T X, a_gu = R^T X;
    D = act(X G_q^T) * (X U_q^T) under `quantized_gu`, D_r the same of R under the unquantized gate/up:
    h_down = D^T D, a_down = D_r^T D."""
    gu = experts.gate_up_proj.detach().double()
    gq = quantized_gu.double()
    n_exp, p, h = gu.shape
    half, i_dim = p // 2, experts.down_proj.shape[-1]
    x = torch.cat([c[0] for c in calls]).double()
    r = torch.cat(refs).double()
    idx = torch.cat([c[1] for c in calls])
    aff = torch.softmax(x @ router.weight.detach().double().T, -1) if router is not None else None
    out = [torch.zeros(n_exp, h, h, dtype=torch.float64) for _ in range(2)]
    out += [torch.zeros(n_exp, i_dim, i_dim, dtype=torch.float64) for _ in range(2)]
    held_ref = []

    def down(rows, w):
        return torch.nn.functional.silu(rows @ w[:half].T) * (rows @ w[half:].T)

    for e in range(n_exp):
        routed = [t for t in range(x.shape[0]) if e in idx[t].tolist()]
        held = [t for k, t in enumerate(routed) if holdout and k % holdout == holdout - 1]
        rows = [t for t in (routed if aff is None else range(x.shape[0])) if t not in held]
        held_ref.append(r[held])
        if not rows:
            continue
        wt = torch.ones(len(rows), 1, dtype=torch.float64) if aff is None else aff[rows, e][:, None]
        xs, rs = x[rows], r[rows]
        d, dr = down(xs, gq[e]), down(rs, gu[e])
        out[0][e] = (xs * wt).T @ xs
        out[1][e] = (rs * wt).T @ xs
        out[2][e] = (d * wt).T @ d
        out[3][e] = (dr * wt).T @ d
    return (*out, held_ref)


@pytest.mark.parametrize("affinity", [False, True])
@pytest.mark.parametrize("mode", ["fit_unquantized", "fit_down"])
def test_fit_statistics_against_an_independent_computation(tmp_path, affinity, mode):
    """fit_unquantized: gate/up's cross-Grams with a stream unlike the quantized one, down_proj's statistics
    from the quantized gate/up against the unquantized gate/up on that stream, its held-out rows. fit_down: no
    second stream, gate/up's Hessians only (plain GPTQ's), nothing of down_proj's summed in the forward, then
    its statistics against the unquantized gate/up on the same rows (the reference with the quantized
    model's inputs as the other stream)."""
    path = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8, layers=1)
    ex = LayerExecutor(path, batch_tokens=80)  # 2 calls of 2 samples
    for step in ex.layers(_samples()):
        experts = next(m for m in step.layer.modules() if moe.is_routed_experts(m))
        router = step.layer.mlp.gate
        calls = []
        grab = experts.register_forward_pre_hook(lambda m, a: calls.append((a[0].detach().float().reshape(
            -1, a[0].shape[-1]).clone(), a[1].detach().clone())))
        refs = None
        if mode == "fit_unquantized":
            _, seen = ex.forward_capture(step.layer, step.inputs, experts)
            assert len(seen) == 2 and all(s.shape == (80, ex.hidden_size) for s in seen)
            g = torch.Generator().manual_seed(1)
            refs = [s + 0.05 * torch.randn(s.shape, generator=g) for s in seen]  # unlike the quantized stream
        st = ExpertStats(experts, need_hessians=True, sample_tokens=64, options=HessianOptions(
            holdout=4, router=router if affinity else None, reference=None if refs is None else list(refs),
            fit_down=mode == "fit_down"))
        step.observe(stop_at=experts)
        st.remove(), grab.remove()
        if mode == "fit_unquantized":
            assert len(calls) == 4  # forward_capture's, then the statistics'
            calls = calls[2:]
            assert all(torch.equal(c[0], s) for c, s in zip(calls, seen))  # the same rows in both forwards
        else:
            assert len(calls) == 2 and st.a_gu is None and not st.h_down.any()
            assert all(torch.equal(k[0], c[0]) and k[1] is None for k, c in zip(st.kept, calls))
            refs = [c[0] for c in calls]
        quantized = experts.gate_up_proj.detach().float() * 0.9 + 0.01  # any other gate/up weights
        h_gu, a_gu, h_down, a_down, held_ref = _reference(experts, router if affinity else None, calls, refs, 4,
                                                          quantized)
        torch.testing.assert_close(st.h_gu.double(), h_gu, rtol=1e-4, atol=1e-4)
        if mode == "fit_unquantized":
            torch.testing.assert_close(st.a_gu.double(), a_gu, rtol=1e-4, atol=1e-4)
            assert not torch.equal(st.a_gu, st.h_gu)
        counts = st.aff_counts if affinity else st.counts
        for e in range(8):
            hd, ad = st.down_statistics(e, quantized[e], experts.gate_up_proj[e].detach(), float(counts[e]))
            scale = 2.0 / max(float(counts[e]), 1.0)
            torch.testing.assert_close(hd.double(), h_down[e] * scale, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ad.double(), a_down[e] * scale, rtol=1e-4, atol=1e-5)
            assert not torch.allclose(ad, hd)
            if mode == "fit_unquantized":
                torch.testing.assert_close(st.heldout_reference(e).double(), held_ref[e])
        assert sum(len(r) for r in held_ref) > 0
        step.forward()
    ex.final.close()


@pytest.mark.parametrize("actorder", [True, False])
def test_fitted_target_is_the_least_squares_fit(actorder):
    """GPTQ's `fit`: the weights it quantizes are the least-squares fit to the other model's outputs at alpha
    1, the midpoint at 0.5, W itself at 0 or when both streams are equal; its codes are those of a plain
    solve of those weights."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 400, 16, generator=g, dtype=torch.float64)  # the quantized model's inputs, 3 experts
    r = x + 0.3 * torch.randn(x.shape, generator=g, dtype=torch.float64)  # the unquantized model's
    w = torch.randn(3, 8, 16, generator=g)
    h, a = (x.transpose(1, 2) @ x).float(), (r.transpose(1, 2) @ x).float()

    def solve(a_, alpha):
        return gptq(w, h, GPTQArgs(4, 16, True, damp=1e-9, actorder=actorder), fit=(a_, torch.tensor(alpha)))

    want = torch.linalg.lstsq(x, r @ w.double().transpose(1, 2)).solution.transpose(1, 2)  # min |X W'^T - R W^T|
    full = solve(a, [1.0, 1.0, 1.0])
    torch.testing.assert_close(full.target.double(), want, rtol=1e-4, atol=1e-4)
    mixed = solve(a, [0.5, 0.0, 1.0])
    torch.testing.assert_close(mixed.target[0].double(), (w[0].double() + want[0]) / 2, rtol=1e-4, atol=1e-4)
    assert torch.equal(mixed.target[1], w[1])  # alpha 0: W itself
    torch.testing.assert_close(mixed.target[2], full.target[2], rtol=0, atol=0)
    assert torch.equal(solve(h, [1.0, 1.0, 1.0]).target, w)  # the same streams: W itself
    plain = gptq(full.target, h, GPTQArgs(4, 16, True, damp=1e-9, actorder=actorder))
    assert torch.equal(full.q, plain.q) and torch.equal(full.qparams.scale, plain.qparams.scale)


def test_fit_pass_against_plain_gptq(tmp_path):
    """Layer 0's inputs are the embeddings in both models: its gate/up targets are their own weights and
    their codes are plain GPTQ's; its down_proj's statistics come from the quantized gate/up, so they are
    not; every later layer differs. The manifest records the held-out errors against the same target."""
    src = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8, layers=2)
    samples = _samples(6, 48)
    plain = run_calibrated(src, recipe("gptq"), samples, tmp_path / "a")
    fit = run_calibrated(src, recipe("gptq", fit_unquantized=0.5), samples, tmp_path / "b")
    wa, wb = spool_weights(tmp_path / "a", plain), spool_weights(tmp_path / "b", fit)
    assert sorted(wa) == sorted(wb) and len(wa) == 2 * 8 * 3
    for n in wa:
        same = torch.equal(wa[n], wb[n])
        if ".layers.0." in n and ("gate_proj" in n or "up_proj" in n):
            assert same, n
    for layer in (0, 1):
        diff = [n for n in wa if f".layers.{layer}." in n and "down_proj" in n and not torch.equal(wa[n], wb[n])]
        assert len(diff) >= 4, (layer, diff)
    assert sum(not torch.equal(wa[n], wb[n]) for n in wa if ".layers.1." in n and "gate_proj" in n) >= 4
    m = fit["modules"]["model.layers.1.mlp.experts.0.down_proj"]
    assert m["heldout"]["tokens"] > 0 and m["heldout"]["kept"] in ("solve", "rtn", "retry")
    # every expert module records the fit (none fell back here); plain GPTQ's record nothing of it
    assert all(m.get("fit_unquantized") == 0.5 for m in fit["modules"].values())
    assert not any("fit_unquantized" in m for m in plain["modules"].values())
    assert not list((tmp_path / "b").glob("reference-*"))  # the stream's files end with the pass
    # experts whose statistics come from every token (min_tokens fallback) are solved as plain GPTQ
    low = run_calibrated(src, recipe("gptq", fit_unquantized=0.5, min_tokens=100000), samples, tmp_path / "c")
    low_plain = run_calibrated(src, recipe("gptq", min_tokens=100000), samples, tmp_path / "d")
    assert not any("fit_unquantized" in m for m in low["modules"].values())
    wc, wd = spool_weights(tmp_path / "c", low), spool_weights(tmp_path / "d", low_plain)
    assert all(torch.equal(wc[n], wd[n]) for n in wc)


def test_fit_resumes_with_the_unquantized_stream(tmp_path, monkeypatch):
    """Interrupted at layer 2, the pass resumes there from both streams and ends with the same results; a
    progress record without the unquantized stream (written by a plain pass) is not trusted by it."""
    import quantkit.calib.spool as cq

    src = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8, layers=3)
    samples = _samples(4, 40)
    r = recipe("gptq", fit_unquantized=0.5)
    ref = run_calibrated(src, r, samples, tmp_path / "ref")
    real, calls, fail = cq.quantize_layer, [], [True]

    def dies_at_layer_2(ckpt, recipe_, step, log=lambda m: None, **kw):
        calls.append(step.index)
        if step.index == 2 and fail[0]:
            raise RuntimeError("killed")
        return real(ckpt, recipe_, step, log, **kw)

    monkeypatch.setattr(cq, "quantize_layer", dies_at_layer_2)
    spool = tmp_path / "q"
    with pytest.raises(RuntimeError, match="killed"):
        run_calibrated(src, r, samples, spool)
    rec = json.loads((spool / cq.PROGRESS_NAME).read_text())
    assert rec["next_layer"] == 2 and rec["reference"] == "reference-00002.bin"
    assert sorted(p.name for p in spool.glob("reference-*")) == ["reference-00002.bin"]
    fail[0], calls[:] = False, []
    got = run_calibrated(src, r, samples, spool)
    assert calls == [2]
    assert got == ref
    wa, wb = spool_weights(tmp_path / "ref", ref), spool_weights(spool, got)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)

    # a plain pass's record names no unquantized stream: the fitting pass starts over
    fail[0], calls[:] = True, []
    plain_spool = tmp_path / "p"
    with pytest.raises(RuntimeError, match="killed"):
        run_calibrated(src, recipe("gptq"), samples, plain_spool)
    fail[0], calls[:] = False, []
    got = run_calibrated(src, r, samples, plain_spool)
    assert calls == [0, 1, 2] and got == ref
    # and a record naming a stream whose file is gone: the same
    fail[0], calls[:] = True, []
    with pytest.raises(RuntimeError, match="killed"):
        run_calibrated(src, r, samples, tmp_path / "g")
    (tmp_path / "g" / "reference-00002.bin").unlink()
    fail[0], calls[:] = False, []
    assert run_calibrated(src, r, samples, tmp_path / "g") == ref and calls == [0, 1, 2]


@pytest.mark.parametrize("key", ["fit_unquantized", "fit_down"])
def test_fit_options_and_where_they_are_refused(tmp_path, key):
    assert getattr(recipe("gptq", **{key: 0.5}).groups[0].options, key) == 0.5
    assert getattr(recipe("gptq", **{key: 1}).groups[0].options, key) == 1.0
    assert getattr(recipe("gptq", **{key: 0}).groups[0].options, key) == 0.0
    assert getattr(recipe("gptq").groups[0].options, key) == 0.0
    for bad in (-0.1, 1.5, "true", '"0.5"', ".nan", "[1]"):
        with pytest.raises(RecipeError, match=key):
            recipe("gptq", **{key: bad})
    with pytest.raises(RecipeError, match=key):
        recipe("awq", **{key: 0.5})
    with pytest.raises(RecipeError, match="cannot be combined"):
        recipe("gptq", fit_down=0.5, fit_unquantized=0.5)
    src = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8, layers=1)
    wide = parse_recipe(f"groups:\n  all:\n    targets: {TARGETS[:-1]}, 're:.*self_attn\\.o_proj$']\n"
                        f"    method: gptq\n    scheme: {{group_size: 32}}\n    options: {{{key}: 0.5}}\n")
    with pytest.raises(CalibrationError, match=f"{key} applies to routed experts only"):
        run_calibrated(src, wide, _samples(2, 32), tmp_path / "w")
    if key == "fit_unquantized":  # the second stream: no pool, no sparse attention (fit_down: both run)
        with pytest.raises(RecipeError, match="balance_tokens"):
            recipe("gptq", fit_unquantized=0.5, balance_tokens=16)
        dsa = make_tiny_model("glm_moe_dsa", tmp_path / "dsa", layers=2)
        with pytest.raises(CalibrationError, match="sparse attention"):
            run_calibrated(dsa, recipe("gptq", fit_unquantized=0.5), _samples(2, 32), tmp_path / "d")
    else:
        assert recipe("gptq", fit_down=0.5, balance_tokens=16).groups[0].options.balance_tokens == 16


def test_fit_memory_is_planned(tmp_path):
    """The memory plan counts what the fit holds beyond plain GPTQ: at least the cross-Grams (exactly the
    Hessians' size), both streams' expert inputs of every call (float32) and the unquantized model's hidden
    states entering and leaving the layer. fit_down: down_proj's cross-Grams and one stream's expert inputs,
    less than that."""
    path = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8, layers=1)
    ex = LayerExecutor(path)
    layer = ex.load_layer(0)
    lengths = [40] * 4
    args = (0, layer, ex.device, ex.dtype, ex.call_tokens(lengths), lengths)
    plain = statistics_bytes(ex.ckpt, recipe("gptq"), *args)
    fit = statistics_bytes(ex.ckpt, recipe("gptq", fit_unquantized=0.5), *args)
    assert "fit" not in plain and {k: v for k, v in fit.items() if k != "fit"} == plain
    st = ExpertStats(layer.mlp.experts, need_hessians=True, sample_tokens=64, options=HessianOptions(reference=[]))
    grams = sum(t.numel() * t.element_size() for t in (st.a_gu, st.a_down))
    st.remove()
    assert fit["fit"] >= grams + 2 * 160 * ex.hidden_size * 4 + 2 * 160 * ex.hidden_size * ex.dtype.itemsize
    down = statistics_bytes(ex.ckpt, recipe("gptq", fit_down=0.5), *args)
    assert {k: v for k, v in down.items() if k != "fit"} == plain
    st = ExpertStats(layer.mlp.experts, need_hessians=True, sample_tokens=64, options=HessianOptions(fit_down=True))
    assert st.a_gu is None
    grams = st.a_down.numel() * st.a_down.element_size()
    st.remove()
    assert grams + 160 * ex.hidden_size * 4 <= down["fit"] < fit["fit"]
    ex.free_layer(0)


@pytest.mark.parametrize("arch", ["deepseek_v3", "mixtral"])
def test_fit_pass_on_other_families(tmp_path, arch):
    """A dense first layer (DeepSeek-V3: forwarded in both streams, nothing to fit), a noaux_tc router, and
    Mixtral's block_sparse_moe names: every expert module is written, and past the first MoE layer the
    fitted solves differ from plain GPTQ's."""
    src = make_tiny_model(arch, tmp_path / "src", experts=8, layers=3)
    samples = _samples(4, 40)
    plain = run_calibrated(src, recipe("gptq"), samples, tmp_path / "a")
    fit = run_calibrated(src, recipe("gptq", fit_unquantized=0.5), samples, tmp_path / "b")
    wa, wb = spool_weights(tmp_path / "a", plain), spool_weights(tmp_path / "b", fit)
    assert sorted(wa) == sorted(wb) and len(wa) > 0
    layers = sorted({int(n.split(".layers.")[1].split(".")[0]) for n in wa})
    last = [n for n in wa if f".layers.{layers[-1]}." in n]
    assert sum(not torch.equal(wa[n], wb[n]) for n in last) >= len(last) // 2


def test_a_distributed_record_names_each_ranks_stream(tmp_path):
    """Under torchrun each rank saves its own part of the unquantized stream: the record names rank 0's file
    for the world size, and each rank resumes only from its own (a rank whose file is missing starts over)."""
    spool = tmp_path
    lengths = [8, 8]
    for n in ("layer-00000-rank0-of-2", "layer-00000-rank1-of-2"):
        (spool / f"{n}.json").write_text("{}")
        (spool / f"{n}.safetensors").write_bytes(b"")
    rec = {"next_layer": 1, "activations": "activations-00001-rank0-of-2.bin", "world": 2, "batch_tokens": 8,
           "lengths": lengths, "hidden": 4, "dtype": "torch.float32", "reference": reference_name(1, 0, 2),
           "index": {"layers": ["layer-00000-rank0-of-2", "layer-00000-rank1-of-2"], "modules": {}, "overrides": []}}
    (spool / "progress.json").write_text(json.dumps(rec))
    for r in (0, 1):
        (spool / f"activations-00001-rank{r}-of-2.bin").write_bytes(b"")
    (spool / reference_name(1, 0, 2)).write_bytes(b"")
    args = (spool, 3, lengths, 4, torch.float32, 8)
    got = _read_progress(*args, 0, 2, reference=True)
    assert got is not None and got[3] == spool / "reference-00001-rank0-of-2.bin"
    assert _read_progress(*args, 1, 2, reference=True) is None  # rank 1's part is missing
    (spool / reference_name(1, 1, 2)).write_bytes(b"")
    assert _read_progress(*args, 1, 2, reference=True)[3] == spool / "reference-00001-rank1-of-2.bin"
    assert _read_progress(*args, 0, 2, reference=False) is None  # a plain pass does not take a fitting record
    (spool / "progress.json").write_text(json.dumps({**rec, "reference": "../reference-00001-rank0-of-2.bin"}))
    assert _read_progress(*args, 0, 2, reference=True) is None


# `fit_down`: each expert's down_proj alone fitted to the outputs of its unquantized gate/up, on the same inputs


def test_fit_down_pass_against_plain_gptq_and_fit_unquantized(tmp_path):
    """Layer 0's inputs are the embeddings in both models, so there fit_unquantized fits gate/up to their own
    weights and down_proj to the unquantized gate/up's outputs on the same inputs: what fit_down does, byte
    for byte, without the second stream. Against plain GPTQ, layer 0's gate/up are the same and its
    down_proj are not; the manifest records fit_down on down_proj only; no stream file is ever written."""
    src = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8, layers=2)
    samples = _samples(6, 48)
    plain = run_calibrated(src, recipe("gptq"), samples, tmp_path / "a")
    down = run_calibrated(src, recipe("gptq", fit_down=0.5), samples, tmp_path / "b")
    both = run_calibrated(src, recipe("gptq", fit_unquantized=0.5), samples, tmp_path / "c")
    wa, wb, wc = (spool_weights(tmp_path / d, i) for d, i in (("a", plain), ("b", down), ("c", both)))
    assert sorted(wa) == sorted(wb) == sorted(wc) and len(wa) == 2 * 8 * 3
    layer0 = [n for n in wa if ".layers.0." in n]
    assert all(torch.equal(wb[n], wc[n]) for n in layer0)
    assert all(torch.equal(wa[n], wb[n]) for n in layer0 if "down_proj" not in n)
    assert sum(not torch.equal(wa[n], wb[n]) for n in layer0 if "down_proj" in n) >= 4
    # layer 1: fit_unquantized also undoes layer 0's error in gate/up's inputs, fit_down does not
    assert sum(not torch.equal(wb[n], wc[n]) for n in wa if ".layers.1." in n and "gate_proj" in n) >= 4
    mods = down["modules"]
    assert all(m.get("fit_down") == 0.5 for n, m in mods.items() if n.endswith("down_proj"))
    assert not any("fit_down" in m for n, m in mods.items() if not n.endswith("down_proj"))
    assert not any("fit_unquantized" in m for m in mods.values())
    assert mods["model.layers.1.mlp.experts.0.down_proj"]["heldout"]["tokens"] > 0
    assert not list((tmp_path / "b").glob("reference-*"))
    # experts whose statistics come from every token (min_tokens fallback) are solved as plain GPTQ
    low = run_calibrated(src, recipe("gptq", fit_down=0.5, min_tokens=100000), samples, tmp_path / "d")
    low_plain = run_calibrated(src, recipe("gptq", min_tokens=100000), samples, tmp_path / "e")
    assert not any("fit_down" in m for m in low["modules"].values())
    wd, we = spool_weights(tmp_path / "d", low), spool_weights(tmp_path / "e", low_plain)
    assert all(torch.equal(wd[n], we[n]) for n in wd)


def test_fit_down_runs_where_fit_unquantized_is_refused(tmp_path):
    """GLM-5's DeepSeek sparse attention refuses a second stream; fit_down carries none, so it runs there.
    (Without the held-out check, which on so few tokens keeps RTN for most experts of both runs.)"""
    dsa = make_tiny_model("glm_moe_dsa", tmp_path / "dsa", layers=2, experts=8)
    samples = _samples(4, 40)
    plain = run_calibrated(dsa, recipe("gptq", holdout=0), samples, tmp_path / "a")
    down = run_calibrated(dsa, recipe("gptq", holdout=0, fit_down=0.5), samples, tmp_path / "b")
    wa, wb = spool_weights(tmp_path / "a", plain), spool_weights(tmp_path / "b", down)
    assert sorted(wa) == sorted(wb)
    downs = [n for n in wa if "experts" in n and "down_proj" in n]
    assert downs and sum(not torch.equal(wa[n], wb[n]) for n in downs) >= len(downs) // 2
    assert any(m.get("fit_down") == 0.5 for m in down["modules"].values())
