"""arch.py: the registry every command consults, and config.json held against the tensors.

A config.json is hostile input: a field the tensors contradict (layers, hidden size, vocab, experts, heads)
ends every command that builds from it in one line naming the field and the tensor, exit 1, within a
second; never a hang, a traceback or a silent conversion."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from harness import assert_clean_failure, cli  # noqa: F401
from quantkit import arch
from quantkit.errors import ConfigError, ConfigMismatch
from quantkit.read.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def qwen(tiny_models):
    return tiny_models("qwen3_moe", layers=2)  # hidden 128, vocab 512, 4 experts, 4 heads x 32, 2 KV heads


def _with_config(src, tmp_path, **changes):
    d = tmp_path / "src"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _shapes(d):
    ck = Checkpoint.open(d)
    return ck.config, {n: ck.info(n).shape for n in ck.location}


CASES = {
    # field, value -> (config key named, tensor named in the message)
    "layers_huge": ({"num_hidden_layers": 10**9}, "num_hidden_layers", "model.layers.1.*"),
    "layers_fewer": ({"num_hidden_layers": 1}, "num_hidden_layers", "model.layers.1.*"),
    "layers_more": ({"num_hidden_layers": 3}, "num_hidden_layers", "model.layers.2.*"),
    "hidden": ({"hidden_size": 64}, "hidden_size", "model.embed_tokens.weight"),
    "vocab_huge": ({"vocab_size": 10**9}, "vocab_size", "model.embed_tokens.weight"),
    "vocab": ({"vocab_size": 1000}, "vocab_size", "model.embed_tokens.weight"),
    "experts_more": ({"num_experts": 16}, "num_experts", "experts"),
    "experts_fewer": ({"num_experts": 2}, "num_experts", "experts"),
    "heads": ({"num_attention_heads": 8}, "num_attention_heads", "self_attn.q_proj.weight"),
    "kv_heads": ({"num_key_value_heads": 4}, "num_key_value_heads", "self_attn.k_proj.weight"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_contradicting_tensors_is_named(qwen, tmp_path, case):
    changes, field, tensor = CASES[case]
    d = _with_config(qwen, tmp_path, **changes)
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
@pytest.mark.parametrize("case", ["layers_huge", "hidden", "vocab_huge", "experts_more", "heads"])
def test_every_command_stops_on_a_contradicting_config(cli, qwen, tmp_path, case, command):  # noqa: F811
    changes, field, tensor = CASES[case]
    d = _with_config(qwen, tmp_path, **changes)
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
