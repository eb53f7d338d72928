"""NVFP4 and MXFP4 outputs (nvfp4-experts, mxfp4-experts, kimi-k2-nvfp4) and FP4 sources.

The judge is compressed-tensors: `verify`'s format stage decompresses every module with the format's own
compressor and requires our dequantization bit for bit (tests/quant/test_fp4.py holds the golden bytes of
the packing itself). vLLM fuses an expert's gate and up into w13 with one NVFP4 global scale: every pair
shares it, also when a shard boundary falls between the two halves."""

from __future__ import annotations

import re

import pytest
import torch

from quantkit.convert import ConvertOptions, convert
from quantkit.read.checkpoint import Checkpoint
from quantkit.read.tensors import TensorReader
from quantkit.verify import VerifyOptions, verify


def _tensors(d):
    ck = Checkpoint.open(d)
    r = TensorReader.of(ck)
    return {n: r.get(n).clone() for n in ck.location}


def _pairs(sd):
    """(gate global scale, up global scale) of every expert."""
    out = []
    for n in sd:
        m = re.match(r"^(.*\.experts\.\d+\.)(gate_proj|w1)\.weight_global_scale$", n)
        if m:
            up = m[1] + ("up_proj" if m[2] == "gate_proj" else "w3") + ".weight_global_scale"
            out.append((sd[n], sd[up]))
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("recipe", ["nvfp4-experts", "mxfp4-experts"])
def test_fp4_outputs_are_judged_and_pairs_share_a_global_scale(tiny_models, tmp_path, arch, recipe):
    src = tiny_models(arch)
    res = convert(src, tmp_path / "q", ConvertOptions(recipe=recipe))
    assert res.tensors_quantized > 0
    rep = verify(tmp_path / "q")
    assert rep.passed and rep.format["modules_checked"] == res.tensors_quantized, rep.format
    assert rep.format["judge"].startswith("compressed-tensors")
    sd = _tensors(tmp_path / "q")
    kind = recipe.split("-")[0]
    packed = [n for n in sd if n.endswith(".weight_packed")]
    assert packed and all(sd[n].dtype == torch.uint8 for n in packed)
    scales = {sd[n.replace("weight_packed", "weight_scale")].dtype for n in packed}
    assert scales == ({torch.float8_e4m3fn} if kind == "nvfp4" else {torch.uint8})
    pairs = _pairs(sd)
    if kind == "nvfp4":
        assert pairs and all(torch.equal(g, u) for g, u in pairs)
        if arch == "qwen3_moe":  # the pair's scale is 448*6 / amax over both halves, not either half's own
            from quantkit.quant.fp4 import choose_global_scale

            w = _tensors(src)
            base = "model.layers.0.mlp.experts.0."
            gate, up = w[base + "gate_proj.weight"], w[base + "up_proj.weight"]
            assert torch.equal(sd[base + "gate_proj.weight_global_scale"], choose_global_scale(gate, up).reshape(1))
            alone = [choose_global_scale(x).reshape(1) for x in (gate, up)]
            assert not all(torch.equal(a, sd[base + "up_proj.weight_global_scale"]) for a in alone)
    else:
        assert not pairs and not any(n.endswith("weight_global_scale") for n in sd)


def test_a_pair_split_over_two_shards_still_shares_one_global_scale(tiny_models, tmp_path):
    src = tiny_models("qwen3_moe", max_shard_size="20KB")  # many shards: some expert's gate and up apart
    ck = Checkpoint.open(src)
    split = [n for n in ck.location if n.endswith("gate_proj.weight")
             and ck.location[n] != ck.location.get(n.replace("gate_proj", "up_proj"))]
    assert split, "the fixture must split at least one gate/up pair over two shards"
    convert(src, tmp_path / "q", ConvertOptions(recipe="nvfp4-experts"))
    sd = _tensors(tmp_path / "q")
    assert all(torch.equal(g, u) for g, u in _pairs(sd))
    assert verify(tmp_path / "q").passed


def test_gptq_on_the_fp4_grid(tiny_models, tmp_path):
    """kimi-k2-nvfp4 (GPTQ, NVFP4 experts, FP8 KV scales): judged, numerics within verify's limits against
    the source, every expert pair on one global scale. (Quality against RTN: bench/quality.py.)"""
    src = tiny_models("deepseek_v3")
    convert(src, tmp_path / "q", ConvertOptions(recipe="kimi-k2-nvfp4", num_samples=4, seq_len=32))
    rep = verify(tmp_path / "q", VerifyOptions(reference=src, num_samples=4, seq_len=64, generation_tokens=16))
    assert rep.passed, [c for c in rep.checks if c.ok is False]
    sd = _tensors(tmp_path / "q")
    assert _pairs(sd) and all(torch.equal(g, u) for g, u in _pairs(sd))
    assert any(n.endswith("self_attn.k_scale") for n in sd)


def test_fp4_sources_pass_through_or_requantize(tiny_models, tmp_path):
    src = tiny_models("qwen3_moe")
    convert(src, tmp_path / "mx", ConvertOptions(recipe="mxfp4-experts"))
    mx = _tensors(tmp_path / "mx")
    # MXFP4 -> MXFP4: every tensor unchanged, bit for bit
    res = convert(tmp_path / "mx", tmp_path / "same", ConvertOptions(recipe="mxfp4-experts"))
    assert res.tensors_quantized == 0 and any("passed through bit-exact" in n for n in res.notes)
    same = _tensors(tmp_path / "same")
    assert same.keys() == mx.keys()
    assert all(torch.equal(same[n].view(torch.uint8), mx[n].view(torch.uint8)) for n in mx)
    # MXFP4 -> INT4 g32 and -> NVFP4: decoded on read, re-quantized, SQNR recorded per tensor against it
    import json

    for recipe in ("int4-experts-rtn", "nvfp4-experts"):
        convert(tmp_path / "mx", tmp_path / recipe, ConvertOptions(recipe=recipe))
        man = json.loads((tmp_path / recipe / "quantkit_manifest.json").read_text())
        entries = [e for n, e in man["tensors"].items() if n.endswith(".weight_packed")]
        assert entries and all(e["source_encoding"] == "mxfp4" and 10 < e["sqnr_db"] < 60 for e in entries)
        assert verify(tmp_path / recipe).passed
        assert any("FP4 module(s) decoded on read" in n for n in man["notes"])
    # decoded gate/up halves still share one NVFP4 global scale (vLLM's w13 takes one: rule F1)
    from quantkit.engine.vllm import check as engine_check

    pairs = _pairs(_tensors(tmp_path / "nvfp4-experts"))
    assert pairs and all(torch.equal(g, u) for g, u in pairs)
    assert not engine_check(tmp_path / "nvfp4-experts").problems
    # an NVFP4 source passes through unchanged too (its fp8 scales are not FP8 weights to read)
    nv = _tensors(tmp_path / "nvfp4-experts")
    convert(tmp_path / "nvfp4-experts", tmp_path / "nv2", ConvertOptions(recipe="nvfp4-experts"))
    nv2 = _tensors(tmp_path / "nv2")
    assert nv.keys() == nv2.keys() and all(torch.equal(nv[n].view(torch.uint8), nv2[n].view(torch.uint8)) for n in nv)


@pytest.mark.parametrize("recipe", ["nvfp4-experts", "mxfp4-experts"])
def test_every_module_is_its_own_rtn_though_units_share_one_batch_buffer(tiny_models, tmp_path, recipe):
    """A shard's FP4 units are read into one reused buffer (convert/run.py `_Context.batch`): every expert
    written must still be the torch-path RTN of its own source weight, byte for byte (an output that
    aliased the buffer would hold a later unit's values by the time the writer drains it)."""
    from quantkit.quant import fp4

    src = tiny_models("qwen3_moe")
    convert(src, tmp_path / "q", ConvertOptions(recipe=recipe))
    sd, w = _tensors(tmp_path / "q"), _tensors(src)
    modules = sorted(n.removesuffix(".weight_packed") for n in sd if n.endswith(".weight_packed"))
    assert len({m.split(".layers.")[1].split(".")[0] for m in modules}) > 1  # several layers: several units
    for m in modules:
        x = w[m + ".weight"]
        if recipe == "nvfp4-experts":
            gate, up = (w[re.sub(r"(gate|up)_proj$", p, m) + ".weight"] for p in ("gate_proj", "up_proj")) \
                if re.search(r"(gate|up)_proj$", m) else (x, x)
            ref = fp4.rtn_nvfp4(x, fp4.choose_global_scale(gate, up), native=False)
            assert torch.equal(sd[m + ".weight_global_scale"], ref.global_scale.reshape(1)), m
        else:
            ref = fp4.rtn_mxfp4(x, native=False)
        assert torch.equal(sd[m + ".weight_packed"], ref.packed), m
        assert torch.equal(sd[m + ".weight_scale"].view(torch.uint8), ref.scale.view(torch.uint8)), m


def test_work_batches_reuse_one_buffer():
    from quantkit.convert.run import BatchBuffer

    buf = BatchBuffer()
    a = buf.batch((2, 4, 8), torch.bfloat16)
    assert a.shape == (2, 4, 8) and a.dtype == torch.bfloat16 and a.is_contiguous()
    b = buf.batch((1, 4, 4), torch.float32)  # smaller: the same memory
    assert b.shape == (1, 4, 4) and b.dtype == torch.float32 and b.data_ptr() == a.data_ptr()
    c = buf.batch((3, 8, 8), torch.float32)  # larger: grown
    assert c.shape == (3, 8, 8) and buf._buf.numel() == 3 * 8 * 8 * 4
    c.fill_(1.5)
    d = buf.batch((3, 8, 8), torch.float32)
    assert d.data_ptr() == c.data_ptr() and torch.equal(d, torch.full((3, 8, 8), 1.5))
