"""--device for calibrate and the calibrated convert: spelling (a usage error), a device that is not there (a
domain error before anything is written), the default (auto = the CPU here) equal to device="cpu" bit for
bit, and the per-layer device memory plan: its estimates against what a layer really allocates, where the
activations go, and a refusal naming the layer, the bytes needed and available, before any work."""

import hashlib
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from quantkit import options
from quantkit.calib.data import CalibrationWarning, load_calibration_data
from quantkit.calib.device import LayerMemory, Placement, compute_dtype, make_plan, resolve_device
from quantkit.calib.executor import LayerExecutor
from quantkit.calib.hessians import ExpertStats
from quantkit.calib.layer import statistics_bytes
from quantkit.calib.spool import run_calibrated
from quantkit.calibrate import CalibrateOptions, calibrate
from quantkit.errors import DeviceError, DeviceMemoryError
from quantkit.match.recipe import load_recipe

from calib.test_passes import recipe
from harness import run_bounded

QK = [sys.executable, "-m", "quantkit.cli"]
CUDA = torch.cuda.is_available()


def run(*args):
    env = {**os.environ, "QUANTKIT_DEBUG": "0"}
    return run_bounded([*QK, *map(str, args)], env=env, timeout=600)


def _samples(n=4, t=32):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        return list(load_calibration_data(None, vocab_size=512, num_samples=n, seq_len=t).samples)


# ---- the option --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, want", [("cpu", "cpu"), (" CUDA ", "cuda"), ("cuda:0", "cuda:0"), ("cuda:07", "cuda:7"),
                                        ("auto", "auto")])
def test_parse_device(spec, want):
    assert options.parse_device(spec) == want


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1:2", "mps", "", "cpu:0", "cuda:１"])
def test_bad_device_strings(spec):
    with pytest.raises(DeviceError, match=re.escape("expected cpu|cuda|cuda:N|auto")):
        options.parse_device(spec)


def test_default_is_shared_and_resolves_here():
    import inspect

    from quantkit.convert import ConvertOptions

    assert options.DEVICE == "auto"
    assert ConvertOptions().device == options.DEVICE
    assert inspect.signature(CalibrateOptions).parameters["device"].default == options.DEVICE
    assert resolve_device(None) == resolve_device("auto") == (torch.device("cuda", torch.cuda.current_device())
                                                             if CUDA else torch.device("cpu"))
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    for spec in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(DeviceError, match="CUDA") as e:
            resolve_device(spec)
        assert spec in e.value.message and "--device cpu" in e.value.hint


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_index_out_of_range():
    with pytest.raises(DeviceError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_cli_device_errors(tiny_models, tmp_path):
    src = tiny_models("qwen3_moe")
    p = run("calibrate", src, "-o", tmp_path / "kv.safetensors", "--device", "cuda", "--num-samples", "2",
            "--seq-len", "16")
    assert p.returncode == 1 and "error: device 'cuda' asked for" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "kv.safetensors").exists()
    p = run("calibrate", src, "-o", tmp_path / "kv.safetensors", "--device", "gpu")
    assert p.returncode == 2 and "--device" in p.stderr
    # a calibrated convert stops before writing anything; an RTN convert does not need the device
    p = run("convert", src, tmp_path / "gptq", "--recipe", "int4-experts-gptq", "--device", "cuda:1",
            "--num-samples", "2", "--seq-len", "16")
    assert p.returncode == 1 and "cuda:1" in p.stderr and not (tmp_path / "gptq").exists()
    p = run("convert", src, tmp_path / "rtn", "--recipe", "int4-experts-rtn", "--device", "cuda", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["device"] is None and doc["device_memory"] is None  # nothing calibrated
    p = run("convert", src, tmp_path / "x", "--device", "tpu")
    assert p.returncode == 2 and not (tmp_path / "x").exists()


# ---- --compute-dtype ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, want", [("auto", "auto"), (" BF16", "bfloat16"), ("bfloat16", "bfloat16"),
                                        ("fp32", "float32"), ("Float32 ", "float32")])
def test_parse_compute_dtype(spec, want):
    assert options.parse_compute_dtype(spec) == want


@pytest.mark.parametrize("spec", ["half", "float16", "fp8", "", "bfloat", "float64", None])
def test_bad_compute_dtypes(spec):
    with pytest.raises(DeviceError, match=re.escape("expected auto|float32|bfloat16")):
        options.parse_compute_dtype(spec)


def test_compute_dtype_by_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # only the device's type is read
    assert compute_dtype(cpu) == compute_dtype(cpu, "auto") == torch.float32
    assert compute_dtype(gpu) == compute_dtype(gpu, "auto") == torch.bfloat16
    assert compute_dtype(cpu, "bf16") == compute_dtype(gpu, "bfloat16") == torch.bfloat16
    assert compute_dtype(gpu, "float32") == torch.float32 and compute_dtype(cpu, torch.float16) == torch.float16
    with pytest.raises(DeviceError):
        compute_dtype(cpu, "int8")


def test_onednn_caches_bounded_only_for_cpu_bfloat16():
    from quantkit.calib.device import bound_primitive_cache

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    for dev, dt in ((cpu, torch.float32), (gpu, torch.bfloat16)):
        env = {}
        bound_primitive_cache(dev, dt, env)
        assert env == {}
    env = {}
    bound_primitive_cache(cpu, torch.bfloat16, env)
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "128"}
    env = {"LRU_CACHE_CAPACITY": "1024"}  # the user's own setting stays
    bound_primitive_cache(cpu, torch.bfloat16, env)
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "1024"}


def test_cli_compute_dtype(tiny_models, tmp_path):
    """bfloat16 layers on the CPU: reported, part of the output's identity (a float32 output is not continued
    in bfloat16), a valid GPTQ checkpoint close to the float32 one; a misspelling is a usage error."""
    src = tiny_models("qwen3_moe", experts=8)
    common = ["--recipe", "int4-experts-gptq", "--num-samples", "4", "--seq-len", "32", "--json"]
    p = run("convert", src, tmp_path / "x", *common, "--compute-dtype", "half")
    assert p.returncode == 2 and "--compute-dtype" in p.stderr and not (tmp_path / "x").exists()
    docs, idents = {}, {}
    for dt in ("float32", "bf16"):
        p = run("convert", src, tmp_path / dt, *common, "--compute-dtype", dt)
        assert p.returncode == 0, p.stderr
        docs[dt] = json.loads(p.stdout)
        idents[dt] = json.loads((tmp_path / dt / "quantkit_manifest.json").read_text())["identity"]
    assert docs["float32"]["device_memory"]["dtype"] == "float32"
    assert docs["bf16"]["device_memory"]["dtype"] == "bfloat16"
    assert idents["float32"]["compute_dtype"] == "float32" and idents["bf16"]["compute_dtype"] == "bfloat16"
    man = json.loads((tmp_path / "bf16" / "quantkit_manifest.json").read_text())
    assert man["calibration"]["compute_dtype"] == "bfloat16"
    assert "layers computed in bfloat16" in (tmp_path / "bf16" / "README.md").read_text()
    assert {k: v for k, v in idents["float32"].items() if k != "compute_dtype"} == \
        {k: v for k, v in idents["bf16"].items() if k != "compute_dtype"}
    # a float32 output cut off before its end is not continued in bfloat16 (nothing is touched), only in float32
    m = tmp_path / "float32" / "quantkit_manifest.json"
    done = m.read_text()
    m.write_text(json.dumps({"status": "in_progress", "identity": idents["float32"]}))
    p = run("convert", src, tmp_path / "float32", *common, "--compute-dtype", "bfloat16")
    assert p.returncode == 1 and "refusing to mix them" in p.stderr and "Traceback" not in p.stderr
    p = run("convert", src, tmp_path / "float32", *common, "--compute-dtype", "auto")  # auto is float32 here
    assert p.returncode == 0, p.stderr
    assert m.read_text() == done
    # the two checkpoints differ (the layers' rounding) and both verify against the source
    a = {q.name: hashlib.sha256(q.read_bytes()).hexdigest() for q in sorted((tmp_path / "float32").glob("*.safetensors"))}
    b = {q.name: hashlib.sha256(q.read_bytes()).hexdigest() for q in sorted((tmp_path / "bf16").glob("*.safetensors"))}
    assert a.keys() == b.keys() and a != b
    for dt in ("float32", "bf16"):
        p = run("verify", tmp_path / dt, "--reference", src, "--json")
        assert p.returncode == 0, p.stdout + p.stderr
    p = run("calibrate", src, "-o", tmp_path / "kv.safetensors", "--num-samples", "2", "--seq-len", "16",
            "--compute-dtype", "bfloat16", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["device_memory"]["dtype"] == "bfloat16"


# ---- device="cpu" is the default, bit for bit ----------------------------------------------------------------
def test_cpu_equals_default_calibrate(tiny_models):
    path = tiny_models("deepseek_v3", layers=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        a = calibrate(path, CalibrateOptions(num_samples=4, seq_len=32))
        b = calibrate(path, CalibrateOptions(num_samples=4, seq_len=32, device="cpu"))
    assert a.scales.keys() == b.scales.keys() and all(torch.equal(a.scales[k], b.scales[k]) for k in a.scales)
    ja, jb = a.to_json(), b.to_json()
    for j in (ja, jb):
        j.pop("seconds"), j.pop("peak_rss_bytes")
    assert ja == jb and ja["device"] == "cpu"
    mem = ja["device_memory"]
    assert mem["available_bytes"] is None and mem["activations"] == "host" and mem["measured_peak_bytes"] is None
    assert len(mem["layers"]) == 3 and mem["estimated_peak_bytes"] == max(m["total"] for m in mem["layers"])


def test_cpu_equals_default_convert(tiny_models, tmp_path):
    from quantkit.convert import ConvertOptions, convert

    src = tiny_models("qwen3_moe", experts=8)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": s.tolist()}) + "\n" for s in _samples(4, 32)))
    outs = {}
    for name, kw in (("default", {}), ("cpu", {"device": "cpu"})):
        res = convert(src, tmp_path / name, ConvertOptions(recipe="int4-experts-gptq", dataset=str(calib),
                                                           model_card=False, **kw))
        assert res.device == "cpu" and res.device_memory["layers"]
        outs[name] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                      for p in sorted((tmp_path / name).glob("*.safetensors"))}
    assert outs["default"] == outs["cpu"] and outs["cpu"]


# ---- the memory plan ----------------------------------------------------------------------------------------
def _layers():
    return [LayerMemory(0, 100, 50, {"hessians": 10}), LayerMemory(1, 300, 50, {"hessians": 40, "solve": 60})]


def test_a_layer_peaks_in_its_forward_or_its_solve_not_both():
    """A forward call (with its statistics' gathers) and a solve never overlap: the layer's peak holds the
    weights, what the pass keeps throughout, and the larger of the two phases."""
    m = LayerMemory(0, 1000, 50, {"hessians": 40, "samples": 5, "gram": 30, "input_amax": 1, "solve": 70,
                                  "dense_solve": 20})
    assert m.without_activations == 1000 + 45 + max(50 + 30 + 1, 70)
    m = LayerMemory(0, 1000, 50, {"hessians": 40, "gram": 30, "solve": 90, "dense_solve": 100})
    assert m.without_activations == 1000 + 40 + 100
    assert LayerMemory(0, 1000, 50, {"hessians": 40}).without_activations == 1090


def test_plan_places_activations_and_refuses_before_work():
    gpu = torch.device("cuda", 0)  # a device object only: nothing runs on it
    layers = _layers()  # without activations: 160 and 400 bytes
    p = make_plan(gpu, torch.bfloat16, layers, activation_bytes=50, available=500)
    assert p.activations == "device" and p.peak.layer == 1 and p.peak_bytes == 400 + 100
    assert [m.total for m in p.layers] == [260, 500]
    p = make_plan(gpu, torch.bfloat16, layers, activation_bytes=51, available=500)
    assert p.activations == "host" and p.peak_bytes == 400  # 400 + 2 x 51 > 500: activations in host memory
    assert make_plan(gpu, torch.bfloat16, layers, 10, available=400).activations == "host"
    with pytest.raises(DeviceMemoryError) as e:
        make_plan(gpu, torch.bfloat16, layers, 0, available=399)
    msg = e.value.message
    assert "decoder layer 1 needs 400 bytes" in msg and "399 bytes" in msg and "cuda:0" in msg
    assert "hessians" in msg and "--device cpu" in e.value.hint
    cpu = make_plan(torch.device("cpu"), torch.float32, layers, 10 ** 12, available=None)  # the CPU: no check
    assert cpu.activations == "host" and cpu.available_bytes is None and cpu.to_json()["peak_layer"] == 1


def test_executor_refuses_before_reading_a_layer(tiny_models, monkeypatch):
    path = tiny_models("qwen3_moe", experts=8)
    loaded = []
    real = LayerExecutor.load_layer
    monkeypatch.setattr(LayerExecutor, "load_layer", lambda self, i: loaded.append(i) or real(self, i))
    ex = LayerExecutor(path, available_bytes=10 ** 9)
    plan = ex.plan_memory([32] * 4)
    need = plan.peak.without_activations
    ex = LayerExecutor(path, available_bytes=need - 1)
    with pytest.raises(DeviceMemoryError, match=rf"decoder layer {plan.peak.layer} needs {need} bytes .* but "
                                                rf"{need - 1} bytes"):
        ex.run(_samples())
    assert loaded == []
    with pytest.raises(DeviceMemoryError), warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        calibrate(path, CalibrateOptions(num_samples=4, seq_len=32, available_bytes=1000))
    assert loaded == []


def test_calibrated_pass_refuses_before_any_work(tiny_models, tmp_path, monkeypatch):
    path = tiny_models("qwen3_moe", experts=8)
    monkeypatch.setattr(LayerExecutor, "load_layer", lambda self, i: pytest.fail("a layer was read"))
    with pytest.raises(DeviceMemoryError, match="decoder layer"):
        run_calibrated(path, recipe("gptq"), _samples(), tmp_path / "spool", placement=Placement(available_bytes=4096))
    assert not (tmp_path / "spool").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimates_match_what_a_layer_allocates(tiny_models, dtype):
    """Weights: exactly the bytes of the materialized layer (bfloat16 keeps DeepSeek's router float32);
    GPTQ statistics: exactly the Hessians ExpertStats allocates; the plan reports every layer."""
    path = tiny_models("deepseek_v3", layers=3, experts=8)
    ex = LayerExecutor(path, dtype=dtype)
    rec = load_recipe("int4-experts-gptq")
    lengths = [32] * 4
    plan = ex.plan_memory(lengths, statistics=lambda i, layer: statistics_bytes(
        ex.ckpt, rec, i, layer, ex.device, ex.dtype, ex.call_tokens(lengths), lengths))
    assert [m.layer for m in plan.layers] == [0, 1, 2] and plan.activation_bytes == 128 * 128 * dtype.itemsize
    assert plan.layers[0].statistics == {}  # the dense first layer: nothing calibrated
    for i in range(3):
        layer = ex.load_layer(i)
        real = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
        assert plan.layers[i].weights == real
        if i:
            stats = ExpertStats(layer.mlp.experts, need_hessians=True, sample_tokens=4096)
            h = sum(t.numel() * t.element_size() for t in (stats.h_gu, stats.h_down, stats.h_all))
            stats.remove()
            assert plan.layers[i].statistics["hessians"] == h
            assert plan.layers[i].statistics["solve"] > 0 and plan.layers[i].forward > 0
        ex.free_layer(i)
    assert plan.peak.total == max(m.total for m in plan.layers)
    line = plan.summary()
    assert line.startswith("calibrating on cpu") and "activations" in line


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_replay_buffers_of_several_ranks_are_planned(tiny_models, ranks):
    """On several ranks GPTQ's statistics also hold the replay's tensors (hessians.ExpertStats.reduce): the
    MoE inputs (float32), top-k indices (int64) and weights (float32) of the batches this rank forwarded, and
    two other batches' at a time. The busiest rank's, from the pass's own batch plan, are within the plan."""
    from quantkit.calib.activations import batch_plan
    from quantkit.calib.parallel import assign_batches
    from quantkit.calib.spool import pass_batch_tokens

    path = tiny_models("deepseek_v3", layers=2, experts=8)
    ex = LayerExecutor(path)
    rec = load_recipe("int4-experts-gptq")
    lengths = [32] * 12
    ex.batch_tokens = pass_batch_tokens(ex.batch_tokens, lengths)
    layer = ex.load_layer(1)
    h, k = ex.hidden_size, int(layer.mlp.gate.top_k)
    one = statistics_bytes(ex.ckpt, rec, 1, layer, ex.device, ex.dtype, ex.call_tokens(lengths), lengths)
    many = statistics_bytes(ex.ckpt, rec, 1, layer, ex.device, ex.dtype, ex.call_tokens(lengths), lengths, ranks)
    assert "replay" not in one and many["hessians"] < one["hessians"]
    row = h * 4 + k * (8 + 4)
    tokens = [sum(lengths[i] for i in c) for c in batch_plan(lengths, ex.batch_tokens)]
    owner = assign_batches(tokens, ranks)
    for r in range(ranks):
        own = sum(t for t, o in zip(tokens, owner) if o == r)
        others = sorted((t for t, o in zip(tokens, owner) if o != r), reverse=True)[:2]
        assert (own + sum(others)) * row <= many["replay"]
    ex.free_layer(1)


@pytest.mark.parametrize("method", ["gptq", "awq", "gptq-fit"])
def test_gpu_numerics_emulated_on_the_cpu(tiny_models, tmp_path, monkeypatch, method):
    """What a GPU computes in (bfloat16 layers and activations, float32 GPTQ solves), run on the CPU: the
    pass works end to end in those dtypes and stays within bench/calib_cuda.py's tolerances of the float32
    pass (mean SQNR against the source within 0.5 dB; GPTQ: per-module agreement median >= 12 dB; AWQ may
    fold other scales, so its stored weights are compared through the manifest's unfolded SQNR only)."""
    import statistics

    from quantkit.calib import gptq_pass
    from quantkit.quant.int4 import sqnr_db

    from calib.test_passes import spool_weights

    path = tiny_models("qwen3_moe")
    samples = _samples(4, 32)
    # CPU bfloat16 index_add_ is slow; gptq-fit: GPTQ fitted to the unquantized model (its stream in bfloat16)
    rec = recipe(method.split("-")[0], **({"n_grid": 5} if method == "awq" else
                                          {"fit_unquantized": 0.5} if method == "gptq-fit" else {}))
    ref = run_calibrated(path, rec, samples, tmp_path / "f32")
    monkeypatch.setattr(gptq_pass, "solve_dtype", lambda device: torch.float32)
    got = run_calibrated(path, rec, samples, tmp_path / "bf16", placement=Placement(dtype=torch.bfloat16))
    assert got["memory"]["dtype"] == "bfloat16" and ref["memory"]["dtype"] == "float32"
    assert got["modules"].keys() == ref["modules"].keys()
    if method.startswith("gptq"):
        wr, wg = spool_weights(tmp_path / "f32", ref), spool_weights(tmp_path / "bf16", got)
        assert wr and wr.keys() == wg.keys()
        assert statistics.median(float(sqnr_db(wr[k], wg[k])) for k in wr) >= 12.0
    mean = {n: statistics.fmean(m["sqnr_db"] for m in idx["modules"].values()) for n, idx in (("f32", ref), ("bf16", got))}
    assert abs(mean["f32"] - mean["bf16"]) <= 0.5
