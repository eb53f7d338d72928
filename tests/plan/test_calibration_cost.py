"""The calibration cost model (`quantkit plan --recipe R --calibration N,T --gpus G --device cpu|cuda`,
quantkit/plan/calibration.py): the option's parsing, the prediction's monotonicity in samples, tokens,
layers and ranks, device memory against the executor's own plan on a real checkpoint, the documented JSON
keys, and recipes that calibrate nothing or only KV scales.

Tiny models only (quantkit.testing); the shipped reference configs are exercised by the CLI check of
docs/cost.md's Kimi K2 command, not here (building their meta models takes seconds each).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.errors import ConfigError
from quantkit.plan import CostOptions, PlanOptions, calibration_cost, plan
from quantkit.plan.calibration import parse_calibration
from quantkit.plan.throughput import THROUGHPUT
from quantkit.testing import make_tiny_model, tiny_config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cost.md"
HIDDEN, EXPERTS, WIDTH = 128, 8, 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 2-layer qwen3_moe checkpoint (hidden 128, 8 experts of width 64)."""
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("cost") / "m", layers=2, experts=EXPERTS,
                           hidden=HIDDEN, moe_intermediate=WIDTH)


def _config(tmp_path: Path, layers: int) -> Path:
    """A config.json alone (no weights) of the tiny qwen3_moe with `layers` layers."""
    d = tmp_path / f"cfg{layers}"
    d.mkdir(exist_ok=True)
    cfg = tiny_config("qwen3_moe", layers=layers, experts=EXPERTS, hidden=HIDDEN, moe_intermediate=WIDTH).to_dict()
    (d / "config.json").write_text(json.dumps(cfg))
    return d / "config.json"


def _cost(model, n=8, t=64, g=1, recipe="int4-experts-gptq", device="cpu", **kw):
    return calibration_cost(str(model), recipe, n, t, CostOptions(world_size=g, device=device, **kw))


# ---- the option --------------------------------------------------------------------------------------------
def test_cli_calibration_option(tmp_path):
    cfg = _config(tmp_path, 2)
    r = CliRunner().invoke(app, ["plan", str(cfg), "--recipe", "int4-experts-gptq", "--calibration", "128,2048",
                                 "--gpus", "2", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["calibration"]
    assert (doc["num_samples"], doc["seq_len"], doc["world_size"], doc["device"]) == (128, 2048, 2, "cpu")
    assert doc["calibrated"] and doc["methods"] == ["gptq"] and doc["total_seconds"] > 0
    # without --calibration the plan has no calibration section
    r = CliRunner().invoke(app, ["plan", str(cfg), "--recipe", "int4-experts-gptq", "--json"])
    assert r.exit_code == 0 and "calibration" not in json.loads(r.stdout)


@pytest.mark.parametrize("args", [["--calibration", "128"], ["--calibration", "0,2048"], ["--calibration", "a,b"],
                                  ["--calibration", "1,2,3"], ["--calibration", "-4,16"],
                                  ["--calibration", "8,8", "--device", "tpu"]])
def test_cli_bad_calibration_is_usage_error(tmp_path, args):
    cfg = _config(tmp_path, 2)
    r = CliRunner().invoke(app, ["plan", str(cfg), "--recipe", "int4-experts-gptq", *args])
    assert r.exit_code == 2, (r.exit_code, r.output)


def test_cli_calibration_needs_recipe(tmp_path):
    r = CliRunner().invoke(app, ["plan", str(_config(tmp_path, 2)), "--calibration", "8,64"])
    assert r.exit_code == 2, r.output


def test_parse_calibration():
    assert parse_calibration("128,2048") == (128, 2048)
    assert parse_calibration(" 16 , 256 ") == (16, 256)
    for bad in ("128", "1,2,3", "x", "0,1", "3,-1", ""):
        with pytest.raises(ConfigError):
            parse_calibration(bad)


# ---- the prediction -----------------------------------------------------------------------------------------
def test_monotone_in_samples_tokens_and_layers(tmp_path):
    cfg2, cfg4 = _config(tmp_path, 2), _config(tmp_path, 4)
    base = _cost(cfg2, 8, 64)
    more_n = _cost(cfg2, 16, 64)
    more_t = _cost(cfg2, 8, 128)
    more_l = _cost(cfg4, 8, 64)
    for other in (more_n, more_t, more_l):
        assert other.total_seconds > base.total_seconds
        for k in ("forward", "hessians", "write_spool"):
            assert other.seconds[k] > base.seconds[k], k
    # the solves depend on the shapes only, not on the tokens (the held-out check's products do: holdout 0
    # leaves it out); twice the layers, twice the solves
    off = _gptq_cost_with(tmp_path)  # the same 2-layer config as cfg2
    assert off("      holdout: 0\n", n=16).seconds["gptq_solve"] == \
        pytest.approx(off("      holdout: 0\n", n=8).seconds["gptq_solve"])
    assert more_n.seconds["gptq_solve"] > base.seconds["gptq_solve"]
    assert more_l.seconds["gptq_solve"] == pytest.approx(2 * base.seconds["gptq_solve"])
    assert (base.layers, more_l.layers, more_l.calibrated_layers) == (2, 4, 4)
    # the attention grows with T^2: a longer sample costs more than more samples of the same total tokens
    assert more_t.seconds["forward"] > more_n.seconds["forward"]


def test_awq_world_size_splits_the_searches_and_the_quantization(tmp_path):
    """AWQ on G ranks: the per-expert searches and the quantization of those experts are each rank's share,
    so is the spool it writes; a rank receives the routed experts of the other ranks (dequantized) and the
    rest of the layer from rank 0."""
    cfg = _config(tmp_path, 2)
    runs = {g: _cost(cfg, 64, 64, g, recipe="int4-experts-awq", threads=2) for g in (1, 2, 4)}
    for a, b in ((1, 2), (2, 4)):
        assert runs[b].seconds["awq_search"] < runs[a].seconds["awq_search"]
        assert runs[b].seconds["write_spool"] < runs[a].seconds["write_spool"]
    routed = EXPERTS * (2 * WIDTH * HIDDEN + HIDDEN * WIDTH) * 4  # float32 layers
    got = {g: runs[g].communication_bytes["dequantized_weights"] for g in (2, 4)}
    assert got[4] - got[2] == pytest.approx(2 * routed * (3 / 4 - 1 / 2))  # 2 layers
    assert got[2] > 2 * routed / 2  # and more: the norm, the router and attention from rank 0


def test_world_size_splits_the_parallel_parts(tmp_path):
    """Every rank on the same threads (one host per rank): the work splits."""
    cfg = _config(tmp_path, 2)
    n, t = 64, 64  # 4096 tokens: 8 forward batches of 512 (the pass cuts at least 8)
    runs = {g: _cost(cfg, n, t, g, threads=2) for g in (1, 2, 4)}
    for a, b in ((1, 2), (2, 4)):
        for k in ("forward", "hessians", "gptq_solve"):
            assert runs[b].seconds[k] < runs[a].seconds[k], (k, a, b)
        assert runs[b].seconds["communication"] > 0
    assert "communication" not in runs[1].seconds and not runs[1].communication_bytes
    # the forwards split exactly: 8 equal batches, 4 per rank at G=2, 2 at G=4
    assert runs[2].seconds["forward"] == pytest.approx(runs[1].seconds["forward"] / 2)
    assert runs[4].seconds["forward"] == pytest.approx(runs[1].seconds["forward"] / 4)
    # MoE inputs a rank receives: the other ranks' tokens, float32 hidden rows + top-2 indices and weights
    other = n * t - n * t // 2
    assert runs[2].communication_bytes["moe_inputs"] == 2 * other * (HIDDEN * 4 + 2 * 16)  # 2 layers
    # the other rank's experts as INT4 codes (a byte each) and float32 scales per group of 32
    codes = (EXPERTS // 2) * (2 * WIDTH * HIDDEN + HIDDEN * WIDTH) * (1 + 4 / 32)
    assert runs[2].communication_bytes["expert_codes"] == pytest.approx(2 * codes)  # 2 layers
    # a rank plans the whole layer and every sample's slot, but only its own experts' Hessians: with
    # groups of 1 expert (8 experts, at least 8 groups) rank 0 of 4 owns experts 0 and 4
    for g, held in ((1, EXPERTS), (2, EXPERTS // 2), (4, EXPERTS // 4)):
        for layer in runs[g].device_memory["layers"]:
            assert layer["statistics"]["hessians"] == (held * (HIDDEN ** 2 + WIDTH ** 2) + HIDDEN ** 2) * 4
            assert layer["weights"] == runs[1].device_memory["layers"][layer["layer"]]["weights"]
    # what a rank owns shrinks with the world; its peak too, once every rank keeps the replay's buffers (at these
    # toy widths the forward's gathers, not the solves, set a layer's peak)
    for k in ("hessians", "heldout", "solve"):
        got = [runs[g].device_memory["layers"][0]["statistics"][k] for g in (1, 2, 4)]
        assert got[0] > got[1] > got[2], (k, got)
    assert "replay" not in runs[1].device_memory["layers"][0]["statistics"]
    assert runs[4].device_memory_bytes < runs[2].device_memory_bytes


def test_ranks_on_one_host_share_its_threads(tmp_path):
    """By default the ranks of a cpu world share the table's threads: G ranks each compute on threads / G, at
    the multi-threaded rates (and only those) scaled by 1 / G, as an explicit `threads` or a table scaled
    beforehand (for_threads) gives; a gpu table has no thread count and is not scaled."""
    from dataclasses import replace

    from quantkit.plan.throughput import THREAD_SCALED, THROUGHPUT

    cfg = _config(tmp_path, 2)
    c = THROUGHPUT["cpu"]
    assert c.threads == 2
    half = c.for_threads(1)
    for k, v in half.to_json().items():
        assert v == (c.to_json()[k] / 2 if k in THREAD_SCALED else c.to_json()[k]), k
    assert c.for_threads(2) is c and THROUGHPUT["cuda"].for_threads(1) is THROUGHPUT["cuda"]
    for g in (2, 4):
        shared = _cost(cfg, 64, 64, g)
        assert shared.constants["threads_per_rank"] == 2 / g
        same = _cost(cfg, 64, 64, g, threads=2 / g)
        pre = _cost(cfg, 64, 64, g, throughput=replace(c.for_threads(2 / g), threads=0))
        assert shared.seconds == same.seconds == pre.seconds
        assert shared.seconds["hessians"] > _cost(cfg, 64, 64, g, threads=2).seconds["hessians"]
        assert any("threads" in a for a in shared.assumptions)
    one = _cost(cfg, 64, 64, 1)
    assert one.seconds == _cost(cfg, 64, 64, 1, threads=2).seconds and one.constants["threads_per_rank"] == 2
    slow = _cost(cfg, 64, 64, 1, threads=1)
    assert slow.seconds["hessians"] > one.seconds["hessians"]
    assert slow.seconds["write_spool"] == one.seconds["write_spool"]  # I/O is not thread-bound
    with pytest.raises(ConfigError):
        _cost(cfg, 64, 64, 1, threads=0)


def test_a_table_measured_as_one_of_several_ranks(tmp_path):
    """A cpu table measured as one of G ranks sharing the host (`ranks` G, `threads` each: plan --measure
    --gpus G) holds a rank's own rates: a world of G computes at them unscaled; another world size shares the
    host's threads (threads x ranks) and is scaled by the threads alone, with a warning that says so."""
    from dataclasses import replace

    from quantkit.plan.throughput import THROUGHPUT, Throughput

    cfg = _config(tmp_path, 2)
    per = replace(THROUGHPUT["cpu"].for_threads(1), threads=1, ranks=2)  # 2 ranks of 1 thread on a 2-thread host
    two = _cost(cfg, 64, 64, 2, throughput=per)
    assert two.constants["threads_per_rank"] == 1
    assert two.seconds == _cost(cfg, 64, 64, 2, throughput=replace(per, threads=0)).seconds  # not scaled
    assert not any("measured as one of" in w for w in two.warnings)
    assert any("measured as one of 2 ranks" in a for a in two.assumptions)
    one = _cost(cfg, 64, 64, 1, throughput=per)
    assert one.constants["threads_per_rank"] == 2
    assert one.seconds == _cost(cfg, 64, 64, 1, throughput=replace(per.for_threads(2), threads=0)).seconds
    assert any("measured as one of 2 ranks" in w and "--gpus 1" in w for w in one.warnings)
    four = _cost(cfg, 64, 64, 4, throughput=per)
    assert four.constants["threads_per_rank"] == 0.5 and any("--gpus 4" in w for w in four.warnings)
    assert Throughput.from_json(per.to_json()) == per


def test_device_memory_is_the_executors_plan(tiny, tmp_path):
    """The cost model plans a config.json alone (tensors enumerated, nothing read); the executor plans the
    real checkpoint. Their plans agree, and the parts that can be written out independently are checked."""
    from quantkit.calib.executor import LayerExecutor
    from quantkit.calib.layer import statistics_bytes
    from quantkit.calib.spool import pass_batch_tokens
    from quantkit.match.recipe import load_recipe
    from quantkit.read.checkpoint import Checkpoint

    n, t = 6, 48
    cost = _cost(tiny / "config.json", n, t)
    rec = load_recipe("int4-experts-gptq")
    ex = LayerExecutor(tiny, device="cpu")
    lengths = [t] * n
    ex.batch_tokens = pass_batch_tokens(ex.batch_tokens, lengths)  # as the pass sets it (calib/spool.py)
    real = ex.plan_memory(lengths, statistics=lambda i, layer: statistics_bytes(
        ex.ckpt, rec, i, layer, ex.device, ex.dtype, ex.call_tokens(lengths), lengths))
    assert cost.device_memory == real.to_json()
    assert cost.device_memory_bytes == real.peak_bytes
    ck = Checkpoint.open(tiny)
    for layer in cost.device_memory["layers"]:
        i = layer["layer"]
        numel = sum(ck.info(k).numel for k in ck.location if k.startswith(f"model.layers.{i}."))
        assert layer["weights"] == numel * 4  # float32 on the CPU
        assert layer["statistics"]["hessians"] == (EXPERTS * (HIDDEN ** 2 + WIDTH ** 2) + HIDDEN ** 2) * 4
    assert cost.device_memory["activation_bytes"] == n * t * HIDDEN * 4


def test_cuda_plan_and_fit(tmp_path):
    cfg = _config(tmp_path, 2)
    c = _cost(cfg, 8, 64, g=1, device="cuda", gpu_memory_gib=80)
    assert c.dtype == "bfloat16" and c.fits is True and c.device_memory["device"] == "cuda"
    assert c.constants["provenance"] == "assumed" and any("assumption" in w for w in c.warnings)
    tight = _cost(cfg, 8, 64, g=1, device="cuda", gpu_memory_gib=1e-4)
    assert tight.fits is False and any(w.startswith("does not fit") for w in tight.warnings)
    assert tight.device_memory["activations"] == "host"  # planned anyway, the activations off the device


def test_compute_dtype_sets_the_forward_rate_and_the_activation_bytes(tmp_path):
    """--compute-dtype as convert's: bfloat16 layers on the CPU take the table's bfloat16 GEMM rate
    (alt_gemm_flops) and half the activation bytes; the solves do not change; float32 on a GPU takes its
    float32 rate; a table without the other dtype's rate uses the default one's and says so."""
    from dataclasses import replace

    cfg = _config(tmp_path, 2)
    f32, auto = _cost(cfg, 64, 256), _cost(cfg, 64, 256, compute_dtype="auto")
    bf16 = _cost(cfg, 64, 256, compute_dtype="bf16")
    assert (f32.dtype, auto.dtype, bf16.dtype) == ("float32", "float32", "bfloat16")
    assert auto.seconds == f32.seconds
    assert bf16.seconds["forward"] < f32.seconds["forward"]
    assert bf16.seconds["gptq_solve"] == pytest.approx(f32.seconds["gptq_solve"])
    assert bf16.device_memory["activation_bytes"] * 2 == f32.device_memory["activation_bytes"]
    assert any("bfloat16" in a and "alt_gemm_flops" in a for a in bf16.assumptions)
    assert not any("layers computed in" in a for a in f32.assumptions)
    assert any("bfloat16 layers on the CPU with GPTQ" in w for w in bf16.warnings)
    assert not any("bfloat16 layers" in w for w in f32.warnings)
    kv = _cost(cfg, 64, 256, recipe="fp8-kv", compute_dtype="bfloat16")
    assert kv.seconds["forward"] < _cost(cfg, 64, 256, recipe="fp8-kv").seconds["forward"]
    assert not any("bfloat16 layers" in w for w in kv.warnings)
    # without a bfloat16 rate: the float32 one stands in (only the bytes change), and the plan says so
    plain = replace(THROUGHPUT["cpu"], alt_gemm_flops=0.0)
    no_rate = _cost(cfg, 64, 256, compute_dtype="bfloat16", throughput=plain)
    assert any("stands in" in a for a in no_rate.assumptions)
    assert bf16.seconds["forward"] < no_rate.seconds["forward"] <= f32.seconds["forward"]
    # a GPU in float32: the slower float32 rate, twice the bytes of its default bfloat16
    g16 = _cost(cfg, 8, 64, device="cuda", gpu_memory_gib=80)
    g32 = _cost(cfg, 8, 64, device="cuda", gpu_memory_gib=80, compute_dtype="float32")
    assert (g16.dtype, g32.dtype) == ("bfloat16", "float32")
    assert g32.seconds["forward"] > g16.seconds["forward"]
    assert g32.device_memory["activation_bytes"] == 2 * g16.device_memory["activation_bytes"]
    from quantkit.errors import DeviceError

    with pytest.raises(DeviceError):
        _cost(cfg, 8, 64, compute_dtype="float16")


def test_cli_compute_dtype(tmp_path):
    cfg = _config(tmp_path, 2)
    base = ["plan", str(cfg), "--recipe", "int4-experts-gptq", "--device", "cpu", "--json"]
    r = CliRunner().invoke(app, [*base, "--calibration", "16,128", "--compute-dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["calibration"]["dtype"] == "bfloat16"
    for args in (["--calibration", "16,128", "--compute-dtype", "int8"], ["--compute-dtype", "bfloat16"]):
        r = CliRunner().invoke(app, [*base, *args])
        assert r.exit_code == 2, (args, r.output)


def test_no_calibrated_group_says_so(tmp_path):
    cfg = _config(tmp_path, 2)
    c = _cost(cfg, recipe="int4-experts-rtn")
    assert not c.calibrated and c.total_seconds == 0 and c.methods == ()
    assert any("no calibrated group" in w for w in c.warnings)
    r = CliRunner().invoke(app, ["plan", str(cfg), "--recipe", "int4-experts-rtn", "--calibration", "8,64", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["calibration"]["calibrated"] is False
    r = CliRunner().invoke(app, ["plan", str(cfg), "--recipe", "int4-experts-rtn", "--calibration", "8,64"])
    assert r.exit_code == 0 and "no calibrated group" in r.stdout


def test_kv_scales_forward_once(tmp_path):
    cfg = _config(tmp_path, 2)
    # 64 x 128 tokens: both passes forward 8 batches of 1024 tokens (the executor's size for this model)
    kv, gq = _cost(cfg, 64, 128, recipe="fp8-kv"), _cost(cfg, 64, 128)
    awq = _cost(cfg, 64, 128, recipe="int4-experts-awq")
    assert kv.methods == ("kv_scales",) and "gptq_solve" not in kv.seconds and kv.seconds["kv_observe"] > 0
    assert kv.seconds["forward"] == pytest.approx(awq.seconds["forward"] / 2)  # AWQ forwards each layer twice
    # GPTQ of the routed experts alone: up to the experts, then the MLP block (less than two whole forwards)
    assert kv.seconds["forward"] < gq.seconds["forward"] < awq.seconds["forward"]
    assert set(kv.device_memory["layers"][0]["statistics"]) == {"kv_observer"}
    # KV calibration is data parallel too (calib/kv_dist.py): 8 batches, 4 per rank
    kv2 = _cost(cfg, 64, 128, g=2, recipe="fp8-kv", threads=2)  # one host per rank
    assert kv2.seconds["forward"] == pytest.approx(kv.seconds["forward"] / 2)


def test_json_keys_documented(tmp_path):
    """Every key of the `calibration` object is listed in docs/cost.md's key table, and nothing more."""
    doc = _cost(_config(tmp_path, 2), g=2).to_json()
    text = DOCS.read_text()
    section = text.split("<!-- calibration-json-keys -->")[1].split("<!-- /calibration-json-keys -->")[0]
    listed = set(re.findall(r"^\| `([a-z_]+)`", section, re.M))
    assert listed == set(doc), (sorted(set(doc) - listed), sorted(listed - set(doc)))
    assert set(doc["seconds"]) <= set(re.findall(r"`([a-z_]+)`", section))


def test_constants_say_where_they_come_from():
    assert THROUGHPUT["cpu"].provenance == "measured" and THROUGHPUT["cuda"].provenance == "assumed"
    for t in THROUGHPUT.values():
        assert t.source and all(v > 0 for k, v in t.to_json().items() if isinstance(v, (int, float))
                                and k not in ("threads", "chol_half_k"))
        assert t.chol_half_k >= 0  # 0: one Cholesky rate whatever the width (the shipped rows, measured before it was)
    assert THROUGHPUT["cpu"].threads > 0 and THROUGHPUT["cuda"].threads == 0  # a GPU's rates are not per thread
    text = DOCS.read_text()
    assert "ASSUMED" in text and "measured" in text


def test_plan_library_entry(tmp_path):
    rep = plan(str(_config(tmp_path, 2)), "int4-experts-gptq", PlanOptions(gpus=2, calibration=(8, 64), device="cpu"))
    assert rep.calibration is not None and rep.to_json()["calibration"]["world_size"] == 2
    with pytest.raises(ConfigError):
        plan(str(_config(tmp_path, 2)), None, PlanOptions(calibration=(8, 64)))
    assert torch.get_default_dtype() == torch.float32  # planning changes no global torch state


def _gptq_cost_with(tmp_path):
    """cost(extra, **kw): the 2-layer config's calibration cost (`_cost`'s keywords: n, t, g, threads) under the
    shipped int4-experts-gptq recipe with the option lines `extra` added."""
    import hashlib

    import quantkit

    text = (Path(quantkit.__file__).parent / "data" / "recipes" / "int4-experts-gptq.yaml").read_text()
    cfg = _config(tmp_path, 2)

    def cost(extra, **kw):
        p = tmp_path / f"r{hashlib.sha256(extra.encode()).hexdigest()[:12]}.yaml"  # one file per recipe
        p.write_text(text.replace("      block_size: 128\n", "      block_size: 128\n" + extra))
        return _cost(cfg, recipe=str(p), **kw)
    return cost


def test_affinity_statistics_cost_grows_with_the_experts_each_token_feeds(tmp_path):
    """`stats: affinity`: each token's row goes to affinity_top_k experts (every expert without it) instead of
    the router's top-k; only the statistics change."""
    cost = _gptq_cost_with(tmp_path)
    plain, top4, every = cost(""), cost("      stats: affinity\n      affinity_top_k: 4\n"), \
        cost("      stats: affinity\n")
    assert plain.seconds["hessians"] < top4.seconds["hessians"] < every.seconds["hessians"]
    more = cost("      stats: affinity\n      affinity_top_k: 16\n")  # more than the 8 experts there are
    assert more.seconds["hessians"] == every.seconds["hessians"]
    twice = cost("      stats: affinity\n      affinity_top_k: 2k\n")  # twice the router's top-2
    assert twice.seconds["hessians"] == top4.seconds["hessians"]
    for k in ("forward", "gptq_solve"):
        assert plain.seconds[k] == top4.seconds[k] == every.seconds[k], k


def test_refit_scales_cost_is_the_solves_own(tmp_path):
    """`refit_scales: true` adds ~3 n k^2 float32 flops per matrix (at the GEMM rate of n rows) to gptq_solve,
    and nothing else."""
    cost = _gptq_cost_with(tmp_path)
    plain, refit = cost(""), cost("      refit_scales: true\n")
    for k in plain.seconds:
        if k != "gptq_solve":
            assert plain.seconds[k] == refit.seconds[k], k
    e, h, i = EXPERTS, HIDDEN, WIDTH  # two MoE layers
    c = THROUGHPUT["cpu"]
    want = 2 * e * 3 * (2 * i * h * h / (c.gram_flops * 2 * i / (2 * i + c.gram_half_rows))
                        + h * i * i / (c.gram_flops * h / (h + c.gram_half_rows)))
    assert refit.seconds["gptq_solve"] - plain.seconds["gptq_solve"] == pytest.approx(want, rel=1e-6)


def test_refine_sweeps_cost_is_the_solves_own(tmp_path):
    """`refine_sweeps: n` adds n column sweeps and one n k^2 product (the starting gradient) per matrix to
    gptq_solve and nothing else: each further sweep costs the same, and the first costs one product more."""
    cost = _gptq_cost_with(tmp_path)
    runs = [cost(f"      refine_sweeps: {n}\n" if n else "") for n in (0, 1, 2, 3)]
    for k in runs[0].seconds:
        if k != "gptq_solve":
            assert all(r.seconds[k] == runs[0].seconds[k] for r in runs), k
    solve = [r.seconds["gptq_solve"] for r in runs]
    sweep = solve[2] - solve[1]
    assert sweep > 0 and solve[3] - solve[2] == pytest.approx(sweep, rel=1e-9)
    e, h, i = EXPERTS, HIDDEN, WIDTH  # two MoE layers
    c = THROUGHPUT["cpu"]
    start = 2 * e * (2 * i * h * h / (c.gram_flops * 2 * i / (2 * i + c.gram_half_rows))
                     + h * i * i / (c.gram_flops * h / (h + c.gram_half_rows)))
    assert solve[1] - solve[0] - sweep == pytest.approx(start, rel=1e-6)


def test_balance_pool_is_forwarded_not_summed(tmp_path):
    """`balance_tokens`: the top-up pool (balance_pool samples, or N) goes through every layer's forward and
    the spool as calibration samples do; the statistics and the solves stay the N samples'."""
    cost = _gptq_cost_with(tmp_path)
    plain, pool, same = cost(""), cost("      balance_tokens: 64\n      balance_pool: 8\n"), \
        cost("      balance_tokens: 64\n")
    assert plain.to_json()["pool_samples"] == 0 and pool.to_json()["pool_samples"] == 8
    assert same.pool_samples == 8  # N = 8 samples
    assert pool.seconds["forward"] > 1.2 * plain.seconds["forward"]  # twice the tokens, in larger batches
    assert pool.seconds["write_spool"] > plain.seconds["write_spool"]
    for k in ("hessians", "gptq_solve"):
        assert pool.seconds[k] == plain.seconds[k], k
    assert cost("      balance_tokens: 64\n      balance_pool: 2\n").seconds["forward"] < pool.seconds["forward"]


def test_a_fresh_process_pays_startup_once(tmp_path):
    """`startup_s` (a fresh process's first executor) is counted once in `fixed`, for GPTQ and for KV scales, on
    one rank and on several (they start in parallel); a table without it (from_json of an older row) has 0."""
    from dataclasses import replace

    from quantkit.plan.throughput import THROUGHPUT, Throughput

    cfg = _config(tmp_path, 2)
    c = THROUGHPUT["cpu"]
    assert c.startup_s > 0
    for recipe, g in (("int4-experts-gptq", 1), ("fp8-kv", 1), ("int4-experts-gptq", 2)):
        with_it = _cost(cfg, 8, 64, g, recipe=recipe)
        without = _cost(cfg, 8, 64, g, recipe=recipe, throughput=replace(c, startup_s=0.0))
        assert with_it.seconds["fixed"] - without.seconds["fixed"] == pytest.approx(c.startup_s, rel=1e-9)
        assert {k: v for k, v in with_it.seconds.items() if k != "fixed"} == \
            {k: v for k, v in without.seconds.items() if k != "fixed"}
    doc = c.to_json()
    del doc["startup_s"], doc["threads"], doc["ranks"]
    old = Throughput.from_json(doc)  # a table written before these fields
    assert old.startup_s == 0.0 and old.threads == 0 and old.ranks == 1


def test_fit_unquantized_cost_is_a_forward_and_the_fits(tmp_path):
    """`fit_unquantized`: the unquantized model's stream is forwarded through every layer (one more whole forward
    each) and saved with the progress; the statistics gain the cross-Grams and the down inputs of both streams,
    the solves the fitted targets. The alpha itself costs nothing."""
    cost = _gptq_cost_with(tmp_path)
    plain, fit, fit1 = cost(""), cost("      fit_unquantized: 0.5\n"), cost("      fit_unquantized: 1\n")
    for k in ("forward", "hessians", "gptq_solve", "write_spool"):
        assert fit.seconds[k] > plain.seconds[k], k
        assert fit.seconds[k] == fit1.seconds[k], k
    assert fit.seconds["forward"] < 2 * plain.seconds["forward"]  # plain: a whole and a split forward per layer
    assert fit.seconds["hessians"] < 2.5 * plain.seconds["hessians"]


def test_heldout_check_costs_its_products(tmp_path):
    """GPTQ's held-out check (`holdout` k, default 8): after the solves, per owned expert and matrix, a product
    of its held-out rows with W and both candidates' errors, RTN's codes and the float64 sums. Only the solve
    pays it; off (0) it is gone; with fewer rows held out (16) the products shrink and the per-matrix work
    stays, so it costs less but more than half; fit_down adds down_proj's reference product."""
    with_ = _gptq_cost_with(tmp_path)

    def cost(extra):
        return with_(extra, n=64)

    off, k8, k16 = cost("      holdout: 0\n"), cost(""), cost("      holdout: 16\n")
    for k in off.seconds:
        if k != "gptq_solve":
            assert off.seconds[k] == k8.seconds[k] == k16.seconds[k], k
    c8, c16 = k8.seconds["gptq_solve"] - off.seconds["gptq_solve"], k16.seconds["gptq_solve"] - off.seconds["gptq_solve"]
    assert 0 < c16 < c8 < 2 * c16
    fit_off, fit8 = cost("      holdout: 0\n      fit_down: 0.5\n"), cost("      fit_down: 0.5\n")
    assert fit8.seconds["gptq_solve"] - fit_off.seconds["gptq_solve"] > c8


def test_fit_down_cost_is_the_down_fit_alone(tmp_path):
    """`fit_down`: no second stream (no extra forward, nothing saved, nothing sent), down_proj's statistics
    from both gate/ups and its fitted target only: more than plain GPTQ, less than fit_unquantized."""
    cost = _gptq_cost_with(tmp_path)
    plain, down, both = cost(""), cost("      fit_down: 0.5\n"), cost("      fit_unquantized: 0.5\n")
    for k in ("forward", "write_spool"):
        assert down.seconds[k] == plain.seconds[k], k
    for k in ("hessians", "gptq_solve"):
        assert plain.seconds[k] < down.seconds[k] < both.seconds[k], k
    assert down.communication_bytes == plain.communication_bytes


def test_fit_unquantized_rows_travel_under_torchrun(tmp_path):
    """On 2 ranks a fitting pass also receives the other rank's batches' unquantized-model MoE inputs (float32
    hidden rows), beside the quantized ones."""
    cfg = _config(tmp_path, 2)
    n, t = 64, 64
    plain = _cost(cfg, n, t, 2, threads=2)
    fit = _gptq_cost_with(tmp_path)("      fit_unquantized: 0.5\n", n=n, t=t, g=2, threads=2)
    other = n * t - n * t // 2
    assert "reference_inputs" not in plain.communication_bytes
    assert fit.communication_bytes["reference_inputs"] == 2 * other * HIDDEN * 4  # 2 layers
    assert fit.seconds["communication"] > plain.seconds["communication"]
