"""`verify --engine vllm`: the rules vLLM 0.33.0 applies, checked without vLLM. Each rule is shown to fail
on a checkpoint that breaks it (made from a good output), and good outputs pass. (Whether vLLM itself
accepts the outputs is bench/vllm_check.py's job: docs/engine.md.)"""

from __future__ import annotations

import json
import shutil

import pytest

from quantkit.convert import ConvertOptions, convert
from quantkit.engine.vllm import RULES, check
from quantkit.read.checkpoint import Checkpoint
from quantkit.verify import VerifyOptions, verify
from quantkit.write.writer import write_safetensors


@pytest.fixture(scope="module")
def outputs(tiny_models, tmp_path_factory):
    d = tmp_path_factory.mktemp("engine")
    out = {}
    for name, arch, recipe, kw in (("int4", "qwen3_moe", "int4-experts-rtn", {}),
                                   ("nvfp4", "qwen3_moe", "nvfp4-experts", {}),
                                   ("mla-kv", "deepseek_v3", "fp8-kv", dict(num_samples=2, seq_len=16)),
                                   ("glm", "glm4_moe", "glm", {})):
        out[name] = d / name
        convert(tiny_models(arch), out[name], ConvertOptions(recipe=recipe, **kw))
    return out


def _copy(src, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def _rules(rep, warnings=False):
    return {p["rule"] for p in (rep.warnings if warnings else rep.problems)}


def test_every_rule_names_its_vllm_source():
    assert all(r.source and r.text for r in RULES.values())


def test_good_outputs_pass(outputs):
    for name in ("int4", "nvfp4"):
        rep = check(outputs[name])
        assert rep.ok and not rep.warnings, (name, rep.problems, rep.warnings)


def test_mla_kv_scales_are_said_to_be_dropped_unless_the_plugin_is_there(outputs):
    rep = check(outputs["mla-kv"])
    assert rep.ok and _rules(rep, warnings=True) == {"K2"} and "1.0" in rep.warnings[0]["detail"]
    assert not check(outputs["mla-kv"], plugin=True).warnings
    v = verify(outputs["mla-kv"], VerifyOptions(engine="vllm"))
    assert v.passed and v.engine["warnings"] and v.checks[-1].name == "engine_vllm"


def test_a_missing_kv_scale_is_refused(outputs, tmp_path):
    m = _copy(outputs["mla-kv"], tmp_path)
    ck = Checkpoint.open(m)
    shard = ck.location["model.layers.1.self_attn.v_scale"]
    from quantkit.read.tensors import TensorReader

    with TensorReader.of(ck) as r:
        kept = {n: r.get(n).clone() for n in ck.shard(shard).tensors if n != "model.layers.1.self_attn.v_scale"}
    write_safetensors(m / shard, kept, metadata={"format": "pt"})
    idx = json.loads((m / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["model.layers.1.self_attn.v_scale"]
    (m / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert "K6" in _rules(check(m, plugin=True))


def test_experts_of_one_layer_must_share_a_scheme(outputs, tmp_path):
    m = _copy(outputs["int4"], tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    qc = cfg["quantization_config"]
    other = json.loads(json.dumps(qc["config_groups"]["group_0"]))
    other["targets"] = ["model.layers.1.mlp.experts.2.down_proj"]
    other["weights"]["observer"] = "mse"  # another scheme for one expert module
    qc["config_groups"]["group_1"] = other
    (m / "config.json").write_text(json.dumps(cfg))
    assert "M1" in _rules(check(m))


def test_group_size_against_tp_shards(outputs):
    rep = check(outputs["int4"], tp=4)  # moe_intermediate 64 / 4 = 16 < group 32
    assert "M4" in _rules(rep) and "tp 4" in rep.problems[0]["detail"]
    assert check(outputs["int4"], tp=2).ok


def test_nvfp4_gate_and_up_must_share_the_global_scale(outputs, tmp_path):
    m = _copy(outputs["nvfp4"], tmp_path)
    ck = Checkpoint.open(m)
    name = "model.layers.1.mlp.experts.0.up_proj.weight_global_scale"
    shard = ck.location[name]
    from quantkit.read.tensors import TensorReader

    with TensorReader.of(ck) as r:
        tensors = {n: r.get(n).clone() for n in ck.shard(shard).tensors}
    tensors[name] = tensors[name] * 2
    write_safetensors(m / shard, tensors, metadata={"format": "pt"})
    rep = check(m)
    assert "F1" in _rules(rep) and rep.problems[0]["where"] == name.rsplit(".", 1)[0]


def test_fused_block_fp8_parts_must_be_whole_blocks(outputs, tmp_path):
    """The glm recipe on the tiny glm4_moe: k_proj has 64 rows (2 KV heads x 32), which vLLM's fused
    block-FP8 qkv_proj refuses (real GLM configs have whole blocks). convert gives every part of such a
    fused Linear the recipe's fallback (per-channel FP8); the same modules in 128x128 blocks, as a tool
    without the rule writes them, break B2."""
    good = outputs["glm"]
    rep = check(good)
    assert rep.ok and "B2" not in _rules(rep), rep.problems
    man = json.loads((good / "quantkit_manifest.json").read_text())["tensors"]
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert all("channel" in man[m + ".weight"]["scheme"] for m in qkv)  # all parts alike
    assert "block" in man["model.layers.0.self_attn.o_proj.weight"]["scheme"]  # not fused: stays in blocks
    m = _copy(good, tmp_path)
    ck = Checkpoint.open(m)
    from quantkit.read.tensors import TensorReader

    with TensorReader.of(ck) as r:
        for shard in {ck.location[q + ".weight"] for q in qkv}:
            tensors = {n: r.get(n).clone() for n in ck.shard(shard).tensors}
            for q in qkv:
                if q + ".weight" in tensors:
                    n, k = tensors[q + ".weight"].shape
                    tensors[q + ".weight_scale"] = tensors[q + ".weight_scale"].new_ones(-(-n // 128), -(-k // 128))
            write_safetensors(m / shard, tensors, metadata={"format": "pt"})
    cfg = json.loads((m / "config.json").read_text())
    for g in cfg["quantization_config"]["config_groups"].values():  # the block group's re: target takes them
        g["targets"] = [t for t in g["targets"] if t not in qkv] or g["targets"]
    (m / "config.json").write_text(json.dumps(cfg))
    rep = check(m)
    assert "B2" in _rules(rep)
    assert qkv[1] in {p["where"] for p in rep.problems if p["rule"] == "B2"}  # k_proj: 64 rows, not the last part
    assert not verify(m, VerifyOptions(engine="vllm")).passed


def test_router_bias_needs_topk_method(outputs, tmp_path):
    # the tiny deepseek_v3 source is saved by transformers, whose config has no topk_method: convert adds it
    m = _copy(outputs["mla-kv"], tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    assert cfg["topk_method"] == "noaux_tc"
    assert json.loads((m / "quantkit_manifest.json").read_text())["config_added"] == {"topk_method": "noaux_tc"}
    assert "R1" not in _rules(check(m))
    for value in (None, "greedy"):
        if value is None:
            cfg.pop("topk_method")
        else:
            cfg["topk_method"] = value
        (m / "config.json").write_text(json.dumps(cfg))
        rep = check(m)
        assert _rules(rep) == {"R1"}, rep.problems
        assert rep.problems[0]["where"].endswith("mlp.gate.e_score_correction_bias")
    # glm4_moe: vLLM always builds the bias there, and the output carries no added key
    assert "R1" not in _rules(check(outputs["glm"]))
    assert "config_added" not in json.loads((outputs["glm"] / "quantkit_manifest.json").read_text())


def test_unused_kv_scales_are_named(outputs):
    from quantkit.engine.vllm_config import DSA_KV_NOTE, MLA_V_SCALE_NOTE, kv_scale_use_notes
    from quantkit.plan import plan

    assert kv_scale_use_notes({"model_type": "qwen3_moe", "num_key_value_heads": 4}) == []
    assert kv_scale_use_notes({"model_type": "deepseek_v3", "kv_lora_rank": 512}) == [MLA_V_SCALE_NOTE]
    assert kv_scale_use_notes({"model_type": "glm_moe_dsa", "kv_lora_rank": 512}) == [MLA_V_SCALE_NOTE, DSA_KV_NOTE]
    notes = json.loads((outputs["mla-kv"] / "quantkit_manifest.json").read_text())["notes"]
    assert MLA_V_SCALE_NOTE in notes and DSA_KV_NOTE not in notes
    assert any(DSA_KV_NOTE in a for a in plan("glm-5").to_json()["assumptions"])
    assert not any(MLA_V_SCALE_NOTE in a for a in plan(str(outputs["int4"])).to_json()["assumptions"])
