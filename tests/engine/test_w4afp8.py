"""W4AFP8 recipes (INT4 group-128 weights, dynamic per-token FP8 activations): the config matches
compressed-tensors' own W4AFP8 preset, compressed-tensors decompresses the output, and vLLM 0.33.0's shape rules
(hidden and moe_intermediate_size / tp multiples of 256) are refused by `convert` before anything is written
and reported by `verify --engine vllm`. (vLLM's own loader accepting the outputs: bench/vllm_check.py,
docs/engine.md "W4AFP8".)"""

from __future__ import annotations

import json
import time

import pytest

from quantkit.convert import ConvertOptions, convert
from quantkit.engine import w4afp8 as rules
from quantkit.engine.vllm import check
from quantkit.errors import RecipeError, W4AFP8ShapeError
from quantkit.match.recipe import Scheme, load_recipe, parse_recipe
from quantkit.verify import VerifyOptions, verify

W4AFP8_RECIPES = ("int4-experts-w4afp8", "int4-experts-w4afp8-gptq", "int4-experts-w4afp8-awq", "glm-w4afp8")


@pytest.fixture(scope="module")
def wide(tiny_models):
    """qwen3_moe / glm4_moe with the widths vLLM's W4A8 MoE kernel takes at tp 1 (256)."""
    return lambda arch, inter=256: tiny_models(arch, hidden=256, moe_intermediate=inter, max_shard_size="2MB")


def test_the_rule_on_the_glm_configs():
    assert rules.working_tp(6144, 2048) == [1, 2, 4, 8]  # GLM-5 (glm_moe_dsa)
    assert rules.working_tp(5120, 1536) == [1, 2]  # GLM-4.5 / 4.6 / 4.7: 1536 / 4 = 384
    assert rules.working_tp(7168, 2048) == [1, 2, 4, 8]  # DeepSeek-V3 / Kimi K2
    assert rules.working_tp(4096, 1536) == [1, 2]  # Qwen3-235B-A22B
    assert rules.working_tp(160, 256) == [] and "no --tp" in rules.describe(160, 256)
    assert "expert-parallel" in rules.describe(5120, 1536) and "expert-parallel" not in rules.describe(256, 384)


def test_recipes_load_and_the_scheme_is_validated():
    for name in W4AFP8_RECIPES:
        groups = [g for g in load_recipe(name).groups if g.scheme.activations]
        assert len(groups) == 1 and groups[0].scheme.label == "int4-g128-sym-afp8", name
    assert load_recipe("int4-experts-w4afp8-gptq").groups[0].method == "gptq"
    for bad in ({"group_size": 32}, {"symmetric": False}, {"fallback": "channel"}, {"strategy": "channel"}):
        with pytest.raises(RecipeError, match="W4AFP8"):
            Scheme(**{"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "activations": "fp8", **bad})
    with pytest.raises(RecipeError, match="activations must be 'fp8'"):
        Scheme(group_size=128, activations="int8")
    with pytest.raises(RecipeError, match="W4AFP8"):
        parse_recipe("groups: {x: {targets: [a], scheme: {num_bits: 8, type: float, strategy: channel, "
                     "activations: fp8}}}")


def test_config_is_compressed_tensors_w4afp8_preset_and_decompresses(wide, tmp_path):
    from compressed_tensors.quantization import preset_name_to_scheme

    out = tmp_path / "o"
    res = convert(wide("qwen3_moe"), out, ConvertOptions(recipe="int4-experts-w4afp8", model_card=False))
    assert any("rule W2" in n and "--tp 1" in n for n in res.notes)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    preset = preset_name_to_scheme("W4AFP8", ["Linear"])
    for ours, theirs in ((group["weights"], preset.weights), (group["input_activations"], preset.input_activations)):
        for key, value in theirs.model_dump().items():
            assert ours[key] == (value.value if hasattr(value, "value") else value), key
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    labels = {e["scheme"] for e in manifest["tensors"].values() if "scheme" in e}
    assert labels == {"int4-g128-sym-afp8"}
    # integrity + format (compressed-tensors' decompressor) + engine rules + numerics: the experts run as
    # vLLM's W4A8 kernel computes (runtime/w4afp8.py), the same weights as W4A16 beside them
    v = verify(out, VerifyOptions(engine="vllm", reference=wide("qwen3_moe"), num_samples=2, seq_len=32,
                                  generation_tokens=0))
    assert v.passed, [(c.name, c.detail) for c in v.checks if not c.ok]
    kl, kl16 = v.metrics["kl_divergence"], v.metrics["kl_divergence_w4a16"]
    assert 0 < kl16 < 0.01 and 0 < kl < 0.01 and kl != kl16
    assert "W4A16, same weights" in next(c.detail for c in v.checks if c.name == "kl_divergence")
    rep = check(out, tp=1)
    assert rep.ok and {w["rule"] for w in rep.warnings} == {"W3"}
    rep2 = check(out, tp=2)
    assert {p["rule"] for p in rep2.problems} == {"W2"} and "256 / 2 = 128" in rep2.problems[0]["detail"]


def test_convert_refuses_widths_vllm_cannot_take_before_writing(wide, tmp_path):
    src = wide("qwen3_moe", inter=384)
    out = tmp_path / "o"
    t0 = time.perf_counter()
    with pytest.raises(W4AFP8ShapeError, match=r"multiples of 256 .*rule W2.*384 / 1 = 384.*no --tp value"):
        convert(src, out, ConvertOptions(recipe="int4-experts-w4afp8"))
    assert time.perf_counter() - t0 < 10 and not out.exists()
    with pytest.raises(W4AFP8ShapeError, match=r"256 / 2 = 128.*works with: --tp 1; any --tp with --enable-expert"):
        convert(wide("glm4_moe"), out, ConvertOptions(recipe="glm-w4afp8", tp=2))
    assert not out.exists()


def test_w4afp8_on_a_dense_linear_is_refused(wide, tmp_path):
    recipe = parse_recipe("groups: {attn: {targets: ['re:.*self_attn\\.o_proj$'], scheme: {num_bits: 4, type: int, "
                          "group_size: 128, activations: fp8}}}")
    with pytest.raises(W4AFP8ShapeError, match="routed experts only"):
        convert(wide("qwen3_moe"), tmp_path / "o", ConvertOptions(recipe=recipe))
