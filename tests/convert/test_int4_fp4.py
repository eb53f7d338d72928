"""An INT4 release (Kimi K2.5 / K2.6: routed experts QAT-trained on a 15-level grid, compressed-tensors
pack-quantized group 32 symmetric) re-quantized to NVFP4 / MXFP4.

What must hold: the INT4 experts are decoded on read (as compressed-tensors decompresses them, rounded to
BF16) and re-quantized, giving exactly the bytes a conversion of the release's BF16 dequantization gives
(llm-compressor's dequantize-then-quantize path), with no BF16 copy on disk; the manifest records each
module's SQNR against the decoded INT4 weight; compressed-tensors' decompressor judges the format (verify);
vLLM's loader rules hold (gate/up share one global scale); plan predicts the tensors; INT4 -> INT4 stays a
pass-through; GPTQ on the FP4 grid runs from the INT4 source."""

from __future__ import annotations

import json

import pytest
import torch

from quantkit.convert import ConvertOptions, convert
from quantkit.engine.vllm import check as engine_check
from quantkit.read.checkpoint import INDEX_NAME, Checkpoint
from quantkit.read.sources import detect_format, scan
from quantkit.read.tensors import TensorReader
from quantkit.verify import VerifyOptions, verify
from quantkit.write.writer import write_safetensors

CAL = dict(num_samples=2, seq_len=16)


def _tensors(d):
    ck = Checkpoint.open(d)
    with TensorReader.of(ck) as r:
        return {n: r.get(n).clone() for n in ck.location}


def _dequantized_copy(src, dst):
    """The BF16 dequantization of an INT4 release, as compressed-tensors' convert_checkpoint writes it:
    every pack-quantized module as `<m>.weight` (q * scale, rounded once to BF16), no quantization_config."""
    ck = Checkpoint.open(src)
    stored = scan(ck, detect_format(ck.config))
    companions = {t for sw in stored.values() for _, t in sw.tensors}
    dst.mkdir()
    weight_map = {}
    with TensorReader.of(ck) as r:
        for shard in ck.shards:
            out = {n: r.get(n) for n in shard.tensors if n not in companions}
            out |= {f"{m}.weight": r.decode(sw, torch.bfloat16) for m, sw in stored.items()
                    if ck.location[sw.primary] == shard.name}
            write_safetensors(dst / shard.name, out, metadata={"format": "pt"})
            weight_map |= {n: shard.name for n in out}
    cfg = {k: v for k, v in ck.config.items() if k != "quantization_config"}
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.fixture(scope="module")
def k26(tmp_path_factory):
    from quantkit.testing import make_tiny_model

    d = tmp_path_factory.mktemp("k26")
    int4 = make_tiny_model("kimi_k25", d / "int4", int4_experts="qat")
    return int4, _dequantized_copy(int4, d / "bf16")


def test_the_fixture_is_on_kimis_15_level_grid(k26):
    from quantkit.pack.int4 import unpack_int4

    sd = _tensors(k26[0])
    packed = [t for n, t in sd.items() if n.endswith(".weight_packed")]
    assert packed
    q = torch.cat([unpack_int4(t, t.shape[1] * 8).flatten() for t in packed])
    assert int(q.min()) == -7 and int(q.max()) == 7  # -8 never used: 15 levels


def _recipe(name, scale_search=None):
    """A shipped FP4 recipe, with `scale_search` set on its experts' scheme."""
    from importlib import resources

    from quantkit.match.recipe import parse_recipe

    text = (resources.files("quantkit") / "data" / "recipes" / f"{name}.yaml").read_text()
    if scale_search:
        text = text.replace("strategy: tensor_group}", f"strategy: tensor_group, scale_search: {scale_search}}}")
        text = text.replace("strategy: group}", f"strategy: group, scale_search: {scale_search}}}")
        assert "scale_search" in text
    return parse_recipe(text, name)


@pytest.mark.parametrize("recipe", ["nvfp4-experts", "mxfp4-experts"])
def test_int4_release_to_fp4(k26, tmp_path, recipe):
    int4, bf16 = k26
    out, amax = tmp_path / "q", tmp_path / "amax"
    res = convert(int4, out, ConvertOptions(recipe=recipe))
    assert res.tensors_quantized == 12
    assert any("INT4 module(s) decoded on read and re-quantized to FP4" in n for n in res.notes)
    man = json.loads((out / "quantkit_manifest.json").read_text())
    packed = {n: e for n, e in man["tensors"].items() if n.endswith(".weight_packed")}
    assert packed and all(e["method"] == "rtn" and e["source_encoding"] == "int4" and 10 < e["sqnr_db"] < 40
                          for e in packed.values())
    if recipe == "mxfp4-experts":  # amax scales by default (nothing to fit): ask for fitted ones
        out = tmp_path / "mse"
        convert(int4, out, ConvertOptions(recipe=_recipe(recipe, "mse")))
        man = json.loads((out / "quantkit_manifest.json").read_text())
        packed = {n: e for n, e in man["tensors"].items() if n.endswith(".weight_packed")}
    assert all(e["scale_search"] == "mse" for e in packed.values())
    # with amax scales: the same bytes as converting the release's BF16 dequantization (llm-compressor's
    # path); the manifest's SQNR is against the decoded INT4 weight
    convert(int4, amax, ConvertOptions(recipe=_recipe(recipe, "amax")))
    ref = tmp_path / "ref"
    convert(bf16, ref, ConvertOptions(recipe=recipe))
    a, b = _tensors(amax), _tensors(ref)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
    ref_man = json.loads((ref / "quantkit_manifest.json").read_text())
    # fitted scales (the default for an INT4 source): never worse than amax, per module; the amax figure
    # the manifest records is the one an amax conversion measures
    assert all(abs(ref_man["tensors"][n]["sqnr_db"] - e["sqnr_amax_db"]) < 1e-3 for n, e in packed.items())
    assert all(e["sqnr_db"] >= e["sqnr_amax_db"] for e in packed.values())
    if recipe == "nvfp4-experts":  # E4M3 scales have room to fit; MXFP4's powers of two have little
        assert sum(e["sqnr_db"] - e["sqnr_amax_db"] for e in packed.values()) / len(packed) > 1.0
    # compressed-tensors' decompressor agrees with quantkit's decode bit for bit; vLLM's loader rules hold
    rep = verify(out, VerifyOptions(reference=int4, **CAL, generation_tokens=0))
    assert rep.passed, [c for c in rep.checks if c.ok is False]
    # judged by compressed-tensors itself (not quantkit's fallback unpack), every expert module
    assert rep.format["judge"].startswith("compressed-tensors") and rep.format["modules_checked"] == 12
    assert not engine_check(out).problems
    if recipe == "nvfp4-experts":
        gs = {n: t for n, t in _tensors(out).items() if n.endswith(".weight_global_scale")}
        pairs = [(t, gs[n.replace("gate_proj", "up_proj")]) for n, t in gs.items() if ".gate_proj." in n]
        assert pairs and all(torch.equal(g, u) for g, u in pairs)


def test_int4_recipes_still_pass_int4_through(k26, tmp_path):
    int4, _ = k26
    res = convert(int4, tmp_path / "q", ConvertOptions(recipe="int4-experts-rtn"))
    assert res.tensors_quantized == 0 and any("already INT4" in n for n in res.notes)
    a, b = _tensors(int4), _tensors(tmp_path / "q")
    assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def test_plan_predicts_int4_to_fp4(k26, tmp_path):
    from quantkit.arch import parse_config
    from quantkit.match.recipe import load_recipe
    from quantkit.plan import _tensor_shapes_from_checkpoint as headers
    from quantkit.plan import quantized_layout

    int4, _ = k26
    convert(int4, tmp_path / "q", ConvertOptions(recipe="mxfp4-experts"))
    spec = parse_config(Checkpoint.open(int4).config)
    predicted = quantized_layout(headers(int4), load_recipe("mxfp4-experts"), spec=spec)
    written = headers(tmp_path / "q")
    assert predicted == written, sorted(set(predicted.items()) ^ set(written.items()))[:6]


def test_gptq_nvfp4_from_the_int4_release(k26, tmp_path):
    """The calibrated pass runs the layers on the decoded INT4 weights and solves GPTQ on the FP4 grid."""
    int4, _ = k26
    out = tmp_path / "q"
    convert(int4, out, ConvertOptions(recipe="kimi-k2-nvfp4", **CAL))
    man = json.loads((out / "quantkit_manifest.json").read_text())
    packed = [e for n, e in man["tensors"].items() if n.endswith(".weight_packed")]
    # GPTQ solved every expert; the held-out check (on by default) may keep RTN's codes where they do better
    assert len(packed) == 12 and all(e["source_encoding"] == "int4" and "heldout" in e for e in packed)
    assert all(e["method"] == ("gptq" if e["heldout"]["gptq"] <= e["heldout"]["rtn"] else "rtn") for e in packed)
    assert any(e["method"] == "gptq" for e in packed)
    rep = verify(out, VerifyOptions(reference=int4, **CAL, generation_tokens=0))
    assert rep.passed, [c for c in rep.checks if c.ok is False]
