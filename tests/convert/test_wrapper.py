"""Kimi K2.5 end to end: a `kimi_k25` wrapper (the deepseek_v3 text model under `language_model.`, a vision
tower beside it), as a BF16 checkpoint and as released (routed experts already INT4, QAT).

What must hold: the vision tensors are copied byte for byte; INT4 experts pass through unchanged; the KV
scales carry the wrapper's prefix (vLLM's kimi_k25 loader raises on a bare `model.layers...` name); the
config's ignore/targets hold under both module namings (vLLM: `language_model.model.layers.L`,
transformers' own class: `model.language_model.layers.L`); `verify` (transformers through the
image-text-to-text class), `verify --engine vllm`, `plan` and `inspect` accept the outputs."""

from __future__ import annotations

import json
import re

import pytest
import torch

from quantkit.calibrate import CalibrateOptions, calibrate, write_scales
from quantkit.convert import ConvertOptions, convert
from quantkit.engine.vllm import check as engine_check
from quantkit.inspect import inspect_checkpoint
from quantkit.pack import kv as kvrules
from quantkit.plan import plan
from quantkit.read.checkpoint import Checkpoint
from quantkit.read.tensors import TensorReader
from quantkit.verify import VerifyOptions, verify

P = "language_model."
CAL = dict(num_samples=2, seq_len=16)


def _tensors(d):
    ck = Checkpoint.open(d)
    with TensorReader.of(ck) as r:
        return {n: r.get(n).clone() for n in ck.location}


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    from quantkit.testing import make_tiny_model

    d = tmp_path_factory.mktemp("k25")
    bf16 = make_tiny_model("kimi_k25", d / "bf16")
    int4 = make_tiny_model("kimi_k25", d / "int4", int4_experts=True)
    scales = d / "kv.safetensors"
    write_scales(calibrate(str(int4), CalibrateOptions(**CAL)), scales)
    return bf16, int4, scales


def _names_under_both_layouts(name: str) -> tuple[str, str]:
    """An on-disk `language_model.model.X` module as vLLM and as transformers' Kimi K2.5 class call it."""
    text = name.removeprefix(P)
    hf = "model.language_model." + text.removeprefix("model.") if text.startswith("model.") else text
    return name, hf


def _matches(entry: str, module: str) -> bool:
    return re.match(entry[3:], module) is not None if entry.startswith("re:") else entry == module


def test_bf16_wrapper_converts_loads_and_verifies(k25, tmp_path):
    bf16, _, scales = k25
    out = tmp_path / "q"
    res = convert(bf16, out, ConvertOptions(recipe="int4-experts-rtn", kv_scales=str(scales)))
    assert res.tensors_quantized > 0
    src, got = _tensors(bf16), _tensors(out)
    vision = [n for n in src if not n.startswith(P)]
    assert vision and all(_same(src[n], got[n]) for n in vision)
    kv = sorted(n for n in got if n.endswith(("k_scale", "v_scale")))
    assert kv and all(n.startswith(P + "model.layers.") for n in kv)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # every ignored module stays ignored, and every expert stays targeted, under both namings
    ignored = [n[: -len(".weight")] for n in got if n.endswith(".weight") and got[n].ndim == 2]
    for m in ignored:
        for name in _names_under_both_layouts(m):
            assert any(_matches(e, name) for e in qc["ignore"]), name
    experts = [n[: -len(".weight_packed")] for n in got if n.endswith(".weight_packed")]
    for m in experts:
        for name in _names_under_both_layouts(m):
            assert not any(_matches(e, name) for e in qc["ignore"]), name
    assert "re:(?:.*\\.)?vision_tower\\..*" in qc["ignore"]  # modules the checkpoint does not hold, too
    rep = verify(out, VerifyOptions(reference=bf16, **CAL, generation_tokens=4))
    assert rep.passed, [c for c in rep.checks if c.ok is False]
    assert rep.metrics["kl_divergence"] is not None and rep.metrics["kl_divergence"] < 0.05
    eng = engine_check(out)
    assert not eng.problems and {w["rule"] for w in eng.warnings} == {"K2"}  # MLA scales: the 0.33 caveat


def test_int4_release_passes_through_and_verifies(k25, tmp_path):
    _, int4, scales = k25
    for recipe in ("fp8-kv", "kimi-k2"):
        out = tmp_path / recipe
        res = convert(int4, out, ConvertOptions(recipe=recipe, kv_scales=str(scales), **CAL))
        assert res.tensors_quantized == 0
        assert any("already INT4" in n for n in res.notes)
        src, got = _tensors(int4), _tensors(out)
        assert all(_same(src[n], got[n]) for n in src)  # experts, vision tower, everything: unchanged
        assert sorted(set(got) - set(src)) == sorted(
            kvrules.kv_scale_name(L, k, P) for L in range(2) for k in "kv")
        man = json.loads((out / "quantkit_manifest.json").read_text())
        assert man["identity"]["calibration"] is None  # kimi-k2's GPTQ had nothing left to calibrate
        rep = verify(out, VerifyOptions(reference=int4, **CAL, generation_tokens=0))
        assert rep.passed, [c for c in rep.checks if c.ok is False]
        assert rep.metrics["kl_divergence"] == 0.0
        assert not engine_check(out).problems
    p = plan(int4, "kimi-k2").to_json()
    assert p["checkpoint_bytes"]["recipe"] - p["checkpoint_bytes"]["source"] < 1024  # + the KV scales
    summary = inspect_checkpoint(tmp_path / "kimi-k2")
    assert summary["model_type"] == "kimi_k25"


def test_a_bare_kv_scale_name_is_caught(k25, tmp_path):
    """The name vLLM's wrapper cannot place: verify's format stage and the engine rules both say so."""
    from safetensors.torch import load_file, save_file

    _, int4, scales = k25
    out = tmp_path / "q"
    convert(int4, out, ConvertOptions(recipe="fp8-kv", kv_scales=str(scales)))
    shard = out / kvrules.KV_SHARD_NAME
    sd = load_file(shard)
    save_file({n.removeprefix(P): t for n, t in sd.items()}, shard, metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n.removeprefix(P) if n.endswith("_scale") and "self_attn" in n else n: s
                           for n, s in index["weight_map"].items()}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    rules = {p["rule"] for p in engine_check(out).problems}
    assert "K8" in rules
    rep = verify(out)
    assert not rep.format["ok"]
    assert any("wrapper's loader" in p for p in rep.format["problems"])
