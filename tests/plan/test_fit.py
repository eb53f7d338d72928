"""`plan --fit`: the knapsack is exact, the units and their targets cover exactly the Linears they name, the
chosen recipe fits the budget by convert's own bytes, the measured sensitivity is what it says (and cached), and
hostile targets end in one line."""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path

import pytest
import yaml

from quantkit.arch import parse_config
from quantkit.convert import ConvertOptions, convert
from quantkit.errors import FitError
from quantkit.match.recipe import load_recipe, matches, parse_recipe
from quantkit.plan import FitOptions, PlanOptions, fit
from quantkit.plan import _tensor_shapes_from_checkpoint as headers
from quantkit.plan import mix
from quantkit.plan.tensors import tensor_bytes, tensor_role
from quantkit.read.checkpoint import Checkpoint
from tests.harness import cli  # noqa: F401  (fixture)

ONE = PlanOptions(gpus=1, gpu_memory_gib=80)


def _brute(options, budget):
    best = None
    for combo in itertools.product(*[sorted(o) for o in options]):
        b = sum(o[c][0] for o, c in zip(options, combo))
        loss = sum(o[c][1] for o, c in zip(options, combo))
        if b <= budget and (best is None or loss < best[0] - 1e-12):
            best = (loss, combo)
    return best


def test_the_knapsack_is_exact_where_bytes_sit_on_its_grid():
    rng = random.Random(0)
    for trial in range(60):
        n = rng.randint(1, 5)
        options = [{f"c{j}": (rng.randint(1, 40) * 100, rng.random()) for j in range(rng.randint(1, 4))}
                   for _ in range(n)]
        budget = rng.randint(0, 160) * 100
        want = _brute(options, budget)
        got = mix.solve(options, budget)
        if want is None:
            assert got is None, (options, budget)
            continue
        assert got is not None, (options, budget)
        assert sum(o[c][0] for o, c in zip(options, got)) <= budget
        assert sum(o[c][1] for o, c in zip(options, got)) == pytest.approx(want[0]), (trial, options, budget)


def test_the_knapsack_never_exceeds_a_budget_off_its_grid():
    rng = random.Random(1)
    options = [{f"c{j}": (rng.randint(1, 10**9), rng.random()) for j in range(5)} for _ in range(300)]
    budget = sum(sorted(b for b, _ in o.values())[2] for o in options)
    got = mix.solve(options, budget)
    assert got is not None
    assert sum(o[c][0] for o, c in zip(options, got)) <= budget
    assert mix.solve(options, sum(min(b for b, _ in o.values()) for o in options) - 1) is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3", "glm_moe_dsa", "kimi_k25"])
def test_units_and_targets_cover_exactly_their_linears(tiny_models, arch):
    src = tiny_models(arch, layers=3)
    t = headers(src)
    spec = parse_config(Checkpoint.open(src).config)
    units = mix.units(t, spec)
    linears = {n[: -len(".weight")] for n, (sh, _) in t.items() if n.endswith(".weight") and len(sh) == 2}
    covered = [m for u in units for m in u.modules]
    assert len(covered) == len(set(covered))
    for m in linears:
        role = tensor_role(f"{m}.weight", spec.num_layers)
        in_unit = m in set(covered)
        if role == "routed_experts":
            assert in_unit, m
        if role in ("router", "embeddings", "lm_head", "mtp", "vision"):
            assert not in_unit, m
    assert {u.kind for u in units} == {"routed", "dense"}
    for layers in ([0], [1, 2], [0, 2]):
        for kind in ("routed", "dense"):
            mods = sorted({m for u in units if u.kind == kind for m in u.modules})
            pats = mix.targets(mods, layers)
            chosen = {m for u in units if u.kind == kind and u.layer in layers for m in u.modules}
            for m in linears:
                assert any(matches(p, m) for p in pats) == (m in chosen), (m, layers, pats[:3])


@pytest.fixture(scope="module")
def src(tiny_models):
    return tiny_models("qwen3_moe", hidden=128, moe_intermediate=128, layers=3)


def test_the_chosen_recipe_fits_by_converts_own_bytes(src, tmp_path):
    """Prior loss (no measurement): at a budget between all-4-bit and all-FP8 the mix mixes, its YAML loads,
    and the checkpoint convert writes from it holds exactly the predicted resident bytes, within the budget."""
    cands = mix.choices(None)
    t = headers(src)
    spec = parse_config(Checkpoint.open(src).config)
    units = mix.units(t, spec)
    ub, fixed, dropped = mix.unit_bytes(t, spec, units, cands)
    assert not dropped
    lo = fixed + sum(min(d.values()) for d in ub.values())
    hi = fixed + sum(d["fp8-block"] for d in ub.values())
    budget = (lo + hi) // 2
    res, rep = fit(src, ONE, FitOptions(weights_gib=budget / 2**30, sensitivity="prior"))
    assert res.weights_bytes <= res.budget_bytes == budget
    assert len({u.choice for u in res.units if u.kind == "routed"}) >= 2, [u.choice for u in res.units]
    rec = parse_recipe(res.recipe_text)
    assert rec.kv_cache is not None
    out = tmp_path / "q"
    convert(src, out, ConvertOptions(recipe=rec, num_samples=2, seq_len=16, model_card=False))
    written = sum(tensor_bytes(sh, d) for sh, d in headers(out).values())
    k_v = sum(tensor_bytes(sh, d) for n, (sh, d) in headers(out).items() if n.endswith(("k_scale", "v_scale")))
    assert written == res.weights_bytes, (written, res.weights_bytes, k_v)
    for u in res.units:  # every module of a unit got its unit's choice
        for m in u.modules:
            g = rec.match(m)
            assert (g is None) == (u.choice == "keep"), (m, u.choice)
            if g is not None:
                assert g.name == f"{u.kind}-{u.choice}"


def test_a_tighter_budget_never_predicts_less_loss(src):
    losses = []
    for w in (0.0009, 0.0008, 0.0007):
        res, _ = fit(src, ONE, FitOptions(weights_gib=w, sensitivity="prior"))
        losses.append(res.predicted_loss)
    assert losses == sorted(losses) and losses[0] < losses[-1], losses


def test_measured_sensitivity_is_each_units_kl_and_is_cached(src, tmp_path):
    """The measured loss of a unit is the KL of the source model with that unit's weights taken from the uniform
    conversion (checked here against a model built independently with transformers from that conversion's
    dequantized weights, for one unit); a second fit reads the cache and converts nothing."""
    import torch

    from quantkit.verify.numerics import load_dequantized, load_model

    fo = FitOptions(weights_gib=0.0012, num_samples=2, seq_len=32, cache_dir=tmp_path / "cache",
                    schemes=("mxfp4",))
    said: list[str] = []
    res, _ = fit(src, ONE, fo, said.append)
    assert any("convert with mxfp4" in s for s in said)
    table = json.loads(next((tmp_path / "cache").glob("sensitivity-*.json")).read_text())
    loss = {(l, k, c): v for l, k, c, v in table["loss"]}
    assert all(v > 0 for (_, _, c), v in loss.items() if c != "keep")
    assert not list((tmp_path / "cache").glob("work-*"))  # the uniform outputs are gone

    # one unit again, independently: the whole uniform MXFP4 output decoded into the source, then every layer
    # but layer 1's experts put back
    out = tmp_path / "mx"
    rec = mix.uniform_recipe(mix.CHOICE["mxfp4"], mix.units(headers(src), parse_config(Checkpoint.open(src).config)))
    convert(src, out, ConvertOptions(recipe=rec, model_card=False))
    from quantkit.verify.numerics import token_data

    ids = torch.stack(token_data(Checkpoint.open(src), None, 2, 32, seed=0)[0])
    ref = load_model(src, torch.device("cpu"), torch.float32)
    q = load_dequantized(src, out, torch.device("cpu"), torch.float32)
    sd = ref.state_dict()
    with torch.no_grad():
        for n, p in q.named_parameters():
            if not n.startswith("model.layers.1.mlp.experts"):
                p.copy_(sd[n])
        a = torch.log_softmax(ref(ids).logits.float(), -1)
        b = torch.log_softmax(q(ids).logits.float(), -1)
    kl = float((a.exp() * (a - b)).sum(-1).mean())
    assert loss[(1, "routed", "mxfp4")] == pytest.approx(kl, rel=1e-3)

    said.clear()
    t0 = time.monotonic()
    res2, _ = fit(src, ONE, fo, said.append)
    assert not any("convert with" in s for s in said) and any("from the cache" in s for s in said)
    assert res2.recipe_text == res.recipe_text and time.monotonic() - t0 < 30


def test_no_mix_fits_says_what_would(src):
    with pytest.raises(FitError, match=r"would fit: --weights-gib 0\.000\d+ or more"):
        fit(src, ONE, FitOptions(weights_gib=1e-6, sensitivity="prior"))
    with pytest.raises(FitError, match=r"no mix fits: .*requests of 131,072 tokens.*would fit: at most \d+ requests"):
        fit("kimi-k2", PlanOptions(gpus=8, gpu_memory_gib=80), FitOptions(concurrency=64))
    with pytest.raises(FitError, match=r"would fit: .*\d+ GPUs of 80 GiB"):
        fit("kimi-k2", PlanOptions(gpus=4, gpu_memory_gib=80, context_len=4096), FitOptions(concurrency=1))


def test_a_reference_config_fits_with_the_prior():
    res, rep = fit("glm-5", PlanOptions(gpus=8, gpu_memory_gib=80, context_len=32768), FitOptions(concurrency=8))
    assert res.loss_source == "prior" and res.weights_bytes <= res.budget_bytes
    per_gpu = -(-res.weights_bytes // 8)
    kv = rep.kv_bytes_per_token_per_gpu["float8_e4m3"] * 8 * 32768
    assert per_gpu + kv + int(8 * 2**30) <= 80 * 2**30


HOSTILE = [
    (["--weights-gib", "0"], 2, "--weights-gib"), (["--weights-gib", "-1"], 2, "--weights-gib"),
    (["--weights-gib", "nan"], 2, "--weights-gib"), (["--weights-gib", "inf"], 2, "--weights-gib"),
    (["--weights-gib", "1" + "0" * 40], 2, "--weights-gib"), (["--concurrency", "0"], 2, "--concurrency"),
    (["--concurrency", "-5"], 2, "--concurrency"), (["--concurrency", str(1 << 40)], 2, "--concurrency"),
    (["--weights-gib", "1e-9"], 1, "no mix fits"), (["--concurrency", "100000", "--gpu-memory-gib", "1"], 1,
                                                   "no mix fits"),
    (["--fit-schemes", "int3"], 1, "unknown fit scheme"), (["--kv-dtype", "fp4"], 1, "kv_dtype"),
    (["--sensitivity", "guess"], 1, "sensitivity"),
]


@pytest.mark.parametrize("args,rc,word", HOSTILE, ids=[" ".join(a)[-40:] for a, _, _ in HOSTILE])
def test_hostile_targets_end_in_one_line(cli, src, tmp_path, args, rc, word):  # noqa: F811
    out = tmp_path / "chosen.yaml"
    r = cli.run("plan", src, "--fit", out, "--gpus", "1", "--sensitivity", "prior", *args, "--json", timeout=60) \
        if "--sensitivity" not in args else cli.run("plan", src, "--fit", out, "--gpus", "1", *args, "--json",
                                                    timeout=60)
    assert r.rc == rc, (r.rc, r.stderr[-1500:])
    assert "Traceback" not in r.stderr and r.stdout == "" and not out.exists()
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("fit:")]
    if rc == 1:
        assert lines[0].startswith("error: ") and word in lines[0] and len(lines) <= 2, r.stderr
    else:
        flat = " ".join(r.stderr.replace("│", " ").replace("'", "").split())
        assert f"Invalid value for {word}" in flat, r.stderr


def test_fit_options_need_fit(cli, src):  # noqa: F811
    r = cli.run("plan", src, "--concurrency", "4", "--json", timeout=60)
    assert r.rc == 2 and "--concurrency needs --fit" in " ".join(r.stderr.replace("│", " ").split())


def test_the_cli_writes_the_recipe_and_plans_it(cli, src, tmp_path):  # noqa: F811
    out = tmp_path / "chosen.yaml"
    r = cli.run("plan", src, "--fit", out, "--gpus", "1", "--weights-gib", "0.0008", "--sensitivity", "prior",
                "--json", timeout=120)
    assert r.rc == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fit"]["output"] == str(out) and doc["model"]["recipe"].startswith("fit-")
    assert load_recipe(out).name == doc["model"]["recipe"]
    assert doc["fit"]["weights_bytes"] <= doc["fit"]["budget_bytes"] == int(0.0008 * 2**30)
    # the units and the rest add up to plan's exact bytes but for the FP8 KV scales: k and v, float32, per layer
    kv_scales = 2 * 4 * 3
    assert sum(u["bytes"] for u in doc["fit"]["units"]) + doc["fit"]["fixed_bytes"] + kv_scales == \
        doc["fit"]["weights_bytes"]


def test_the_report_draws_the_fit_record_and_skips_bad_rows(src, tmp_path):
    """The chosen recipe's `fit` mapping travels in the manifest; `quantkit report` draws its bytes and loss per
    layer from it; rows of a tampered record that are not [layer, kind, choice, bytes, loss] with finite numbers
    are left out, and a record that is not a mapping is refused where recipes are read."""
    from quantkit.errors import RecipeError
    from quantkit.match.recipe import fit_record
    from quantkit.report import build_report
    from quantkit.report.sections import fit_units

    res, _ = fit(src, ONE, FitOptions(weights_gib=0.0009, sensitivity="prior", kv_dtype="bf16"))
    rec = fit_record(res.recipe_text)
    assert [r[:3] for r in rec["units"]] == [[u.layer, u.kind, u.choice] for u in res.units]
    assert rec["budget_bytes"] == res.budget_bytes and rec["loss_source"] == "prior"
    out = tmp_path / "q"
    convert(src, out, ConvertOptions(recipe=parse_recipe(res.recipe_text), model_card=False))
    r = build_report(out, output=tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    assert 'id="fig-fit"' in html and "plan --fit" in html, r.skipped
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    assert len(fit_units(manifest)) == len(res.units)
    bad = res.recipe_text.replace("units:\n", "units:\n  - [0, routed, x, .nan, 1.0]\n  - [true, routed, x, 1, 1]\n"
                                  "  - [0, routed, x, 1, -1]\n  - [1, 2, 3]\n  - not a row\n", 1)
    assert len(fit_units({"recipe": {"text": bad}})) == len(res.units)
    assert fit_units({"recipe": {"text": "fit: [1, 2]"}}) == [] and fit_units({"recipe": "x"}) == []
    with pytest.raises(RecipeError, match="fit must be a mapping"):
        parse_recipe(yaml.safe_dump({**yaml.safe_load(res.recipe_text), "fit": 3}))
