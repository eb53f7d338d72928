"""Hostile values in the fields of config.json, a recipe and a converted checkpoint's quantization_config:
each is one named error (the library raises the domain error; the command line prints one `error:` line,
never "internal error"), or, where the value is only shown (inspect), it is shown as text, never as markup."""

from __future__ import annotations

import json
import shutil

import pytest

from quantkit import errors as E
from quantkit.arch import FIELD_HINT, parse_config
from quantkit.calib.data import load_calibration_data
from quantkit.convert import ConvertOptions, convert
from quantkit.match.recipe import parse_recipe
from quantkit.plan import plan
from quantkit.verify import verify

from harness import assert_clean_failure, cli  # noqa: F401


def _set(**kv):
    return lambda cfg: cfg.update(kv)


def _dsa_indexer(**kv):  # glm_moe_dsa derives indexer_types from these when it is null
    return lambda cfg: cfg.update(indexer_types=None, **kv)


# (architecture, edit of config.json, words the error must carry)
CONFIG_CASES = {
    "mlp_only_layers_int": ("qwen3_moe", _set(mlp_only_layers=5), "mlp_only_layers"),
    "mlp_only_layers_nested": ("qwen3_moe", _set(mlp_only_layers=[[1]]), "mlp_only_layers"),
    "mlp_only_layers_string": ("qwen3_moe", _set(mlp_only_layers="01"), "mlp_only_layers"),
    "model_type_list": ("qwen3_moe", _set(model_type=["qwen3_moe"]), "model_type"),
    "model_type_object": ("qwen3_moe", _set(model_type={"a": 1}), "model_type"),
    "quantization_config_string": ("qwen3_moe", _set(quantization_config="fp8"), "quantization_config"),
    "quantization_config_list": ("qwen3_moe", _set(quantization_config=[1]), "quantization_config"),
    "moe_layer_freq_string": ("deepseek_v3", _set(moe_layer_freq="x"), "moe_layer_freq"),
    "moe_layer_freq_list": ("deepseek_v3", _set(moe_layer_freq=[1]), "moe_layer_freq"),
    "q_lora_rank_string": ("deepseek_v3", _set(q_lora_rank="x"), "q_lora_rank"),
    "q_lora_rank_list": ("deepseek_v3", _set(q_lora_rank=[64]), "q_lora_rank"),
    "index_topk_pattern_int": ("glm_moe_dsa", _dsa_indexer(index_topk_pattern=5), "indexer_types"),
    "index_topk_freq_string": ("glm_moe_dsa", _dsa_indexer(index_topk_freq="abc"), "index_topk_freq"),
    "index_skip_topk_offset_list": ("glm_moe_dsa", _dsa_indexer(index_skip_topk_offset=[1]), "index_skip_topk_offset"),
}


@pytest.fixture(scope="module")
def broken(tiny_models, tmp_path_factory):
    """case -> a copy of the tiny checkpoint of that architecture with the case's config.json."""
    root = tmp_path_factory.mktemp("broken_fields")
    out = {}
    for case, (arch, edit, _) in CONFIG_CASES.items():
        d = root / case
        shutil.copytree(tiny_models(arch), d)
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        out[case] = d
    return out


def _one_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "━" not in ln and not ln.startswith("converting")]
    assert r.rc == 1 and "Traceback" not in r.stderr, (r.rc, r.stderr)
    assert len(lines) in (1, 2) and lines[0].startswith("error: ") and "internal error" not in lines[0], r.stderr
    return lines[0]


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_field_of_the_wrong_type_is_named(cli, broken, tmp_path, case):  # noqa: F811
    src, words = broken[case], CONFIG_CASES[case][2]
    cfg = json.loads((src / "config.json").read_text())
    with pytest.raises(E.ConfigError) as ei:
        parse_config(cfg)
    assert words in ei.value.message and "\n" not in ei.value.message
    assert ei.value.hint == FIELD_HINT  # the field is wrong, not the file's JSON
    # every command that reads the config says the same, as one line
    with pytest.raises(E.ConfigError, match=words):
        plan(src / "config.json", recipe="int4-experts-rtn")
    with pytest.raises(E.ConfigError, match=words):
        convert(src, tmp_path / "lib", ConvertOptions(recipe="int4-experts-rtn"))
    line = assert_clean_failure(cli.convert(src, tmp_path / "out", "--json"), tmp_path / "out", FIELD_HINT)
    assert words in line and "internal error" not in line
    for argv in (("plan", src, "--recipe", "int4-experts-rtn"), ("plan", src / "config.json", "--json")):
        assert words in _one_error_line(cli.run(*argv))


def test_null_stands_for_the_default(tiny_models):
    """transformers reads a null field as its default; so does the config parser (not an error)."""
    cfg = json.loads((tiny_models("deepseek_v3") / "config.json").read_text())
    base = parse_config(cfg)
    spec = parse_config({**cfg, "moe_layer_freq": None, "n_group": None, "num_key_value_heads": None})
    assert spec.moe == base.moe and spec.n_group == 1 and spec.num_kv_heads == 1
    assert parse_config({**cfg, "q_lora_rank": None}).q_lora_rank is None


@pytest.mark.parametrize("value", ["[/x]", "[bogus]", "[red]shown[/red]"])
def test_inspect_shows_config_strings_as_text(cli, tiny_models, tmp_path, value):  # noqa: F811
    src = tmp_path / "src"
    shutil.copytree(tiny_models("qwen3_moe"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type=value, quantization_config={"format": value})  # no quant_method at all
    (src / "config.json").write_text(json.dumps(cfg))
    r = cli.run("inspect", src)
    assert r.rc == 0 and "Traceback" not in r.stderr, r.stderr
    head = r.stderr.splitlines()[0]
    assert f": {value}, " in head and f"quantization: None / {value}" in head, r.stderr


# ---- recipes ----------------------------------------------------------------------------------------
_G = "groups:\n  experts:\n    targets: ['re:.*experts.*']\n"
RECIPE_CASES = {
    "groups_scalar": ("groups: 5\n", "groups"),
    "groups_list": ("groups: [1, 2]\n", "groups"),
    "block_structure_scalar": (_G + "    scheme: {type: float, num_bits: 8, strategy: block, block_structure: 5}\n",
                               "block_structure"),
    "block_structure_string": (_G + "    scheme: {type: float, num_bits: 8, strategy: block, block_structure: ab}\n",
                               "block_structure"),
    "symmetric_string": (_G + "    scheme: {symmetric: 'no'}\n", "symmetric"),
    "num_bits_string": (_G + "    scheme: {num_bits: '4'}\n", "num_bits"),
    "num_samples_string": (_G + "calibration: {num_samples: many}\n", "num_samples"),
    "num_samples_fraction": (_G + "calibration: {num_samples: 1.5}\n", "num_samples"),
    "seq_len_huge": (_G + "calibration: {seq_len: 100000000000000000000}\n", "seq_len"),
    "dataset_list": (_G + "calibration: {dataset: [1]}\n", "dataset"),
    "dataset_object": (_G + "calibration: {dataset: {a: 1}}\n", "dataset"),
    # values that were accepted and would have reached config.json, or a loop without end
    "block_structure_on_int4": (_G + "    scheme: {block_structure: [1]}\n", "block_structure"),
    "group_size_on_fp8_block": (_G + "    scheme: {type: float, num_bits: 8, strategy: block, group_size: 7}\n",
                                "group_size"),
    "group_size_huge": (_G + "    scheme: {group_size: 1180591620717411303424}\n", "group_size"),
    "fallback_huge": (_G + "    scheme: {fallback: 1180591620717411303424}\n", "fallback"),
    "awq_n_grid_huge": (_G + "    method: awq\n    options: {n_grid: 1180591620717411303424}\n", "n_grid"),
    "name_list": ("name: [1]\n" + _G, "name"),
    "description_object": ("description: {a: 1}\n" + _G, "description"),
    "options_zero": (_G + "    method: gptq\n    options: 0\n", "options"),
    "ignore_zero": (_G + "ignore: 0\n", "ignore"),
    "ignore_object": (_G + "ignore: {}\n", "ignore"),
    "gptq_balance_pool_huge": (_G + "    method: gptq\n    options: {balance_tokens: 8, balance_pool: 100000000000}\n",
                               "balance_pool"),
}


@pytest.mark.parametrize("case", list(RECIPE_CASES))
def test_recipe_field_of_the_wrong_type_is_named(cli, tiny_models, tmp_path, case):  # noqa: F811
    text, words = RECIPE_CASES[case]
    with pytest.raises(E.RecipeError) as ei:
        parse_recipe(text)
    assert words in ei.value.message and "\n" not in ei.value.message
    (tmp_path / "r.yaml").write_text(text)
    out = tmp_path / "out"
    line = assert_clean_failure(cli.convert(tiny_models("qwen3_moe"), out, "--json", "--recipe", tmp_path / "r.yaml"),
                                out)
    assert words in line


@pytest.mark.parametrize("num_samples,seq_len", [(1.5, 8), (2, "8"), (2, 1 << 40), (True, 8)])
def test_calibration_sizes_are_checked_before_reading(num_samples, seq_len):
    with pytest.raises(E.DatasetError, match="num_samples and seq_len"):
        load_calibration_data(vocab_size=64, num_samples=num_samples, seq_len=seq_len)


def test_cli_bounds_calibration_sizes(cli, tiny_models, tmp_path):  # noqa: F811
    r = cli.convert(tiny_models("qwen3_moe"), tmp_path / "out", "--recipe", "int4-experts-gptq",
                    "--seq-len", str(1 << 40))
    assert r.rc == 2 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr


# ---- a converted checkpoint's quantization_config, as verify reads it ----------------------------------
@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("verify_fields") / "q"
    convert(tiny_models("qwen3_moe"), out, ConvertOptions(recipe="int4-experts-rtn"))
    return out


def _at(path, value):
    def edit(qc):
        node = qc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


VERIFY_CASES = {
    "format_list": (_at(["format"], ["pack-quantized"]), "quantization_config.format"),
    "format_object": (_at(["format"], {"a": 1}), "quantization_config.format"),
    "group_format_list": (lambda qc: qc.update(format="mixed-precision") or _at(
        ["config_groups", "group_0", "format"], [1])(qc), "format must be a string"),
    "input_activations_string": (_at(["config_groups", "group_0", "input_activations"], "x"), "input_activations"),
    "input_activations_number": (_at(["config_groups", "group_0", "input_activations"], -1), "input_activations"),
    "input_activations_list": (_at(["config_groups", "group_0", "input_activations"], []), "input_activations"),
    "input_activations_bad_args": (_at(["config_groups", "group_0", "input_activations"], {"num_bits": "x"}),
                                   "input_activations: compressed-tensors rejects it"),
}


@pytest.mark.parametrize("case", list(VERIFY_CASES))
def test_verify_names_a_broken_quantization_config(converted, tmp_path, case):
    pytest.importorskip("compressed_tensors")
    edit, words = VERIFY_CASES[case]
    d = tmp_path / "q"
    shutil.copytree(converted, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))
    r = verify(d)
    assert not r.passed and not r.format["ok"]
    assert any(words in p for p in r.format["problems"]), r.format["problems"][:3]
