"""Tests for quantkit.plan: KV bytes per token, parameter totals, GPU residency, tensor enumeration
against real `save_pretrained` output, and predicted checkpoint bytes against the format formulas.

Tiny models are built locally with quantkit.testing.make_tiny_model (no downloads). The reference
configs (kimi-k2, glm-4.5, glm-5) are planned once per module; the whole file runs in a few seconds.
"""

from __future__ import annotations

import copy
import io
import json
import math
import re

import pytest
import torch
from rich.console import Console
from safetensors.torch import save_file

from quantkit import plan as P
from quantkit.errors import ConfigError, GroupSizeError
from quantkit.match.recipe import load_recipe, parse_recipe
from quantkit.testing import ARCHS, make_tiny_model, read_json

GIB = 1 << 30
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I32": 4, "I64": 8}
TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32, "I64": torch.int64,
         "F8_E4M3": torch.float8_e4m3fn}
# The routed-expert targets of the shipped int4-experts-rtn recipe, written out independently.
# The ignore list of Kimi-K2-Thinking-style INT4 releases (docs/format.md).
KIMI_INT4_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
EXPERT_RX = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj$|.*\.block_sparse_moe\.experts\.\d+\.w[123]$")


# ---- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kimi():
    return P.plan("kimi-k2", opts=P.PlanOptions(gpus=8, gpu_memory_gib=140))


@pytest.fixture(scope="module")
def glm45():
    return P.plan("glm-4.5", "int4-experts-rtn", opts=P.PlanOptions(gpus=8, gpu_memory_gib=80))


@pytest.fixture(scope="module")
def glm5():
    return P.plan("glm-5", "int4-experts-rtn", opts=P.PlanOptions(gpus=8, gpu_memory_gib=140))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One tiny checkpoint per supported MoE arch (plus the dense llama/qwen3), built once."""
    root = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny_model(a, root / a) for a in (*ARCHS, "llama", "qwen3")}


def _ref(name: str) -> dict:
    cfg = P.reference_config(name)
    cfg.pop("_source")
    return cfg


def _write(tmp_path, name: str, cfg: dict):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


# ---- KV bytes per token -----------------------------------------------------------------------------
def test_kimi_k2_kv_bytes_per_token(kimi):
    kv = kimi.kv_bytes_per_token
    assert kv["bfloat16"] == 61 * 576 * 2 == 70_272
    assert kv["float8_e4m3"] == 61 * 576 == 35_136
    assert kv["bfloat16"] / kv["float8_e4m3"] == 2.0
    # 512 FP8 + 4 fp32 scales + 64 BF16 rope = 656 B per layer
    assert kv["fp8_ds_mla"] == 61 * 656 == 40_016
    assert round(kv["bfloat16"] / kv["fp8_ds_mla"], 3) == 1.756


def test_mla_latent_is_replicated_across_tp_ranks(kimi):
    assert kimi.tp == 8
    assert kimi.kv_bytes_per_token_per_gpu == kimi.kv_bytes_per_token  # every rank holds the whole latent
    tok = kimi.kv_tokens
    assert tok["bfloat16"] == kimi.kv_budget_bytes_per_gpu // 70_272
    assert tok["float8_e4m3"] in (2 * tok["bfloat16"], 2 * tok["bfloat16"] + 1)
    assert round(tok["fp8_ds_mla"] / tok["bfloat16"], 2) == 1.76


def test_glm45_kv_bytes_per_token_and_per_gpu(glm45):
    assert glm45.kv_bytes_per_token == {"bfloat16": 2 * 92 * 8 * 128 * 2, "float8_e4m3": 188_416, "fp8_ds_mla": None}
    assert glm45.kv_bytes_per_token["bfloat16"] == 376_832
    # TP=8 over 8 KV heads: one head per GPU
    assert glm45.kv_bytes_per_token_per_gpu == {"bfloat16": 47_104, "float8_e4m3": 23_552, "fp8_ds_mla": None}
    assert glm45.kv_tokens["fp8_ds_mla"] is None and glm45.max_concurrency["fp8_ds_mla"] is None


def test_gqa_kv_heads_shard_up_to_num_kv_heads():
    kv = P.KVLayout("gqa", layers=92, kv_heads=8, head_dim=128)
    assert kv.bytes_per_token("bfloat16", tp=4) == 2 * 92 * 2 * 128 * 2  # 2 heads per GPU
    assert kv.bytes_per_token("bfloat16", tp=16) == kv.bytes_per_token("bfloat16", tp=8) == 47_104  # replicated
    assert kv.bytes_per_token("fp8_ds_mla") is None


def test_glm5_kv_includes_the_indexer_key(glm5):
    kv = glm5.kv_bytes_per_token
    assert kv["bfloat16"] == 78 * (576 * 2 + 128 * 2) == 109_824
    assert kv["float8_e4m3"] == 78 * (576 + 128) == 54_912
    assert kv["fp8_ds_mla"] == 78 * (656 + 128 + 4) == 61_464
    # Indexer shared across layers (GLM-5.x style: full at 0-2 and every 4th): fewer indexer keys.
    cfg = {**_ref("glm-5"), "index_topk_freq": 4, "index_skip_topk_offset": 3}
    shared = P.kv_layout(P.parse_config(cfg))
    full_layers = sum(1 for i in range(78) if i < 3 or i % 4 == 2)
    assert shared.indexer_layers == full_layers == 21
    assert shared.bytes_per_token("bfloat16") == 78 * 1152 + 21 * 256
    t = P.enumerate_tensors(P.parse_config(cfg))
    assert "model.layers.6.self_attn.indexer.wk.weight" in t and "model.layers.7.self_attn.indexer.wk.weight" not in t


# ---- parameters and checkpoint bytes ----------------------------------------------------------------
def test_parameter_totals_are_plausible(kimi, glm45, glm5):
    # Kimi K2: public "1.04T total, 32B active" (no MTP layer)
    assert 1.02e12 <= kimi.parameters["total"] <= 1.05e12
    assert 30e9 <= kimi.active_parameters <= 35e9
    assert kimi.parameters["mtp"] == 0
    # GLM-4.5: public 355B (HF safetensors count 358B) including the MTP layer with its own embed/head
    assert 350e9 <= glm45.parameters["total"] <= 360e9
    assert 5e9 <= glm45.parameters["mtp"] <= 6e9
    # GLM-5: public 744B without MTP; the BF16 release is ~1.51 TB
    assert 740e9 <= glm5.parameters["total"] - glm5.parameters["mtp"] <= 750e9
    assert 1.50e12 <= glm5.checkpoint_bytes["source"] <= 1.52e12
    for r in (kimi, glm45, glm5):
        assert r.parameters["total"] == sum(r.parameters[role] for role in P.ROLES)
        assert r.parameters["routed_experts"] > 0.9 * r.parameters["total"]


def _kimi_layers(n: int) -> dict:
    """Kimi K2 with fewer layers: same tensor shapes, a fraction of the ~70k expert tensors."""
    return {**P.reference_config("kimi-k2"), "num_hidden_layers": n}


def test_kimi_source_is_fp8_block(kimi):
    assert kimi.source_format == "fp8-block"
    t = P.source_tensors(P.parse_config(_kimi_layers(2)))
    e = "model.layers.1.mlp.experts.0.gate_proj"
    assert t[e + ".weight"] == ((2048, 7168), "F8_E4M3")
    assert t[e + ".weight_scale_inv"] == ((16, 56), "F32")  # [ceil(2048/128), ceil(7168/128)]
    assert t["model.layers.1.mlp.gate.weight"] == ((384, 7168), "BF16")  # router stays BF16
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"] == ((384,), "F32")
    assert t["lm_head.weight"][1] == "BF16" and "lm_head.weight_scale_inv" not in t
    # About 1 byte per parameter plus the BF16 embeddings/lm_head and fp32 block scales.
    assert 1.02e12 <= kimi.checkpoint_bytes["source"] <= 1.04e12


def test_recipe_on_fp8_source_drops_scale_inv_of_quantized_experts_only():
    t = P.source_tensors(P.parse_config(_kimi_layers(2)))
    out = P.quantized_layout(t, load_recipe("int4-experts-rtn"))
    e = "model.layers.1.mlp.experts.0.down_proj"
    assert out[e + ".weight_packed"] == ((7168, 2048 // 8), "I32")
    assert out[e + ".weight_scale"] == ((7168, 2048 // 32), "BF16")
    assert e + ".weight_scale_inv" not in out and e + ".weight" not in out
    a = "model.layers.1.self_attn.q_b_proj"  # kept FP8, its scale under compressed-tensors' name (as convert writes)
    assert out[a + ".weight"] == t[a + ".weight"] and out[a + ".weight_scale"] == (t[a + ".weight_scale_inv"][0], "F32")
    assert a + ".weight_scale_inv" not in out


def test_compressed_tensors_source_config_matches_the_recipe_it_encodes(tmp_path):
    """A Kimi-K2-Thinking-style config (INT4 g32 experts, rest BF16) sizes like BF16 + int4-experts-rtn."""
    bf16 = {k: v for k, v in _kimi_layers(3).items() if k not in ("quantization_config", "_source")}
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
          "ignore": KIMI_INT4_IGNORE}
    spec_bf16 = P.parse_config(bf16)
    spec_ct = P.parse_config({**bf16, "quantization_config": ct})
    a = P.source_tensors(spec_ct)
    b = P.quantized_layout(P.source_tensors(spec_bf16), load_recipe("int4-experts-rtn"))
    assert a == b
    assert "model.layers.1.mlp.gate.weight" in a  # routers are not nn.Linear: never packed
    # a recipe on the INT4 release (Kimi K2.5 ships its experts so): they pass through, nothing changes size
    rep = P.plan(_write(tmp_path, "ct.json", {**bf16, "quantization_config": ct}), "int4-experts-rtn").to_json()
    assert rep["checkpoint_bytes"]["recipe"] == rep["checkpoint_bytes"]["source"]
    assert any("INT4 modules pass through" in a for a in rep["assumptions"])


# ---- residency ------------------------------------------------------------------------------------
def test_resident_tokens_follow_the_stated_budget(glm45, tiny):
    r = P.plan(tiny["glm4_moe"], "int4-experts-rtn", opts=P.PlanOptions(gpus=2, gpu_memory_gib=0.01,
                                                                        activation_reserve_gib=0.002, context_len=1000))
    w = r.weight_bytes_per_gpu
    resident = sum(v["recipe"] for role, v in r.bytes_by_role.items() if role != "mtp")
    assert w == -(-resident // 2)
    assert r.kv_budget_bytes_per_gpu == int(0.01 * GIB) - int(0.002 * GIB) - w
    per_gpu = 2 * 2 * 1 * 32 * 2  # 2 layers x K,V x 1 of 2 KV heads per GPU x head_dim 32 x 2 B
    assert r.kv_bytes_per_token_per_gpu["bfloat16"] == per_gpu
    assert r.kv_tokens["bfloat16"] == r.kv_budget_bytes_per_gpu // per_gpu
    assert r.max_concurrency["bfloat16"] == r.kv_tokens["bfloat16"] // 1000
    conc = r.max_concurrency
    assert conc["float8_e4m3"] in (2 * conc["bfloat16"], 2 * conc["bfloat16"] + 1)
    assert r.to_json()["per_gpu"]["activation_reserve_bytes"] == int(0.002 * GIB)
    # GLM-4.5 on 8 x 80 GiB: the default reserve is 10% of the GPU and is stated
    assert glm45.activation_reserve_gib == 8.0
    assert any("activation reserve: 8 GiB" in a and "default" in a for a in glm45.assumptions)
    assert glm45.kv_tokens["bfloat16"] == (80 * GIB - 8 * GIB - glm45.weight_bytes_per_gpu) // 47_104


def test_data_parallel_replicas_multiply_tokens(tiny):
    one = P.plan(tiny["glm4_moe"], opts=P.PlanOptions(gpus=2, gpu_memory_gib=0.01, context_len=1000))
    two = P.plan(tiny["glm4_moe"], opts=P.PlanOptions(gpus=4, tp=2, gpu_memory_gib=0.01, context_len=1000))
    assert two.kv_tokens["bfloat16"] == 2 * one.kv_tokens["bfloat16"] > 0
    assert two.max_concurrency["bfloat16"] == 2 * one.max_concurrency["bfloat16"] > 0


def test_weights_that_do_not_fit_leave_no_kv(tiny):
    # ~0.9 MB of weights on a 0.5 MiB GPU
    r = P.plan(tiny["glm4_moe"], opts=P.PlanOptions(gpus=1, gpu_memory_gib=0.0005))
    assert r.kv_tokens["bfloat16"] == 0 and r.max_concurrency["bfloat16"] == 0
    assert r.warnings and "no room for KV" in r.warnings[0]


@pytest.mark.parametrize("kw", [dict(gpus=8, tp=3), dict(gpus=0), dict(gpu_memory_gib=0), dict(context_len=0),
                                dict(activation_reserve_gib=-1)])
def test_bad_parallelism_or_memory_raises(kw):
    with pytest.raises(ConfigError):
        P.plan("glm-4.5", opts=P.PlanOptions(**kw))


def test_kv_dtype_selection(kimi, tiny):
    assert kimi.kv_dtype == "bfloat16"
    d = tiny["glm4_moe"]
    assert P.plan(d, opts=P.PlanOptions(kv_dtype="fp8")).kv_dtype == "float8_e4m3"
    assert P.plan(d, parse_recipe("name: kv\nkv_cache: {strategy: tensor}")).kv_dtype == "float8_e4m3"
    with pytest.raises(ConfigError):
        P.plan(d, opts=P.PlanOptions(kv_dtype="fp8_ds_mla"))  # MLA only
    with pytest.raises(ConfigError):
        P.plan(d, opts=P.PlanOptions(kv_dtype="int2"))


# ---- tensor enumeration against real checkpoints --------------------------------------------------
def _names_shapes(t):
    return {k: tuple(v[0]) for k, v in t.items()}


@pytest.mark.parametrize("arch", (*ARCHS, "llama", "qwen3"))
def test_enumeration_matches_save_pretrained(tiny, arch):
    d = tiny[arch]
    spec = P.parse_config(read_json(d / "config.json"))
    real = P._tensor_shapes_from_checkpoint(d)
    # transformers' save_pretrained drops the MTP layers the hub releases ship: compare without them.
    assert _names_shapes(P.enumerate_tensors(spec, mtp=False)) == _names_shapes(real)


@pytest.mark.parametrize("arch,overrides", [
    ("glm4_moe", dict(attention_bias=True, use_qk_norm=True, layers=3, first_k_dense_replace=2)),
    ("deepseek_v3", dict(q_lora_rank=None, attention_bias=True, n_shared_experts=2)),
    ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[2], attention_bias=True, layers=4)),
    ("glm_moe_dsa", dict(layers=5, index_topk_freq=2, index_skip_topk_offset=1, first_k_dense_replace=2)),
    ("mixtral", dict(tie_word_embeddings=True)),
    ("llama", dict(attention_bias=True, mlp_bias=True)),
])
def test_enumeration_matches_save_pretrained_variants(tmp_path, arch, overrides):
    d = make_tiny_model(arch, tmp_path / arch, **overrides)
    spec = P.parse_config(read_json(d / "config.json"))
    assert _names_shapes(P.enumerate_tensors(spec, mtp=False)) == _names_shapes(P._tensor_shapes_from_checkpoint(d))


def test_mtp_layer_names_follow_the_hub_releases():
    g45 = P.enumerate_tensors(P.parse_config(P.reference_config("glm-4.5")))
    p = "model.layers.92."
    assert g45[p + "eh_proj.weight"][0] == (5120, 10240)
    assert g45[p + "embed_tokens.weight"][0] == g45[p + "shared_head.head.weight"][0] == (151552, 5120)
    assert g45[p + "mlp.experts.159.down_proj.weight"][0] == (5120, 1536)
    assert "model.layers.93.input_layernorm.weight" not in g45
    g5 = P.enumerate_tensors(P.parse_config(P.reference_config("glm-5")))
    p = "model.layers.78."
    assert g5[p + "self_attn.indexer.wq_b.weight"][0] == (32 * 128, 2048)
    assert g5[p + "self_attn.kv_a_proj_with_mqa.weight"][0] == (512 + 64, 6144)
    assert g5[p + "self_attn.kv_b_proj.weight"][0] == (64 * (192 + 256), 512)
    assert p + "embed_tokens.weight" not in g5 and p + "shared_head.head.weight" not in g5  # tied in GLM-5
    assert P.tensor_role(p + "mlp.experts.0.up_proj.weight", 78) == "mtp"
    assert P.tensor_role("model.layers.77.mlp.experts.0.up_proj.weight", 78) == "routed_experts"


def test_kimi_k25_nests_text_config(kimi):
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": {**_ref("kimi-k2"), "model_type": "kimi_k2"}}
    spec = P.parse_config(cfg)
    assert spec.arch == "deepseek_v3" and spec.prefix == "language_model."
    t = P.enumerate_tensors(spec)
    assert t["language_model.model.layers.60.self_attn.kv_a_proj_with_mqa.weight"][0] == (576, 7168)
    assert "language_model.lm_head.weight" in t
    assert P.kv_layout(spec).bytes_per_token("bfloat16") == 70_272


@pytest.mark.parametrize("cfg", [{"model_type": "gpt2", "n_layer": 2}, {"hidden_size": 8}])
def test_unsupported_architecture_says_so(cfg):
    with pytest.raises(ConfigError) as e:
        P.parse_config(cfg)
    assert "not supported" in e.value.message and "deepseek_v3" in e.value.hint


def test_incomplete_config_names_the_missing_key():
    cfg = _ref("glm-4.5")
    del cfg["n_routed_experts"]
    with pytest.raises(ConfigError, match="n_routed_experts"):
        P.parse_config(cfg)


def test_hub_id_resolves_through_the_local_cache_only(tiny, tmp_path, monkeypatch):
    import shutil

    from huggingface_hub import constants

    snap = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny["mixtral"], snap)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    r = P.plan("org/tiny", opts=P.PlanOptions(gpus=1, gpu_memory_gib=1))
    assert r.arch == "mixtral" and r.checkpoint_bytes["source"] == sum(
        f.stat().st_size for f in snap.glob("*.safetensors"))
    with pytest.raises(ConfigError):
        P.plan("org/not-cached")


def test_reference_configs_state_their_sources():
    for name in P.REFERENCE_CONFIGS:
        cfg = P.reference_config(name)
        assert isinstance(cfg["_source"], dict) and cfg["_source"]
        P.parse_config(cfg)
    with pytest.raises(ConfigError):
        P.plan("glm-9")


# ---- predicted bytes ------------------------------------------------------------------------------
def _direct_int4_bytes(headers) -> tuple[int, int]:
    """int4-experts-rtn from the formulas: weight_packed int32 [out, ceil(in/8)], weight_scale bf16
    [out, in/32], weight_shape int64 [2]; everything else keeps its bytes."""
    total, matched = 0, 0
    for name, (shape, dtype) in headers.items():
        if name.endswith(".weight") and EXPERT_RX.match(name[:-7]):
            out, k = shape
            total += out * math.ceil(k / 8) * 4 + out * (k // 32) * 2 + 16
            matched += 1
        else:
            total += math.prod(shape) * DTYPE_BYTES[dtype]
    return total, matched


@pytest.mark.parametrize("arch", ARCHS)
def test_int4_recipe_bytes_match_the_formulas(tiny, arch):
    headers = P._tensor_shapes_from_checkpoint(tiny[arch])
    expected, matched = _direct_int4_bytes(headers)
    assert matched > 0
    assert P.predict_bytes(headers, load_recipe("int4-experts-rtn"), header=False) == expected
    assert expected < P.predict_bytes(headers, None, header=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_header_estimate_within_half_a_percent_of_real_files(tiny, arch, tmp_path):
    d = tiny[arch]
    shards = sorted(d.glob("*.safetensors"))
    headers = P._tensor_shapes_from_checkpoint(d)
    actual = sum(f.stat().st_size for f in shards)
    assert abs(P.predict_bytes(headers, None, n_shards=len(shards)) - actual) <= 0.005 * actual
    # The quantized layout written as a real safetensors file (zeros): same check on the output side.
    layout = P.quantized_layout(headers, load_recipe("int4-experts-rtn"))
    f = tmp_path / "q.safetensors"
    save_file({k: torch.zeros(s, dtype=TORCH[dt]) for k, (s, dt) in layout.items()}, str(f), metadata={"format": "pt"})
    assert abs(P.predict_bytes(layout, None, n_shards=1) - f.stat().st_size) <= 0.005 * f.stat().st_size
    # plan() on the directory uses the same headers and the real shard sizes
    r = P.plan(d, "int4-experts-rtn", opts=P.PlanOptions(gpus=1, gpu_memory_gib=1, context_len=64))
    assert r.checkpoint_bytes["source"] == actual
    assert abs(r.checkpoint_bytes["recipe"] - (_direct_int4_bytes(headers)[0])) <= 0.05 * actual


MIXED = """
name: mixed
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']
    scheme: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 64}
  attention:
    targets: ['re:.*self_attn\\.(q|k|v|o)_proj$']
    scheme: {num_bits: 8, type: float, strategy: block, block_structure: [128, 128], fallback: channel}
kv_cache: {strategy: attn_head}
ignore: ['re:.*\\.mlp\\.gate$']
"""


def test_asymmetric_fp8_block_and_kv_scale_tensors(tiny):
    d = tiny["qwen3_moe"]
    spec = P.parse_config(read_json(d / "config.json"))
    headers = P._tensor_shapes_from_checkpoint(d)
    out = P.quantized_layout(headers, parse_recipe(MIXED), spec=spec)
    e = "model.layers.0.mlp.experts.1.gate_proj"  # [64, 128], group 64 -> 2 groups
    assert out[e + ".weight_packed"] == ((64, 16), "I32")
    assert out[e + ".weight_scale"] == ((64, 2), "BF16")
    assert out[e + ".weight_zero_point"] == ((8, 2), "I32")  # [ceil(out/8), groups]
    assert out[e + ".weight_shape"] == ((2,), "I64")
    o = "model.layers.1.self_attn.o_proj"  # [128, 128] FP8 with one 128x128 block (not fused)
    assert out[o + ".weight"] == ((128, 128), "F8_E4M3") and out[o + ".weight_scale"] == ((1, 1), "F32")
    q = "model.layers.1.self_attn.q_proj"  # [128, 128], fused with k_proj [64, 128] (not a whole block): channel
    assert out[q + ".weight"] == ((128, 128), "F8_E4M3") and out[q + ".weight_scale"] == ((128, 1), "F32")
    with pytest.raises(GroupSizeError, match="fuse"):  # without the fallback: refused, as convert refuses it
        P.quantized_layout(headers, parse_recipe(MIXED.replace(", fallback: channel", "")), spec=spec)
    assert out["model.layers.1.self_attn.k_scale"] == ((2, 1, 1), "F32")  # [num_kv_heads, 1, 1]
    assert out["model.layers.0.mlp.gate.weight"] == headers["model.layers.0.mlp.gate.weight"]
    mla = P.quantized_layout(P._tensor_shapes_from_checkpoint(tiny["deepseek_v3"]), parse_recipe(MIXED),
                             spec=P.parse_config(read_json(tiny["deepseek_v3"] / "config.json")))
    assert mla["model.layers.0.self_attn.v_scale"] == ((1,), "F32")  # MLA: one latent, one scale (as convert writes it)


def test_group_size_error_and_fallback(tiny):
    headers = P._tensor_shapes_from_checkpoint(tiny["qwen3_moe"])  # down_proj in_features = 64
    g128 = """
name: g128
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']
    scheme: {num_bits: 4, group_size: 128%s}
"""
    with pytest.raises(GroupSizeError):
        P.predict_bytes(headers, parse_recipe(g128 % ""))
    out = P.quantized_layout(headers, parse_recipe(g128 % ", fallback: channel"))
    assert out["model.layers.0.mlp.experts.0.down_proj.weight_scale"] == ((128, 1), "BF16")
    assert out["model.layers.0.mlp.experts.0.up_proj.weight_scale"] == ((64, 1), "BF16")  # 128 / 128


def test_fused_experts_are_sized_as_the_per_expert_tensors_quantkit_writes():
    E, D, Im = 4, 128, 64
    fused = {"model.layers.0.mlp.experts.gate_up_proj": ((E, 2 * Im, D), "BF16"),
             "model.layers.0.mlp.experts.down_proj": ((E, D, Im), "BF16")}
    split = {}
    for e in range(E):
        for p, shape in (("gate_proj", (Im, D)), ("up_proj", (Im, D)), ("down_proj", (D, Im))):
            split[f"model.layers.0.mlp.experts.{e}.{p}.weight"] = (shape, "BF16")
    rec = load_recipe("int4-experts-rtn")
    assert P.quantized_layout(fused, rec) == P.quantized_layout(split, rec)


# ---- report -------------------------------------------------------------------------------------
def test_to_json_contract(kimi, glm45):
    for r in (kimi, glm45):
        j = json.loads(json.dumps(r.to_json()))
        assert {"parameters", "checkpoint_bytes", "kv_bytes_per_token", "kv_tokens", "max_concurrency"} <= set(j)
        assert set(j["checkpoint_bytes"]) >= {"source", "recipe"}
        for key in ("kv_bytes_per_token", "kv_tokens", "max_concurrency"):
            assert set(j[key]) == {"bfloat16", "float8_e4m3", "fp8_ds_mla"}
        assert "total" in j["parameters"] and j["assumptions"]
    assert kimi.to_json()["checkpoint_bytes"]["recipe"] is None
    assert glm45.to_json()["checkpoint_bytes"]["recipe"] < glm45.to_json()["checkpoint_bytes"]["source"]


def test_render_draws_the_tables(glm5):
    buf = io.StringIO()
    P.render(glm5, Console(file=buf, width=140))
    text = buf.getvalue()
    for s in ("routed_experts", "109,824", "61,464", "fp8_ds_mla", "421.0 GiB", "activation reserve"):
        assert s in text


# ---- the provider's figures (docs/memory.md) ----------------------------------------------------------
def test_docs_memory_figures(tmp_path, glm5):
    # Kimi K2.6: K2 text architecture, INT4 g32 experts + BF16 rest, 8 x H200 (140 GiB), 26 GiB reserve.
    k26 = {**{k: v for k, v in _ref("kimi-k2").items() if k != "quantization_config"}}
    k26["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
        "ignore": KIMI_INT4_IGNORE}
    r = P.plan(_write(tmp_path, "kimi-k2.6.json", k26),
               opts=P.PlanOptions(gpus=8, gpu_memory_gib=140, activation_reserve_gib=26, context_len=21400))
    assert abs(r.kv_tokens["bfloat16"] - 686_000) <= 0.01 * 686_000
    assert abs(r.kv_tokens["float8_e4m3"] - 1_370_000) <= 0.01 * 1_370_000
    assert (r.max_concurrency["bfloat16"], r.max_concurrency["float8_e4m3"]) == (32, 64)
    # GLM-5: the FP8 release is ~705 GiB; INT4 g32 experts with BF16 elsewhere ~421 GiB.
    fp8 = copy.deepcopy(_ref("glm-5"))
    fp8["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    src = P.plan(_write(tmp_path, "glm-5-fp8.json", fp8)).checkpoint_bytes["source"]
    int4 = glm5.checkpoint_bytes["recipe"]
    assert abs(src / GIB - 705) <= 3 and abs(int4 / GIB - 421) <= 2
    assert round(1 - int4 / src, 2) == 0.40
