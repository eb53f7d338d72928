"""`plan --recipe` predicts what `convert` writes: the same tensors (names, shapes, dtypes) and so exactly
the same tensor bytes, for every shipped recipe and every source dtype (bf16, fp16, fp32, block-FP8); the
safetensors headers, which depend on how shards split, are estimated (within 0.5% of the total)."""

import pytest

from quantkit.convert import ConvertOptions, convert
from quantkit.plan import plan, quantized_layout
from quantkit.plan import _tensor_shapes_from_checkpoint as headers
from quantkit.plan.tensors import tensor_bytes
from quantkit.read.checkpoint import Checkpoint
from quantkit.testing import write_block_fp8_checkpoint

CAL = dict(num_samples=2, seq_len=16)


def _compare(src, out, recipe):
    from quantkit.arch import parse_config
    from quantkit.match.recipe import load_recipe

    spec = parse_config(Checkpoint.open(src).config)
    predicted = quantized_layout(headers(src), load_recipe(recipe), spec=spec)
    written = headers(out)
    assert predicted == written, sorted(set(predicted.items()) ^ set(written.items()))[:6]
    data = sum(tensor_bytes(sh, d) for sh, d in written.values())
    total = Checkpoint.open(out).total_bytes
    rep = plan(src, recipe).to_json()
    assert abs(rep["checkpoint_bytes"]["recipe"] - total) / total < 0.005
    return data


@pytest.mark.parametrize("recipe", ["int4-experts-rtn", "glm", "nvfp4-experts", "mxfp4-experts"])
def test_predicted_tensors_equal_written(arch, tiny_models, tmp_path, recipe):
    src = tiny_models(arch)
    convert(src, tmp_path / "q", ConvertOptions(recipe=recipe))
    _compare(src, tmp_path / "q", recipe)
    assert plan(src).to_json()["checkpoint_bytes"]["source"] == Checkpoint.open(src).total_bytes


@pytest.mark.parametrize("dtype", ["float32", "float16", "fp8-block"])
@pytest.mark.parametrize("recipe", ["int4-experts-rtn", "glm"])
def test_every_source_dtype(tiny_models, tmp_path, dtype, recipe):
    import torch

    if dtype == "fp8-block":
        src = tmp_path / "fp8"
        write_block_fp8_checkpoint(tiny_models("deepseek_v3"), src)
    else:
        src = tiny_models("qwen3_moe", dtype=getattr(torch, dtype))
    convert(src, tmp_path / "q", ConvertOptions(recipe=recipe))
    _compare(src, tmp_path / "q", recipe)


@pytest.mark.parametrize("recipe", ["int4-experts-gptq", "int4-experts-awq", "kimi-k2", "kimi-k2-nvfp4", "fp8-kv"])
def test_calibrated_recipes(tiny_models, tmp_path, recipe):
    src = tiny_models("deepseek_v3")
    convert(src, tmp_path / "q", ConvertOptions(recipe=recipe, **CAL))
    _compare(src, tmp_path / "q", recipe)


@pytest.mark.parametrize("recipe", ["mxfp4-experts", "int4-experts-rtn", "nvfp4-experts", "glm"])
def test_fp4_source(tiny_models, tmp_path, recipe):
    """An MXFP4 release: kept when the recipe asks for MXFP4, decoded and re-quantized otherwise."""
    mx = tmp_path / "mx"
    convert(tiny_models("qwen3_moe"), mx, ConvertOptions(recipe="mxfp4-experts"))
    convert(mx, tmp_path / "q", ConvertOptions(recipe=recipe))
    _compare(mx, tmp_path / "q", recipe)


@pytest.mark.parametrize("recipe", ["kimi-k2", "fp8-kv", "int4-experts-rtn"])
def test_int4_wrapper_source(tiny_models, tmp_path, recipe):
    """Kimi K2.5 as released: a kimi_k25 wrapper whose routed experts are already INT4 (passed through)."""
    src = tiny_models("kimi_k25", int4_experts=True)
    convert(src, tmp_path / "q", ConvertOptions(recipe=recipe, **CAL))
    _compare(src, tmp_path / "q", recipe)



INT8_RECIPE = """\
name: int8-trial
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$', 're:.*\\.block_sparse_moe\\.experts\\.\\d+\\.w[123]$']
    method: rtn
    scheme: {num_bits: 8, type: int, symmetric: true, strategy: channel}
  attn:
    targets: ['re:.*\\.self_attn\\.(q|k|v|o)_proj$']
    method: rtn
    scheme: {num_bits: 8, type: int, symmetric: true, strategy: group, group_size: 32, fallback: channel}
ignore: ['re:.*\\.mlp\\.gate$', 'lm_head']
"""


@pytest.mark.parametrize("arch_name", ["qwen3_moe", "mixtral"])
def test_int8_recipe(tiny_models, tmp_path, arch_name):
    """INT8 (pack-quantized num_bits 8): four codes a word, sized by the same table convert writes by."""
    recipe = tmp_path / "int8.yaml"
    recipe.write_text(INT8_RECIPE)
    src = tiny_models(arch_name)
    convert(src, tmp_path / "q", ConvertOptions(recipe=str(recipe)))
    _compare(src, tmp_path / "q", str(recipe))
    packed = {n: sh for n, (sh, d) in headers(tmp_path / "q").items() if n.endswith(".weight_packed")}
    assert packed and all(sh[1] == -(-headers(src)[n.replace("_packed", "")][0][1] // 4) for n, sh in packed.items())
