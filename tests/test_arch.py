"""arch.py: the registry every command consults, and config.json held against the tensors.

A config.json is hostile input: a field the tensors contradict (layers, hidden size, vocab, experts, heads, which
layers are dense, the shared expert, every attention projection, GQA and MLA) ends every command that builds from
it in one line naming the field and the tensor, exit 1, within a second; never a hang, a traceback or a silent
conversion. What transformers' config classes accept (their attribute_map aliases) is accepted."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from harness import assert_clean_failure, cli  # noqa: F401
from quantkit import arch
from quantkit.arch.layout import enumerate_tensors
from quantkit.errors import ConfigError, ConfigMismatch
from quantkit.plan.source import reference_config
from quantkit.read.checkpoint import Checkpoint
from quantkit.tiny import ARCHS


@pytest.fixture(scope="module")
def qwen(tiny_models):
    return tiny_models("qwen3_moe", layers=2)  # hidden 128, vocab 512, 4 experts, 4 heads x 32, 2 KV heads


def _with_config(src, tmp_path, **changes):
    """A copy of `src` whose (text model's) config.json has `changes`; a value `_DROP` removes the key."""
    d = tmp_path / "src"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    text = cfg["text_config"] if cfg.get("model_type") == "kimi_k25" else cfg
    text.update(changes)
    for k in [k for k, v in text.items() if v == _DROP]:
        del text[k]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


_DROP = "<drop>"


def _shapes(d):
    ck = Checkpoint.open(d)
    return ck.config, {n: ck.info(n).shape for n in ck.location}


CASES = {
    # field, value -> (config key named, tensor named in the message); the tiny qwen3_moe model unless "arch:" leads
    "layers_huge": ({"num_hidden_layers": 10**9}, "num_hidden_layers", "model.layers.1.*"),
    "layers_fewer": ({"num_hidden_layers": 1}, "num_hidden_layers", "model.layers.1.*"),
    "layers_more": ({"num_hidden_layers": 3}, "num_hidden_layers", "model.layers.2.*"),
    "hidden": ({"hidden_size": 64}, "hidden_size", "model.embed_tokens.weight"),
    "vocab_huge": ({"vocab_size": 10**9}, "vocab_size", "model.embed_tokens.weight"),
    "vocab": ({"vocab_size": 1000}, "vocab_size", "model.embed_tokens.weight"),
    "experts_more": ({"num_local_experts": 16}, "num_local_experts", "experts"),
    "experts_fewer": ({"num_local_experts": 2}, "num_local_experts", "experts"),
    "experts_alias": ({"num_experts": 16, "num_local_experts": _DROP}, "num_experts", "experts"),
    "heads": ({"num_attention_heads": 8}, "num_attention_heads", "self_attn.q_proj.weight"),
    "kv_heads": ({"num_key_value_heads": 4}, "num_key_value_heads", "self_attn.k_proj.weight"),
    "head_dim": ({"head_dim": 64}, "head_dim", "model.layers.0.self_attn.q_norm.weight"),
    # which layers are dense: the config's layout against the routed experts (or dense MLP) each layer holds
    "sparse_step": ({"decoder_sparse_step": 2}, "decoder_sparse_step", "model.layers.0.mlp.experts."),
    "mlp_only": ({"mlp_only_layers": [0, 1]}, "mlp_only_layers", "model.layers.0.mlp.experts."),
    "mlp_only_one": ({"mlp_only_layers": [1]}, "mlp_only_layers", "model.layers.1.mlp.experts."),
    "ds:first_dense_more": ({"first_k_dense_replace": 2}, "first_k_dense_replace", "model.layers.1.mlp.experts."),
    "ds:first_dense_none": ({"first_k_dense_replace": 0}, "first_k_dense_replace",
                            "model.layers.0.mlp.gate_proj.weight"),
    "ds:first_dense_default": ({"first_k_dense_replace": _DROP}, "first_k_dense_replace",
                               "model.layers.1.mlp.experts."),  # transformers' default: 3 (of 2 layers)
    "ds:moe_layer_freq": ({"moe_layer_freq": 2}, "moe_layer_freq", "model.layers.1.mlp.experts."),
    "glm4:first_dense_none": ({"first_k_dense_replace": 0}, "first_k_dense_replace",
                              "model.layers.0.mlp.gate_proj.weight"),
    "dsa:layer_types_dense": ({"mlp_layer_types": ["dense", "dense"]}, "mlp_layer_types",
                              "model.layers.1.mlp.experts."),
    "dsa:layer_types_sparse": ({"mlp_layer_types": ["sparse", "sparse"]}, "mlp_layer_types",
                               "model.layers.0.mlp.gate_proj.weight"),
    # MLA: every projection against the ranks and head widths
    "ds:q_lora_null": ({"q_lora_rank": None}, "q_lora_rank", "model.layers.0.self_attn.q_a_proj"),
    "ds:q_lora_rank": ({"q_lora_rank": 128}, "q_lora_rank", "model.layers.0.self_attn.q_a_proj.weight"),
    "ds:kv_lora_rank": ({"kv_lora_rank": 64}, "kv_lora_rank", "model.layers.0.self_attn.kv_a_layernorm.weight"),
    "ds:qk_nope": ({"qk_nope_head_dim": 16}, "qk_nope_head_dim", "model.layers.0.self_attn.q_b_proj.weight"),
    "ds:qk_rope": ({"qk_rope_head_dim": 32}, "qk_rope_head_dim",
                   "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),
    "ds:v_head_dim": ({"v_head_dim": 64}, "v_head_dim", "model.layers.0.self_attn.kv_b_proj.weight"),
    "ds:heads": ({"num_attention_heads": 8}, "num_attention_heads", "model.layers.0.self_attn.q_b_proj.weight"),
    "ds:q_lora_huge": ({"q_lora_rank": 10**9}, "q_lora_rank", "model.layers.0.self_attn.q_a_proj.weight"),
    "dsa:v_head_dim": ({"v_head_dim": 16}, "v_head_dim", "model.layers.0.self_attn.kv_b_proj.weight"),
    "k25:kv_lora_rank": ({"kv_lora_rank": 64}, "kv_lora_rank",
                         "language_model.model.layers.0.self_attn.kv_a_layernorm.weight"),
    "k25:first_dense_none": ({"first_k_dense_replace": 0}, "first_k_dense_replace",
                             "language_model.model.layers.0.mlp.gate_proj.weight"),
    # the shared expert: n_shared_experts x moe_intermediate_size wide, or absent
    "ds:shared_none": ({"n_shared_experts": 0}, "n_shared_experts", "model.layers.1.mlp.shared_experts."),
    "ds:shared_two": ({"n_shared_experts": 2}, "n_shared_experts",
                      "model.layers.1.mlp.shared_experts.gate_proj.weight"),
    "glm4:shared_none": ({"n_shared_experts": 0}, "n_shared_experts", "model.layers.1.mlp.shared_experts."),
    "dsa:shared_two": ({"n_shared_experts": 2}, "n_shared_experts",
                       "model.layers.1.mlp.shared_experts.gate_proj.weight"),
    # dense models: the MLP's width
    "llama:intermediate": ({"intermediate_size": 512}, "intermediate_size", "model.layers.0.mlp.gate_proj.weight"),
    "qwen3:head_dim": ({"head_dim": 64}, "head_dim", "model.layers.0.self_attn.q_norm.weight"),
}
_ARCH_OF = {"ds": "deepseek_v3", "glm4": "glm4_moe", "dsa": "glm_moe_dsa", "k25": "kimi_k25", "llama": "llama",
            "qwen3": "qwen3"}


def _source(tiny_models, case):
    """The tiny model a case edits: the arch its name leads with, else qwen3_moe (2 layers each)."""
    a = _ARCH_OF[case.split(":")[0]] if ":" in case else "qwen3_moe"
    return tiny_models(a, layers=2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_contradicting_tensors_is_named(tiny_models, tmp_path, case):
    changes, field, tensor = CASES[case]
    d = _with_config(_source(tiny_models, case), tmp_path, **changes)
    config, shapes = _shapes(d)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        arch.validate(config, shapes)
    assert time.perf_counter() - t0 < 1.0
    msg = e.value.message
    assert field in msg and tensor in msg, msg
    assert isinstance(e.value, ConfigMismatch), msg
    assert "\n" not in msg


@pytest.mark.parametrize("command", ["convert", "calibrate", "plan"])
@pytest.mark.parametrize("case", ["layers_huge", "hidden", "vocab_huge", "experts_more", "heads", "sparse_step",
                                  "ds:first_dense_more", "ds:q_lora_null", "ds:shared_none"])
def test_every_command_stops_on_a_contradicting_config(cli, tiny_models, tmp_path, case, command):  # noqa: F811
    changes, field, tensor = CASES[case]
    d = _with_config(_source(tiny_models, case), tmp_path, **changes)
    out = tmp_path / "out"
    args = {"convert": ("convert", d, out, "--recipe", "int4-experts-rtn", "--json"),
            "calibrate": ("calibrate", d, "-o", tmp_path / "kv.safetensors", "--json"),
            "plan": ("plan", d, "--json")}[command]
    t0 = time.perf_counter()
    r = cli.run(*args)
    assert time.perf_counter() - t0 < 5.0  # the command itself; the check is well under a second (above)
    line = assert_clean_failure(r, out)
    assert field in line and tensor in line, line
    assert not (tmp_path / "kv.safetensors").exists()


def test_a_consistent_config_passes_and_unknown_types_are_not_checked(qwen):
    config, shapes = _shapes(qwen)
    spec = arch.validate(config, shapes)
    assert spec.arch == "qwen3_moe" and spec.num_experts == 4 and spec.num_layers == 2
    assert arch.validate({"model_type": "gpt2"}, shapes) is None  # model-free conversion of any architecture


@pytest.mark.parametrize("name", ARCHS + ("llama", "qwen3", "kimi_k25"))
def test_every_tiny_model_validates_against_its_own_tensors(tiny_models, name):
    config, shapes = _shapes(tiny_models(name, layers=2))
    spec = arch.validate(config, shapes)
    assert spec is not None and spec.num_layers == 2


@pytest.mark.parametrize("name", ["kimi-k2", "glm-4.5", "glm-5"])
def test_every_real_config_validates_against_its_hub_layout(name):
    """The release configs against the tensors of their hub layout (Kimi K2: ~70k), MTP layers included, in
    well under a second, and the same tensors with one layer's MLP swapped for the other kind refused."""
    cfg = reference_config(name)
    cfg.pop("_source")
    spec = arch.parse_config(cfg)
    shapes = {n: shape for n, (shape, _) in enumerate_tensors(spec).items()}
    t0 = time.perf_counter()
    assert arch.validate(cfg, shapes) == spec
    assert time.perf_counter() - t0 < 3.0
    first_moe = spec.moe.index(True)
    with pytest.raises(ConfigMismatch, match="first_k_dense_replace|mlp_layer_types") as e:
        arch.validate({**cfg, "first_k_dense_replace": first_moe + 1, "mlp_layer_types": None}, shapes)
    assert f"model.layers.{first_moe}.mlp.experts." in e.value.message


# tensors edited, the config kept: each GQA / MLA projection and the router are held to it
TENSOR_CASES = {
    # arch, tensor, its shape -> field named
    "v_proj": ("qwen3_moe", "model.layers.1.self_attn.v_proj.weight", (32, 128), "num_key_value_heads"),
    "o_proj": ("qwen3_moe", "model.layers.1.self_attn.o_proj.weight", (128, 64), "num_attention_heads"),
    "o_proj_rows": ("llama", "model.layers.1.self_attn.o_proj.weight", (64, 128), "hidden_size"),
    "router": ("mixtral", "model.layers.1.block_sparse_moe.gate.weight", (8, 128), "num_local_experts"),
    "dense_down": ("deepseek_v3", "model.layers.0.mlp.down_proj.weight", (128, 128), "intermediate_size"),
    "mla_o_proj": ("deepseek_v3", "model.layers.1.self_attn.o_proj.weight", (128, 64), "num_attention_heads"),
    "mla_kv_b": ("kimi_k25", "language_model.model.layers.1.self_attn.kv_b_proj.weight", (256, 64), "kv_lora_rank"),
    "mla_q_a_norm": ("glm_moe_dsa", "model.layers.1.self_attn.q_a_layernorm.weight", (32,), "q_lora_rank"),
    "shared_down": ("glm4_moe", "model.layers.1.mlp.shared_experts.down_proj.weight", (128, 32), "n_shared_experts"),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_each_projection_is_held_to_the_config(tiny_models, case):
    name, tensor, shape, field = TENSOR_CASES[case]
    config, shapes = _shapes(tiny_models(name, layers=2))
    assert tensor in shapes
    with pytest.raises(ConfigMismatch) as e:
        arch.validate(config, {**shapes, tensor: shape})
    assert e.value.message.startswith(f"config.json {field} = ") and tensor in e.value.message, e.value.message


def test_a_layer_missing_its_router_or_mlp_is_refused(tiny_models):
    config, shapes = _shapes(tiny_models("deepseek_v3", layers=2))
    without = lambda part: {n: s for n, s in shapes.items() if part not in n}  # noqa: E731
    with pytest.raises(ConfigMismatch, match=r"no router \(model\.layers\.1\.mlp\.gate\.weight\)"):
        arch.validate(config, without("layers.1.mlp.gate."))
    with pytest.raises(ConfigMismatch, match=r"first_k_dense_replace = 1 .*model\.layers\.0\.mlp\.up_proj\.weight"):
        arch.validate(config, without("layers.0.mlp.up_proj"))
    # a module stored in another form than `.weight` (a packed checkpoint's) counts as present, unchecked
    packed = {(n[: -len(".weight")] + ".weight_other" if ".self_attn." in n else n): s for n, s in shapes.items()}
    assert arch.validate(config, packed) is not None


# transformers' config classes read other spellings of some fields (their attribute_map): so does quantkit
ALIASES = [("glm_moe_dsa", "n_routed_experts", "num_experts"),
           ("glm_moe_dsa", "n_routed_experts", "num_local_experts"),
           ("deepseek_v3", "n_routed_experts", "num_local_experts"),
           ("glm4_moe", "n_routed_experts", "num_local_experts"),
           ("kimi_k25", "n_routed_experts", "num_local_experts"), ("mixtral", "num_local_experts", "num_experts"),
           ("olmoe", "num_experts", "num_local_experts"), ("qwen3_moe", "num_local_experts", "num_experts"),
           ("deepseek_v3", "num_nextn_predict_layers", "num_mtp_layers")]


@pytest.mark.parametrize("name, key, alias", ALIASES)
def test_what_transformers_config_classes_accept_is_accepted(tiny_models, tmp_path, name, key, alias):
    src = tiny_models(name, layers=2)
    config, shapes = _shapes(src)
    spec = arch.validate(config, shapes)
    d = _with_config(src, tmp_path, **{alias: arch.text_config(config)[0][key], key: _DROP})
    assert arch.validate(*_shapes(d)) == spec
    # both spellings with different values: transformers keeps the last, so engines may read either
    d2 = _with_config(src, tmp_path / "both", **{alias: arch.text_config(config)[0][key] + 1})
    with pytest.raises(ConfigError, match=f"{key} = .* and {alias} = |{alias} = .* and {key} = "):
        arch.validate(*_shapes(d2))


def test_registry_aliases_are_transformers_attribute_maps():
    """Every alias a family's transformers config class maps (attribute_map) is one of its Arch.aliases groups."""
    import transformers

    for name, a in arch.ARCHITECTURES.items():
        amap = transformers.CONFIG_MAPPING[name].attribute_map
        for alias, target in amap.items():
            assert any({alias, target} <= set(g) for g in a.aliases), (name, alias, target)
        for g in a.aliases:
            assert len(g) == 2 or name == "glm_moe_dsa", (name, g)  # GlmMoeDsaConfig also reroutes num_experts


def test_registry_is_the_one_list():
    """Every command's notion of "supported" comes from ARCHITECTURES."""
    from quantkit.plan import SUPPORTED_MODEL_TYPES

    assert set(SUPPORTED_MODEL_TYPES) == set(arch.ARCHITECTURES) | set(arch.ALIASES) | set(arch.WRAPPERS)
    assert arch.arch_for({"model_type": "kimi_k2"}) is arch.ARCHITECTURES["deepseek_v3"]
    cfg, prefix = arch.text_config({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}})
    assert prefix == "language_model." and cfg["model_type"] == "deepseek_v3"
    with pytest.raises(ConfigError, match="text_config"):
        arch.text_config({"model_type": "kimi_k25"})


def test_fused_experts_split_in_the_transformers_layout():
    parts = arch.fused_experts("model.layers.0.mlp.experts.gate_up_proj", (2, 8, 4), hidden=4)
    assert [(m, e, r, s) for m, e, r, s in parts][:2] == [
        ("model.layers.0.mlp.experts.0.gate_proj", 0, (0, 4), (4, 4)),
        ("model.layers.0.mlp.experts.0.up_proj", 0, (4, 8), (4, 4))]
    assert arch.fused_experts("model.layers.0.mlp.experts.down_proj", (2, 4, 4))[1][0].endswith("1.down_proj")
    with pytest.raises(ConfigError, match="layout"):
        arch.fused_experts("model.layers.0.mlp.experts.gate_up_proj", (2, 4, 8), hidden=4)
    assert arch.fused_experts("model.layers.0.mlp.gate.weight", (4, 4)) is None


def test_support_lists_come_from_the_registry():
    """The hints of UnsupportedArchitecture / UnsupportedModel list what arch.py's registry says (a family
    added there appears in both without touching errors.py), and the raisers pass them."""
    from quantkit.errors import UnsupportedArchitecture, UnsupportedModel
    from quantkit.runtime.spec import parse_config as runner_config

    calib, runner = arch.model_types("calibrate"), arch.model_types("runner")
    assert set(calib) == set(arch.SUPPORTED_MODEL_TYPES)  # every family calibrates today (glm5, k2.5 included)
    assert set(runner) == {"qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "kimi_k2"}
    for name in calib:
        assert name in arch.support_hint("calibrate")
    for name in runner:
        assert name in arch.support_hint("runner")
    with pytest.raises(UnsupportedArchitecture) as e:
        arch.arch_for({"model_type": "gpt2"}, "calibrate")
    assert e.value.hint == arch.support_hint("calibrate") and "glm_moe_dsa" in e.value.hint
    with pytest.raises(UnsupportedModel) as e:
        runner_config({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                       "vocab_size": 8, "intermediate_size": 8})
    assert e.value.hint == arch.support_hint("runner") and "llama" not in e.value.hint


def test_layer_index_is_the_one_rule():
    assert arch.layer_index("model.layers.12.mlp.experts.3.down_proj.weight") == 12
    assert arch.layer_index("model.layers.0") is None  # the layer module itself: no dot after the index
    assert arch.layer_index("language_model.model.layers.7.self_attn.q_proj") == 7
    assert arch.layer_index("layers.2.x") == 2 and arch.layer_index("xlayers.2.x") is None
    assert arch.layer_index("model.embed_tokens.weight") is None
