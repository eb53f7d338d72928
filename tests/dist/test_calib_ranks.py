"""`torchrun -m quantkit convert` with a calibrated recipe: the pass runs data and expert parallel over the
ranks (gloo on the CPU, one thread per rank), and its output is byte for byte a single process's.

Launched for real with torchrun (--standalone). What must hold: GPTQ (routed experts, dense targets, FP8
KV scales) writes the same bytes, every output file, for 1, 2 and 3 ranks, and AWQ for 1 and 3; a job whose
rank was SIGKILLed mid-pass resumes, run again with the same command, at the layer it was on and to the same bytes;
a rank that fails mid-pass stops every rank with the error named; and, more sensitive than the packed
output (INT4 codes rarely move when a Hessian's last bits do), the statistics themselves: every expert's
and every dense module's Hessian equal bit for bit on its owner for 1 and 3 ranks."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from harness import run_bounded

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "QUANTKIT_DIST_TIMEOUT": "120"}
CAL = ["--num-samples", "8", "--seq-len", "32"]  # 8 forward batches of one sample
# the dense + KV recipe: 8 batches of 3 samples for GPTQ, and 2 forward batches for the KV scales (1024 tokens
# per call at least), so that the KV calibration is split over the ranks too
DENSE_CAL = ["--num-samples", "24", "--seq-len", "64"]

# dense GPTQ targets (MLA attention, the shared expert, the dense MLP of layer 0) besides the routed experts
# (their scales refitted), and FP8 KV-cache scales calibrated in the same convert
DENSE = """\
name: dense-gptq-kv
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']
    method: gptq
    scheme: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}
    options: {fallback: all_tokens, refit_scales: true}
  dense:
    targets: ['re:.*\\.self_attn\\.(q_a|q_b|kv_a|kv_b|o)_proj(_with_mqa)?$',
              're:.*\\.mlp\\.shared_experts\\.(gate|up|down)_proj$', 're:.*\\.mlp\\.(gate|up|down)_proj$']
    method: gptq
    scheme: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 32}
ignore: ['re:.*\\.mlp\\.gate$', 'lm_head']
kv_cache: {strategy: tensor}
"""


# asymmetric INT4 experts: the codes, scales and zero points travel between the ranks (share_expert_weights)
ASYM_EXPERTS = """\
name: asym-experts-gptq
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']
    method: gptq
    scheme: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 32}
ignore: ['re:.*\\.mlp\\.gate$', 'lm_head']
"""


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


# more sampled tokens than AWQ's NORM_SEARCH_TOKENS (512): the norm-scale search's two rounds, split over ranks
AWQ_ROUNDS_CAL = ["--num-samples", "12", "--seq-len", "64"]


def _cal(recipe) -> list[str]:
    if str(recipe).endswith("dense-gptq-kv.yaml"):
        return DENSE_CAL
    return AWQ_ROUNDS_CAL if str(recipe).endswith("awq-two-rounds.yaml") else CAL


def _convert(n: int, src, out, recipe, *extra, script: Path | None = None):
    """`quantkit convert` on n ranks (n == 1: a plain process, no torch.distributed)."""
    if n == 1 and script is None:
        cmd = [sys.executable, "-m", "quantkit"]
    else:
        cmd = TORCHRUN + [f"--nproc-per-node={n}"] + ([str(script)] if script else ["-m", "quantkit"])
    return run_bounded(cmd + ["convert", str(src), str(out), "-r", str(recipe), *_cal(recipe), *map(str, extra)],
                       env=ENV, timeout=300)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from quantkit.testing import make_tiny_model

    d = tmp_path_factory.mktemp("calib-dist")
    # a dense first layer, then two MoE layers of 8 routed experts and a shared expert
    return make_tiny_model("deepseek_v3", d / "src", layers=3, experts=8, max_shard_size="200KB")


@pytest.fixture(scope="module")
def dense_recipe(tmp_path_factory):
    p = tmp_path_factory.mktemp("recipe") / "dense-gptq-kv.yaml"
    p.write_text(DENSE)
    return p


@pytest.fixture(scope="module")
def awq_rounds_recipe(tmp_path_factory):
    """The shipped int4-experts-awq recipe under a name that gets AWQ_ROUNDS_CAL."""
    import quantkit

    p = tmp_path_factory.mktemp("recipe") / "awq-two-rounds.yaml"
    p.write_text((Path(quantkit.__file__).parent / "data" / "recipes" / "int4-experts-awq.yaml").read_text())
    return p


@pytest.fixture(scope="module")
def reference(src, dense_recipe, tmp_path_factory):
    """The single-process outputs, one per recipe, made once."""
    made = {}

    def get(recipe):
        if recipe not in made:
            out = tmp_path_factory.mktemp("single") / "q"
            p = _convert(1, src, out, recipe)
            assert p.returncode == 0, p.stderr[-3000:]
            made[recipe] = _files(out)
        return made[recipe]

    return get


@pytest.mark.parametrize("ranks", [2, 3])
def test_gptq_dense_and_kv_byte_identical(src, dense_recipe, reference, tmp_path, ranks):
    ref = reference(dense_recipe)
    out = tmp_path / "q"
    p = _convert(ranks, src, out, dense_recipe)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"over {ranks} ranks" in p.stderr
    got = _files(out)
    assert sorted(got) == sorted(ref)
    for name in ref:  # every output file: shards, index, config, KV scales, manifest, card
        assert got[name] == ref[name], name
    assert "model-kv-scales.safetensors" in got


def test_bfloat16_layers_byte_identical(src, tmp_path):
    """`--compute-dtype bfloat16` (the layers and activations in bfloat16, as on a GPU) on two ranks: the
    same bytes as one process in bfloat16, and not float32's."""
    outs = {}
    for ranks, dtype in ((1, "bfloat16"), (2, "bfloat16"), (1, "float32")):
        out = tmp_path / f"q{ranks}-{dtype}"
        p = _convert(ranks, src, out, "int4-experts-gptq", "--compute-dtype", dtype)
        assert p.returncode == 0, p.stderr[-3000:]
        outs[ranks, dtype] = _files(out)
    assert outs[2, "bfloat16"] == outs[1, "bfloat16"]
    shards = [n for n in outs[1, "float32"] if n.endswith(".safetensors")]
    assert shards and any(outs[1, "float32"][n] != outs[1, "bfloat16"][n] for n in shards)


@pytest.mark.parametrize("recipe,ranks", [("int4-experts-awq", 3), ("int4-experts-gptq", 2)])
def test_experts_only_byte_identical(src, reference, tmp_path, recipe, ranks):
    """Routed experts alone: AWQ, and GPTQ with its split forward (the statistics replayed on the owners
    outside the forward)."""
    out = tmp_path / "q"
    p = _convert(ranks, src, out, recipe, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    assert _files(out) == reference(recipe)
    # the per-rank timeline (quantkit/timeline.py): every rank forwarded, gathered statistics and solved its
    # share, exchanged tensors and waited at the steps' checks
    timelines = json.loads(p.stdout[p.stdout.find("{"):])["timeline"]["ranks"]
    assert [t["rank"] for t in timelines] == list(range(ranks))
    for t in timelines:
        for name in ("load", "forward", "statistics", "solve", "exchange", "wait"):
            assert t["phases"].get(name, 0) > 0, (t["rank"], name, t["phases"])
        assert len(t["layers"]) == 3
        # the waits split by the step they followed, adding up to the wait phase (each rounded to 1e-4 s)
        after = t["wait_after"]
        assert {"statistics", "solve", "forward"} <= set(after), after
        assert abs(sum(after.values()) - t["phases"]["wait"]) < 1e-4 * (len(after) + 1), (after, t["phases"])


def test_asymmetric_experts_byte_identical(src, reference, tmp_path_factory, tmp_path):
    """GPTQ on asymmetric INT4 experts, 2 ranks: the receivers dequantize the owners' codes, scales and zero
    points to the weights the owners wrote back, so the next layers see the same inputs: the same bytes."""
    recipe = tmp_path_factory.mktemp("recipe") / "asym-experts-gptq.yaml"
    recipe.write_text(ASYM_EXPERTS)
    out = tmp_path / "q"
    p = _convert(2, src, out, recipe)
    assert p.returncode == 0, p.stderr[-3000:]
    got = _files(out)
    assert got == reference(recipe)
    assert any(b"weight_zero_point" in v for k, v in got.items() if k.endswith(".safetensors"))


def test_starved_experts_all_token_fallback_byte_identical(src, reference, tmp_path_factory, tmp_path):
    """Every expert under `min_tokens` with the all-token fallback: the replay sums the all-token Hessian
    (reduce decides it from the routed counts before the replay; with every expert covered it skips it, the
    tests above), and 2 ranks write one process's bytes."""
    import quantkit

    recipe = tmp_path_factory.mktemp("recipe") / "starved.yaml"
    shipped = (Path(quantkit.__file__).parent / "data" / "recipes" / "int4-experts-gptq.yaml").read_text()
    assert "fallback: all_tokens" in shipped
    recipe.write_text(shipped.replace("fallback: all_tokens", "fallback: all_tokens\n      min_tokens: 100000"))
    out = tmp_path / "q"
    p = _convert(2, src, out, recipe)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _files(out) == reference(recipe)
    tensors = json.loads((out / "quantkit_manifest.json").read_text())["tensors"]
    reasons = [t.get("fallback") or "" for n, t in tensors.items() if ".experts." in n and n.endswith("_packed")]
    assert reasons and all("Hessian from all tokens" in r for r in reasons)


def test_affinity_statistics_split_byte_identical(src, reference, tmp_path_factory, tmp_path):
    """GPTQ with `stats: affinity` (top-3 of 8 experts): the router's affinities are computed from the
    replayed inputs on each owner, so 2 ranks write the single process's bytes."""
    import quantkit

    text = (Path(quantkit.__file__).parent / "data" / "recipes" / "int4-experts-gptq.yaml").read_text()
    recipe = tmp_path_factory.mktemp("recipe") / "affinity.yaml"
    recipe.write_text(text.replace("      block_size: 128\n", "      block_size: 128\n      stats: affinity\n"
                                   "      affinity_top_k: 3\n"))
    out = tmp_path / "q"
    p = _convert(2, src, out, recipe)
    assert p.returncode == 0, p.stderr[-3000:]
    got = _files(out)
    assert got == reference(recipe)
    assert b'"affinity_tokens"' in got["quantkit_manifest.json"]


def test_fit_unquantized_byte_identical(src, reference, tmp_path):
    """`int4-experts-gptq-fit`: each rank forwards its batches of the unquantized model's stream too, the replay
    broadcasts those rows beside the quantized ones, and 2 ranks write the single process's bytes."""
    out = tmp_path / "q"
    p = _convert(2, src, out, "int4-experts-gptq-fit")
    assert p.returncode == 0, p.stderr[-3000:]
    assert _files(out) == reference("int4-experts-gptq-fit")


def test_fit_down_byte_identical(src, reference, tmp_path):
    """`int4-experts-gptq-asym` (fit_down): every rank keeps the replayed batches' expert inputs for its owned
    experts' down_proj statistics, and 2 ranks write the single process's bytes."""
    out = tmp_path / "q"
    p = _convert(2, src, out, "int4-experts-gptq-asym")
    assert p.returncode == 0, p.stderr[-3000:]
    got = _files(out)
    assert got == reference("int4-experts-gptq-asym")
    assert b'"fit_down": 0.5' in got["quantkit_manifest.json"]


def test_balance_top_up_byte_identical(src, reference, tmp_path_factory, tmp_path):
    """GPTQ with `balance_tokens`: the top-up pool's batches are replayed in batch order after the calibration
    samples' on every rank, so each owner tops up its experts from the same rows, and 2 ranks write the
    single process's bytes."""
    import quantkit

    text = (Path(quantkit.__file__).parent / "data" / "recipes" / "int4-experts-gptq.yaml").read_text()
    recipe = tmp_path_factory.mktemp("recipe") / "balance.yaml"
    recipe.write_text(text.replace("      block_size: 128\n", "      block_size: 128\n      balance_tokens: 64\n"))
    out = tmp_path / "q"
    p = _convert(2, src, out, recipe)
    assert p.returncode == 0, p.stderr[-3000:]
    got = _files(out)
    assert got == reference(recipe)
    assert b'"pool_tokens"' in got["quantkit_manifest.json"] and b'"pool_samples": 8' in got["quantkit_manifest.json"]


@pytest.mark.parametrize("recipe,ranks", [("nvfp4a4-experts", 2), ("kimi-k2-nvfp4a4", 3)])
def test_w4a4_input_scales_byte_identical(src, reference, tmp_path, recipe, ranks):
    """NVFP4 W4A4: each rank observes its batches' expert input amax, the maxima and token counts are gathered
    (RTN: the pass only observes; GPTQ: beside the Hessians): the single process's bytes, scales included."""
    out = tmp_path / "q"
    p = _convert(ranks, src, out, recipe)
    assert p.returncode == 0, p.stderr[-3000:]
    got = _files(out)
    assert got == reference(recipe)
    assert any(b"input_global_scale" in v for k, v in got.items() if k.endswith(".safetensors"))


def test_awq_norm_search_rounds_split_byte_identical(src, reference, awq_rounds_recipe, tmp_path):
    """AWQ on 768 sampled tokens: the norm-scale candidates of both rounds and the per-expert searches split
    over 3 ranks write the single process's bytes."""
    out = tmp_path / "q"
    p = _convert(3, src, out, awq_rounds_recipe)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _files(out) == reference(awq_rounds_recipe)


RANKED = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import quantkit.calib.spool as spool
    import quantkit.calib.layer as lay
    from quantkit.cli import main
    from quantkit.errors import QuantkitError
    rank = int(os.environ["RANK"])
    mode, marker = os.environ["QK_TEST_MODE"], Path(os.environ["QK_TEST_MARKER"])
    if rank == 1 and mode == "kill":
        real = spool.quantize_layer
        def quantize_layer(ckpt, recipe, step, *a, **k):
            if step.index == 2 and not marker.exists():  # the first run only: SIGKILL mid-pass
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return real(ckpt, recipe, step, *a, **k)
        spool.quantize_layer = quantize_layer
    if rank == 1 and mode == "fail":
        def gptq_experts(*a, **k):
            raise QuantkitError("injected solver failure")
        lay.gptq_experts = gptq_experts
    main(sys.argv[1:])
""")


def _ranked(tmp_path, mode, src, out, recipe):
    script = tmp_path / "ranked.py"
    script.write_text(RANKED)
    env = {**ENV, "QK_TEST_MODE": mode, "QK_TEST_MARKER": str(tmp_path / "killed")}
    cmd = TORCHRUN + ["--nproc-per-node=2", str(script), "convert", str(src), str(out), "-r", str(recipe),
                      *_cal(recipe)]
    return run_bounded(cmd, env=env, timeout=300)


# QUANTKIT_DIST_STRESS=N runs the kill-and-resume test N times in a row (the stress run in docs/distributed.md)
@pytest.mark.parametrize("attempt", range(int(os.environ.get("QUANTKIT_DIST_STRESS", "1"))))
def test_a_rank_killed_mid_pass_resumes_to_the_same_bytes(src, dense_recipe, reference, tmp_path, attempt):
    out = tmp_path / "q"
    first = _ranked(tmp_path, "kill", src, out, dense_recipe)
    assert first.returncode != 0 and (tmp_path / "killed").exists()
    spool = out / ".quantkit-journal" / "calib"
    assert (spool / "progress.json").is_file()
    assert sorted(p.name for p in spool.glob("activations-*.bin")) == [
        "activations-00002-rank0-of-2.bin", "activations-00002-rank1-of-2.bin"]
    again = _ranked(tmp_path, "kill", src, out, dense_recipe)  # the same command; the marker says it happened
    assert again.returncode == 0, again.stderr[-3000:]
    assert "terminate called" not in again.stderr  # a rank that aborted at exit after the job was done
    assert "resuming calibration at layer 2 of 3" in again.stderr
    assert _files(out) == reference(dense_recipe)


def test_a_rank_killed_mid_fit_resumes_from_both_streams(src, reference, tmp_path):
    """`int4-experts-gptq-fit` on 2 ranks, rank 1 SIGKILLed at layer 2: each rank's part of the unquantized
    model's stream is in the spool beside its activations, and the same command resumes at layer 2 to the
    single process's bytes."""
    out = tmp_path / "q"
    first = _ranked(tmp_path, "kill", src, out, "int4-experts-gptq-fit")
    assert first.returncode != 0 and (tmp_path / "killed").exists()
    spool = out / ".quantkit-journal" / "calib"
    assert sorted(p.name for p in spool.glob("reference-*.bin")) == [
        "reference-00002-rank0-of-2.bin", "reference-00002-rank1-of-2.bin"]
    again = _ranked(tmp_path, "kill", src, out, "int4-experts-gptq-fit")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming calibration at layer 2 of 3" in again.stderr
    assert _files(out) == reference("int4-experts-gptq-fit")


def test_a_rank_failing_mid_pass_stops_every_rank(src, tmp_path):
    p = _ranked(tmp_path, "fail", src, tmp_path / "q", "int4-experts-gptq")
    assert p.returncode != 0
    assert "injected solver failure" in p.stderr  # rank 1's own error
    assert "rank 1 failed while quantizing the experts of decoder layer 1" in p.stderr  # and rank 0's


STATS = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import save_file
    from quantkit.dist import world
    from quantkit.calib.executor import LayerExecutor
    from quantkit.calib.parallel import Parallel
    from quantkit.calib.hessians import ExpertStats, LinearStats, reduce_linear_stats
    from quantkit.calib.gptq_pass import expert_group_size, expert_owners
    from quantkit.calib.spool import pass_batch_tokens
    src, out = sys.argv[1], sys.argv[2]
    w = world()
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 512, (32,), generator=g) for _ in range(8)]
    ex = LayerExecutor(src)
    ex.batch_tokens = pass_batch_tokens(ex.batch_tokens, [32] * 8)
    par = Parallel(w, [32] * 8, ex.batch_tokens)
    dp = par if par.distributed else None
    if dp:
        ex.share = set(par.mine)
    found = {}
    for step in ex.layers(samples):
        i, layer = step.index, step.layer
        experts = getattr(layer.mlp, "experts", None)
        stats = None
        if experts is not None:
            e, _, h = experts.gate_up_proj.shape
            group = expert_group_size(e, h, experts.down_proj.shape[-1], experts.gate_up_proj.device)
            own = expert_owners(e, group, par)
            stats = ExpertStats(experts, True, 4096, par=dp,
                                owned=torch.tensor([o == par.rank for o in own]) if dp else None)
        lin = {"o": LinearStats(layer.self_attn.o_proj, dp)}
        step.forward()
        for s in [stats, *lin.values()]:
            if s is not None:
                s.remove()
        owner = {"o": par.dense_owner(i)}
        if dp:
            if stats is not None:
                stats.reduce()
            reduce_linear_stats(dp, lin, owner)
        if owner["o"] == par.rank:
            found[f"{i}.o"] = lin["o"].h
        if stats is not None:
            found[f"{i}.all"] = stats.h_all
            found[f"{i}.counts"] = stats.counts
            for j in range(e):
                if own[j] == par.rank:
                    r = int(stats.slot[j])
                    found[f"{i}.gu.{j}"], found[f"{i}.down.{j}"] = stats.h_gu[r], stats.h_down[r]
            # only the owned experts' Hessians are held on this rank
            assert stats.h_gu.shape[0] == sum(o == par.rank for o in own) == int((stats.slot >= 0).sum())
        step.forward()
    save_file({k: v.contiguous() for k, v in found.items()}, f"{out}/rank{par.rank}.safetensors")
""")


def test_statistics_bit_identical_on_their_owners(src, tmp_path):
    """The Hessians each owner ends with, merged over the ranks, equal one process's bit for bit (and the
    merged key sets are the same: every expert has exactly one owner). A change of summation order (the
    batches taken in rank order, say) fails here even where the packed INT4 output does not move."""
    from safetensors.torch import load_file

    script = tmp_path / "stats.py"
    script.write_text(STATS)
    merged = {}
    for n in (1, 3):  # 1: a plain process; 3 ranks: groups of experts spread unevenly (2 ranks: the tests above)
        out = tmp_path / f"w{n}"
        out.mkdir()
        launch = [sys.executable] if n == 1 else TORCHRUN + [f"--nproc-per-node={n}"]
        p = run_bounded(launch + [str(script), str(src), str(out)], env=ENV, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        got = {}
        for r in range(n):
            part = load_file(out / f"rank{r}.safetensors")
            for k, v in part.items():
                if k.split(".")[1] in ("all", "counts"):  # every rank holds these: all equal
                    assert k not in got or torch.equal(got[k], v), k
                else:
                    assert k not in got, k  # one owner
                got[k] = v
        merged[n] = got
    assert sorted(merged[1]) == sorted(merged[3])
    assert any(".gu." in k for k in merged[1]) and any(k.endswith(".o") for k in merged[1])
    for k, v in merged[1].items():
        assert torch.equal(merged[3][k], v), k
