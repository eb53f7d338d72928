"""Layer-streamed GPTQ/AWQ on tiny MoE models: better than RTN where it should be, every expert packed
even when it saw no calibration tokens, fallbacks recorded."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from quantkit.calib.data import load_calibration_data
from quantkit.calib.spool import run_calibrated
from quantkit.read.safetensors import SafetensorsFile
from quantkit.quant.int4 import dequantize, rtn
from quantkit.pack.int4 import unpack_int4
from quantkit.match.recipe import parse_recipe
from quantkit.testing import load_model, make_tiny_model

TARGETS = r"['re:.*experts\.\d+\.(gate|up|down)_proj$', 're:.*block_sparse_moe\.experts\.\d+\.w[123]$']"


def recipe(method, group=32, **opts):
    o = "".join(f"\n      {k}: {v}" for k, v in opts.items())
    return parse_recipe(f"groups:\n  experts:\n    targets: {TARGETS}\n    method: {method}\n"
                        f"    scheme: {{group_size: {group}}}\n" + (f"    options:{o}\n" if opts else ""))


def spool_weights(spool, index):
    """Dequantized per-expert weights and overrides from a spool, keyed by on-disk tensor name."""
    out = {}
    for name in index["layers"]:
        with SafetensorsFile(spool / f"{name}.safetensors") as f:
            sd = {k: f.get(k) for k in f.header.tensors}
        meta = json.loads((spool / f"{name}.json").read_text())
        mods = {k[: -len(".weight_packed")] for k in sd if k.endswith(".weight_packed")}
        for m in mods:
            n, k = sd[f"{m}.weight_shape"].tolist()
            out[m + ".weight"] = dequantize(unpack_int4(sd[f"{m}.weight_packed"], k), sd[f"{m}.weight_scale"])
        for o in meta["overrides"]:
            out[o] = sd[o].float()
    return out


def substitute(model, weights):
    params = dict(model.named_parameters())
    for name, w in weights.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$", name)
        if m is None:
            params[name.replace(".block_sparse_moe.", ".mlp.")].data.copy_(w)
            continue
        prefix, e, kind = m[1].replace(".block_sparse_moe.", ".mlp."), int(m[2]), m[3]
        if kind in ("gate_proj", "w1", "up_proj", "w3"):
            p = params[f"{prefix}.gate_up_proj"]
            half = p.shape[1] // 2
            rows = slice(0, half) if kind in ("gate_proj", "w1") else slice(half, 2 * half)
            p.data[e, rows].copy_(w)
        else:
            params[f"{prefix}.down_proj"].data[e].copy_(w)


def rtn_weights(src_model):
    """The same model with every routed expert RTN-quantized (g32 symmetric), for comparison."""
    for pname, p in src_model.named_parameters():
        if pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj"):
            r = rtn(p.detach().float(), 4, 32, True)
            deq = dequantize(r.q, r.qparams.scale)
            p.data.copy_(deq)
    return src_model


def kl(a, b):
    return F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1), log_target=True, reduction="batchmean").item()


@pytest.mark.parametrize("arch,method", [("qwen3_moe", "gptq"), ("deepseek_v3", "gptq"), ("qwen3_moe", "awq"),
                                         ("mixtral", "awq")])
def test_calibrated_beats_rtn(tmp_path, arch, method):
    src = make_tiny_model(arch, tmp_path / "src")
    data = load_calibration_data(None, vocab_size=512, num_samples=16, seq_len=64)
    index = run_calibrated(src, recipe(method), data.samples, tmp_path / "spool")
    w = spool_weights(tmp_path / "spool", index)
    ref = load_model(src).eval()
    q = load_model(src).eval()
    substitute(q, w)
    r = rtn_weights(load_model(src).eval())
    ids = torch.stack(list(data.samples[:8]))  # the calibration distribution
    with torch.no_grad():
        lr, lq, lrtn = ref(ids).logits, q(ids).logits, r(ids).logits
    assert kl(lr, lq) < kl(lr, lrtn), (kl(lr, lq), kl(lr, lrtn))
    for meta in index["modules"].values():
        assert meta["method"] in (method, "rtn") and meta["scheme"] == "int4-g32-sym"


def test_experts_without_tokens_are_quantized_and_reported(tmp_path):
    src = make_tiny_model("qwen3_moe", tmp_path / "src", experts=16)
    samples = [torch.tensor([1, 2, 3])]  # 3 tokens x top-2 = at most 6 of 16 experts routed per layer
    index = run_calibrated(src, recipe("gptq"), samples, tmp_path / "spool")
    mods = index["modules"]
    assert len(mods) == 2 * 16 * 3  # every expert of every layer, all three projections
    zero = [m for m, e in mods.items() if e["tokens"] == 0]
    assert len(zero) >= 3 * 10
    for m in zero:
        assert "Hessian from all tokens" in mods[m]["fallback"]
    w = spool_weights(tmp_path / "spool", index)
    assert all(torch.isfinite(t).all() for t in w.values())
    index2 = run_calibrated(src, recipe("gptq", fallback="rtn"), samples, tmp_path / "spool2")
    assert all(index2["modules"][m]["method"] == "rtn" for m in zero)
    index3 = run_calibrated(src, recipe("awq"), samples, tmp_path / "spool3")
    assert len(index3["modules"]) == 2 * 16 * 3
    assert all(torch.isfinite(t).all() for t in spool_weights(tmp_path / "spool3", index3).values())


def _routed_inputs(model, samples, layer):
    """Every (gate/up input, expert) pair of decoder layer `layer`'s routed experts over `samples`, in the
    order the calibrated pass counts them (sample by sample, ascending position), from a plain forward."""
    seen = []
    experts = model.model.layers[layer].mlp.experts

    def hook(mod, args):
        x, idx = args[0].detach().float().reshape(-1, args[0].shape[-1]), args[1].reshape(args[0].shape[0], -1)
        seen.append((x, idx))

    h = experts.register_forward_pre_hook(hook)
    with torch.no_grad():
        for s in samples:
            model(s[None])
    h.remove()
    return experts, seen


@pytest.mark.parametrize("ids", ["text", "random"])
def test_heldout_check_against_an_independent_computation(tmp_path, ids):
    """Every 4th token routed to an expert is held out; the manifest's held-out errors of GPTQ and RTN equal
    the ones computed here from a plain forward's expert inputs and the written weights; a module keeps RTN's
    codes exactly where RTN's held-out error is smaller."""
    src = make_tiny_model("deepseek_v3", tmp_path / "src", experts=8)  # layer 1 is the only MoE layer
    data = load_calibration_data(None, vocab_size=512, num_samples=6, seq_len=32)
    samples = data.samples if ids == "text" else \
        list(torch.randint(0, 512, (6, 32), generator=torch.Generator().manual_seed(0)))
    index = run_calibrated(src, recipe("gptq", holdout=4), samples, tmp_path / "spool")
    w = spool_weights(tmp_path / "spool", index)
    experts, seen = _routed_inputs(load_model(src).eval(), samples, 1)
    held = {e: [] for e in range(8)}
    count = [0] * 8
    for x, idx in seen:
        for t in range(x.shape[0]):
            for e in sorted(set(idx[t].tolist())):
                if count[e] % 4 == 3:
                    held[e].append(x[t])
                count[e] += 1
    half = experts.gate_up_proj.shape[1] // 2
    kinds = retries = 0
    for e in range(8):
        x = torch.stack(held[e]) if held[e] else torch.zeros(0, experts.gate_up_proj.shape[-1])
        gu = experts.gate_up_proj[e].detach().float()
        d = experts.act_fn(x @ gu[:half].T) * (x @ gu[half:].T)
        for kind, inp, wt in (("gate", x, gu[:half]), ("up", x, gu[half:]),
                              ("down", d, experts.down_proj[e].detach().float())):
            name = f"model.layers.1.mlp.experts.{e}.{kind}_proj"
            meta = index["modules"][name]
            assert meta["heldout"]["tokens"] == len(held[e])
            assert meta["tokens"] == count[e]
            if not held[e]:
                continue
            r = rtn(wt, 4, 32, True)
            w_rtn = dequantize(r.q, r.qparams.scale)
            ref = (inp @ wt.T).double().square().sum()
            got = w[name + ".weight"]
            err = float((inp @ (wt - got).T).double().square().sum() / ref)
            err_rtn = float((inp @ (wt - w_rtn).T).double().square().sum() / ref)
            h = meta["heldout"]
            assert h["rtn"] == pytest.approx(err_rtn, rel=1e-3)
            retried = [r["error"] for r in h.get("retries", [])]
            if retried:  # re-solved with a higher damping only where RTN beat the first solve on some part
                retries += 1
                assert [r["damping"] for r in h["retries"]] == sorted(r["damping"] for r in h["retries"])
            if meta["method"] == "rtn":
                assert h["kept"] == "rtn" and torch.equal(got, w_rtn)
                assert h["rtn"] < min([h["gptq"]] + retried)
            else:
                kept = h["gptq"] if h["kept"] == "solve" else min(retried)
                assert h["kept"] in ("solve", "retry") and kept == pytest.approx(err, rel=1e-3)
                assert kept <= min([h["rtn"], h["gptq"]] + retried)
            kinds += 1
    assert kinds >= 12
    if ids == "random":  # few tokens per expert, unlike text: RTN beats some first solve, the re-solves run
        assert retries > 0


def test_heldout_check_keeps_the_better_per_module():
    """The check itself: where GPTQ's codes are worse on the held-out rows, that module gets RTN's codes and
    scales exactly; where they tie, GPTQ's result stays."""
    from types import SimpleNamespace

    from quantkit.calib.gptq_pass import _heldout_check
    from quantkit.quant.int4 import QParams

    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 8, 64, generator=g) * 0.05  # 2 experts, gate rows 0-3, up rows 4-7
    r = rtn(w, 4, 32, True)
    q, qp = r.q.clone(), QParams(r.qparams.scale.clone(), None)
    q[0, :4] = (q[0, :4] + 3).clamp(-8, 7)  # expert 0's gate: far from RTN
    s = SimpleNamespace(num_bits=4, group_size=32, symmetric=True)
    parts = (("gate", slice(0, 4)), ("up", slice(4, 8)))
    xs = [torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)]
    out = _heldout_check(w, q, qp, None, s, parts, torch.zeros(2, dtype=torch.bool), [(x, None) for x in xs])
    assert out[0]["gate"]["method"] == "rtn" and out[0]["up"]["method"] == "gptq"
    assert out[1]["gate"]["method"] == "gptq" and out[0]["gate"]["heldout"]["tokens"] == 5
    assert torch.equal(q, r.q) and torch.equal(qp.scale, r.qparams.scale)


def test_heldout_check_keeps_the_best_retry():
    """Where RTN beats the first solve, `retry` runs once per RETRY_DAMPING factor for those experts only; a
    part takes the codes and scales of the candidate with the least held-out error (errors recomputed here),
    and the manifest fields say which (kept, damping, the retries' errors)."""
    from types import SimpleNamespace

    from quantkit.calib import gptq_pass
    from quantkit.quant.gptq import GPTQArgs, gptq
    from quantkit.quant.int4 import QParams

    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 8, 64, generator=g) * 0.05
    xs = [torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g)]
    r = rtn(w, 4, 32, True)
    q, qp = r.q.clone(), QParams(r.qparams.scale.clone(), None)
    q[0] = (q[0] + 2).clamp(-8, 7)  # expert 0: both parts far worse than RTN; expert 1: RTN's own codes
    calls = []

    def retry(sub, factor):  # a "solve" fitted to the held-out rows themselves: better than RTN on them
        calls.append((list(sub), factor))
        hs = torch.stack([xs[j].T @ xs[j] for j in sub]) * (2.0 / 6)
        res = gptq(w[sub], hs, GPTQArgs(4, 32, True, damp=0.01 * factor))
        return res.q, res.qparams, res.damping

    s = SimpleNamespace(num_bits=4, group_size=32, symmetric=True)
    parts = (("gate", slice(0, 4)), ("up", slice(4, 8)))
    out = gptq_pass._heldout_check(w, q, qp, None, s, parts, torch.zeros(2, dtype=torch.bool),
                                   [(x, None) for x in xs], retry=retry)
    assert calls == [([0], f) for f in gptq_pass.RETRY_DAMPING]
    assert "retries" not in out[1]["gate"]["heldout"] and out[1]["gate"]["heldout"]["kept"] == "solve"
    cands = [retry([0], f) for f in gptq_pass.RETRY_DAMPING]
    for kind, rows in parts:
        x = xs[0]
        ref = float((x @ w[0, rows].T).double().square().sum())
        errs = [float((x @ (w[0, rows] - dequantize(c[0][0, rows], c[1].scale[0, rows])).T).double().square().sum())
                / ref for c in cands]
        h = out[0][kind]["heldout"]
        assert [e["error"] for e in h["retries"]] == pytest.approx(errs, rel=1e-5)
        best = min(range(len(errs)), key=lambda i: errs[i])
        assert errs[best] < h["rtn"] < h["gptq"]  # the fitted solve beats RTN on its own rows
        assert h["kept"] == "retry" and out[0][kind]["method"] == "gptq"
        assert out[0][kind]["damping"] == pytest.approx(float(cands[best][2][0]), rel=1e-5)
        assert torch.equal(q[0, rows], cands[best][0][0, rows])
        assert torch.equal(qp.scale[0, rows], cands[best][1].scale[0, rows])
    assert torch.equal(q[1], r.q[1])


def test_holdout_option():
    from quantkit.errors import RecipeError

    assert recipe("gptq").groups[0].options.holdout == 8
    assert recipe("gptq", holdout=0).groups[0].options.holdout == 0
    with pytest.raises(RecipeError, match="holdout"):
        recipe("gptq", holdout=1)


def test_observer_option():
    from quantkit.errors import RecipeError

    assert recipe("gptq").groups[0].options.observer == "minmax"
    assert recipe("gptq", observer="mse").groups[0].options.observer == "mse"
    with pytest.raises(RecipeError, match="observer"):
        recipe("gptq", observer="max")


def test_refit_scales_option():
    from quantkit.errors import RecipeError

    assert recipe("gptq").groups[0].options.refit_scales is False
    assert recipe("gptq", refit_scales="true").groups[0].options.refit_scales is True
    for bad in ('"yes"', "1", "[true]"):
        with pytest.raises(RecipeError, match="refit_scales"):
            recipe("gptq", refit_scales=bad)
    asym = parse_recipe(f"groups:\n  experts:\n    targets: {TARGETS}\n    method: gptq\n"
                        "    scheme: {group_size: 32, symmetric: false}\n    options: {refit_scales: true}\n")
    assert asym.groups[0].options.refit_scales and not asym.groups[0].scheme.symmetric
    with pytest.raises(RecipeError, match="refit_scales applies to INT4"):
        parse_recipe(f"groups:\n  experts:\n    targets: {TARGETS}\n    method: gptq\n"
                     "    scheme: {num_bits: 4, type: float, symmetric: true, strategy: tensor_group, group_size: 16}\n"
                     "    options: {refit_scales: true}\n")
    with pytest.raises(RecipeError, match="refit_scales"):
        recipe("awq", refit_scales="true")


def _layer1_expert_modules(src, samples):
    """(weight name, the inputs routed to it, its source weight) of every expert module of decoder layer 1 of
    the tiny deepseek_v3 `src`, from a plain forward over `samples` (the down inputs from the source gate/up)."""
    experts, seen = _routed_inputs(load_model(src).eval(), samples, 1)
    half = experts.gate_up_proj.shape[1] // 2
    for e in range(experts.gate_up_proj.shape[0]):
        x = torch.cat([xb[(ib == e).any(-1)] for xb, ib in seen])
        gu = experts.gate_up_proj[e].detach().float()
        d = experts.act_fn(x @ gu[:half].T) * (x @ gu[half:].T)
        for kind, inp, wt in (("gate", x, gu[:half]), ("up", x, gu[half:]),
                              ("down", d, experts.down_proj[e].detach().float())):
            yield f"model.layers.1.mlp.experts.{e}.{kind}_proj.weight", inp, wt


def test_refine_sweeps_option():
    from quantkit.errors import RecipeError

    assert recipe("gptq").groups[0].options.refine_sweeps == 0
    assert recipe("gptq", refine_sweeps="2").groups[0].options.refine_sweeps == 2
    for bad in ('"2"', "true", "-1", "9", "1.5", "[1]"):
        with pytest.raises(RecipeError, match="refine_sweeps"):
            recipe("gptq", refine_sweeps=bad)
    asym = parse_recipe(f"groups:\n  experts:\n    targets: {TARGETS}\n    method: gptq\n"
                        "    scheme: {group_size: 32, symmetric: false}\n    options: {refine_sweeps: 1}\n")
    assert asym.groups[0].options.refine_sweeps == 1
    with pytest.raises(RecipeError, match="refine_sweeps applies to INT4"):
        parse_recipe(f"groups:\n  experts:\n    targets: {TARGETS}\n    method: gptq\n"
                     "    scheme: {num_bits: 4, type: float, symmetric: true, strategy: tensor_group, group_size: 16}\n"
                     "    options: {refine_sweeps: 1}\n")
    with pytest.raises(RecipeError, match="refine_sweeps"):
        recipe("awq", refine_sweeps="1")


def test_refine_sweeps_lower_the_calibration_error(tmp_path):
    """End to end (held-out check off): with refine_sweeps every expert module keeps the scales of the run
    without it (only codes move), some codes change, and the error on the calibration tokens routed to each module, ||X (W - Q)^T||^2
    from a plain forward's expert inputs, is lower in sum."""
    src = make_tiny_model("deepseek_v3", tmp_path / "src", experts=8)  # layer 1 is the only MoE layer
    data = load_calibration_data(None, vocab_size=512, num_samples=6, seq_len=32)
    runs, scales = {}, {}
    for sweeps in (0, 2):
        spool = tmp_path / f"spool-{sweeps}"
        rec = recipe("gptq", holdout=0, refine_sweeps=str(sweeps))
        index = run_calibrated(src, rec, data.samples, spool)
        runs[sweeps] = spool_weights(spool, index)
        scales[sweeps] = {}
        for name in index["layers"]:
            with SafetensorsFile(spool / f"{name}.safetensors") as f:
                scales[sweeps].update({k[: -len(".weight_scale")]: f.get(k) for k in f.header.tensors
                                       if k.endswith(".weight_scale")})
    moved = 0
    total = {0: 0.0, 2: 0.0}
    for name, inp, wt in _layer1_expert_modules(src, data.samples):
        a, b = runs[0][name], runs[2][name]
        mod = name[: -len(".weight")]
        assert torch.equal(scales[0][mod], scales[2][mod])  # the scales are the solve's
        moved += int((a != b).sum())
        for r in (0, 2):
            total[r] += float((inp @ (wt - runs[r][name]).T).double().square().sum())
    assert moved > 0 and total[2] < total[0]


def test_refit_scales_keep_the_codes_and_lower_the_calibration_error(tmp_path):
    """End to end (held-out check off, so that the codes are GPTQ's own in both runs): with refit_scales every
    expert module keeps the codes of the run without it (each group of its weights is the other run's times
    one positive factor), some groups' scales change, and the error on the calibration tokens routed to each
    module, ||X (W - Q)^T||^2 from a plain forward's expert inputs, is never larger and lower in sum."""
    src = make_tiny_model("deepseek_v3", tmp_path / "src", experts=8)  # layer 1 is the only MoE layer
    data = load_calibration_data(None, vocab_size=512, num_samples=6, seq_len=32)
    runs = {}
    for refit in (False, True):
        spool = tmp_path / f"spool-{refit}"
        rec = recipe("gptq", holdout=0, refit_scales=str(refit).lower())
        runs[refit] = spool_weights(spool, run_calibrated(src, rec, data.samples, spool))
    moved = 0
    total = {False: 0.0, True: 0.0}
    for name, inp, wt in _layer1_expert_modules(src, data.samples):
        a, b = runs[False][name], runs[True][name]
        ga, gb = a.reshape(a.shape[0], -1, 32), b.reshape(b.shape[0], -1, 32)
        assert torch.equal(ga == 0, gb == 0)
        ratio = torch.where(ga != 0, gb / ga, torch.nan)  # one factor per group: the same codes
        lo, hi = ratio.nan_to_num(float("inf")).amin(-1), ratio.nan_to_num(float("-inf")).amax(-1)
        live = (ga != 0).any(-1)
        assert torch.allclose(lo[live], hi[live], rtol=1e-5) and bool((lo[live] > 0).all())
        moved += int((~torch.isclose(lo[live], torch.ones_like(lo[live]))).sum())
        err = {r: float((inp @ (wt - runs[r][name]).T).double().square().sum()) for r in (False, True)}
        assert err[True] <= err[False] * (1 + 1e-6)
        total[False] += err[False]
        total[True] += err[True]
    assert moved > 0 and total[True] < total[False]


def test_all_token_hessian_needed_only_where_a_fallback_reads_it():
    """The distributed replay skips the all-token Hessian where no fallback can read it: routed statistics
    with every expert at min_tokens (default 0.5% of the layer's tokens), or the RTN fallback; `stats: all`
    and `stats: affinity` always need it (coverage's rule, decided from the routed counts)."""
    from quantkit.calib.hessians import all_token_hessian_needed

    covered, starved = torch.tensor([30, 40, 50]), torch.tensor([30, 4, 50])
    opts = recipe("gptq").groups[0].options  # routed, all_tokens, min_tokens 0.5% of the tokens
    assert not all_token_hessian_needed(opts, covered, 1000)  # min_tokens 5
    assert all_token_hessian_needed(opts, starved, 1000)
    assert not all_token_hessian_needed(recipe("gptq", fallback="rtn").groups[0].options, starved, 1000)
    assert all_token_hessian_needed(recipe("gptq", min_tokens="31").groups[0].options, covered, 1000)
    assert not all_token_hessian_needed(recipe("gptq", min_tokens="30").groups[0].options, covered, 1000)
    for mode in ("all", "affinity"):
        assert all_token_hessian_needed(recipe("gptq", stats=mode).groups[0].options, covered, 1000)
