"""config.json values that must stop in `arch.parse_config`, checked one by one and against each other.

Every later stage (convert, calibrate, plan, verify, export, the runner) builds from the `ModelSpec` the parser
returns, so a value it lets through (top-k above the expert count, zero KV heads, `true` where an int belongs,
NaN RoPE base, a routing group split that does not divide, 10**30 experts) would surface later as a
ZeroDivisionError, an OverflowError, a layer transformers cannot build, or a plan that runs for minutes.
Here: named cases per architecture, a hypothesis fuzzer over the real and tiny configs (every field mutated:
wrong types, zero, negative, huge, NaN, booleans), and the command line answering in one line.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import assert_clean_failure, cli  # noqa: F401
from quantkit import arch
from quantkit.errors import ConfigError, QuantkitError
from quantkit.plan.source import reference_config
from quantkit.tiny import ARCHS, tiny_config

REFERENCES = ("kimi-k2", "glm-4.5", "glm-5")


def _tiny(a: str) -> dict:
    """The config.json transformers writes for the tiny model of `a` (what tests/ and the demo convert)."""
    return json.loads(json.dumps(tiny_config(a).to_diff_dict()))


def _reference(name: str) -> dict:
    cfg = reference_config(name)
    cfg.pop("_source")
    return cfg


BASES = {**{a: _tiny(a) for a in ARCHS + ("llama", "qwen3")}, **{n: _reference(n) for n in REFERENCES}}
BASES["kimi_k25"] = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                     "text_config": {**_reference("kimi-k2"), "architectures": ["DeepseekV3ForCausalLM"]}}


def _text(cfg: dict) -> dict:
    return cfg["text_config"] if cfg.get("model_type") == "kimi_k25" else cfg


def _with(base: str, **changes) -> dict:
    cfg = copy.deepcopy(BASES[base])
    _text(cfg).update(changes)
    return cfg


def _consistent(spec: arch.ModelSpec) -> None:
    """What every accepted config guarantees the stages after the parser."""
    ints = [spec.vocab_size, spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            spec.intermediate_size, spec.n_group, spec.topk_group]
    assert all(type(x) is int and x >= 1 for x in ints), spec
    assert spec.hidden_size <= arch.MAX_HIDDEN and spec.num_layers <= arch.MAX_LAYERS
    assert spec.vocab_size <= arch.MAX_VOCAB and spec.num_heads <= arch.MAX_HEADS
    assert spec.num_heads % spec.num_kv_heads == 0
    assert len(spec.moe) == spec.num_layers + spec.mtp_layers
    assert type(spec.tie_word_embeddings) is bool and type(spec.norm_topk_prob) is bool
    assert math.isfinite(spec.routed_scaling_factor) and spec.routed_scaling_factor > 0
    if any(spec.moe):
        assert 1 <= spec.experts_per_tok <= spec.num_experts <= arch.MAX_EXPERTS
        assert spec.moe_intermediate_size >= 1
        assert spec.num_experts * sum(spec.moe) <= arch.MAX_ROUTED_EXPERTS
        if arch.ARCHITECTURES[spec.arch].routing == "noaux_tc":
            per_group = spec.num_experts // spec.n_group
            assert spec.num_experts % spec.n_group == 0 and per_group >= 2
            assert spec.topk_group <= spec.n_group and spec.experts_per_tok <= spec.topk_group * per_group
    if spec.attention == "mla":
        dims = [spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim]
        assert all(type(x) is int and x >= 1 for x in dims) and spec.qk_rope_head_dim % 2 == 0
        assert spec.q_lora_rank is None or (type(spec.q_lora_rank) is int and spec.q_lora_rank >= 1)
        assert spec.head_dim == spec.qk_nope_head_dim + spec.qk_rope_head_dim
    else:
        assert spec.head_dim <= arch.MAX_HEAD_DIM
    if spec.arch == "glm_moe_dsa":
        assert spec.index_n_heads >= 1 and spec.index_head_dim >= spec.qk_rope_head_dim
        assert len(spec.indexer) == len(spec.moe)
    for key in ("rms_norm_eps", "rope_theta", "clip_qkv", "partial_rotary_factor"):
        if key == "clip_qkv" and spec.arch != "olmoe":
            continue  # read by olmoe alone (transformers' OlmoeAttention); elsewhere an unread key, as in transformers
        v = spec.text.get(key)
        assert v is None or (not isinstance(v, bool) and math.isfinite(v) and v > 0), (key, v)


def _refused(cfg: dict) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        arch.parse_config(cfg)
    msg = e.value.message
    assert "\n" not in msg and len(msg) < 300, msg
    return e.value


# ---- what real configs hold still parses ---------------------------------------------------------
@pytest.mark.parametrize("base", sorted(BASES))
def test_real_and_tiny_configs_parse(base):
    _consistent(arch.parse_config(BASES[base]))


NULLABLE = ("num_key_value_heads", "head_dim", "n_group", "topk_group", "moe_layer_freq", "clip_qkv", "rms_norm_eps",
            "n_shared_experts", "num_nextn_predict_layers", "first_k_dense_replace", "norm_topk_prob",
            "attention_bias", "tie_word_embeddings", "scoring_func", "topk_method", "torch_dtype", "dtype",
            "mlp_only_layers", "decoder_sparse_step", "routed_scaling_factor", "use_qk_norm",
            "max_position_embeddings", "partial_rotary_factor", "index_topk", "rope_scaling", "rope_parameters",
            "sliding_window", "use_sliding_window", "mlp_bias", "rope_interleave", "mlp_layer_types", "indexer_types")


@pytest.mark.parametrize("base", sorted(BASES))
def test_null_stands_for_the_default(base):
    """transformers reads a null field as its default; so does the parser, field by field."""
    text = _text(BASES[base])
    keys = [k for k in NULLABLE if k in text]
    assert keys
    if text["hidden_size"] % text["num_attention_heads"] and arch.traits(text["model_type"]).attention == "gqa":
        keys.remove("head_dim")  # GLM-4.5: 96 heads of 128 in 5120; a derived head_dim would not be 128
    for key in keys:
        _consistent(arch.parse_config(_with(base, **{key: None})))


# ---- named cases: (base config, changes, words the one-line error carries) ---------------------------
CASES = {
    # top-k against the experts
    "topk_above_experts": ("qwen3_moe", dict(num_experts_per_tok=5), "num_experts_per_tok 5"),
    "topk_zero": ("mixtral", dict(num_experts_per_tok=0), "num_experts_per_tok"),
    "topk_above_experts_olmoe": ("olmoe", dict(num_experts_per_tok=9), "num_experts_per_tok"),
    "topk_above_experts_wrapped": ("kimi_k25", dict(num_experts_per_tok=385), "num_experts_per_tok"),
    "experts_zero_moe_layers": ("mixtral", dict(num_local_experts=0), "num_local_experts"),
    "experts_zero_deepseek": ("deepseek_v3", dict(n_routed_experts=0), "n_routed_experts"),
    # booleans and integers are not each other
    "bool_hidden": ("deepseek_v3", dict(hidden_size=True), "hidden_size"),
    "bool_topk": ("qwen3_moe", dict(num_experts_per_tok=True), "num_experts_per_tok"),
    "bool_experts": ("glm4_moe", dict(n_routed_experts=True), "n_routed_experts"),
    "int_bias": ("glm4_moe", dict(attention_bias=1), "attention_bias"),
    "string_bool": ("qwen3_moe", dict(norm_topk_prob="false"), "norm_topk_prob"),
    "int_tie": ("mixtral", dict(tie_word_embeddings=0), "tie_word_embeddings"),
    "float_layers": ("olmoe", dict(num_hidden_layers=2.0), "num_hidden_layers"),
    # zero and negative sizes
    "kv_heads_zero": ("qwen3_moe", dict(num_key_value_heads=0), "num_key_value_heads"),
    "kv_heads_not_dividing": ("qwen3_moe", dict(num_key_value_heads=3), "num_key_value_heads 3"),
    "kv_heads_not_dividing_mla": ("glm-5", dict(num_key_value_heads=48), "num_key_value_heads 48"),
    "expert_width_zero": ("deepseek_v3", dict(moe_intermediate_size=0), "moe_intermediate_size"),
    "expert_width_zero_mixtral": ("mixtral", dict(intermediate_size=0), "intermediate_size"),
    "dense_width_negative": ("glm-4.5", dict(intermediate_size=-1), "intermediate_size"),
    "hidden_negative": ("olmoe", dict(hidden_size=-128), "hidden_size"),
    "hidden_zero": ("kimi-k2", dict(hidden_size=0), "hidden_size"),
    "heads_zero": ("glm4_moe", dict(num_attention_heads=0), "num_attention_heads"),
    "layers_zero": ("glm_moe_dsa", dict(num_hidden_layers=0), "num_hidden_layers"),
    "vocab_zero": ("qwen3", dict(vocab_size=0), "vocab_size"),
    "shared_negative": ("deepseek_v3", dict(n_shared_experts=-1), "n_shared_experts"),
    "mtp_negative": ("glm-4.5", dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
    "sparse_step_zero": ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
    # head sizes
    "head_dim_huge": ("qwen3_moe", dict(head_dim=10**9), "head_dim"),
    "head_dim_zero": ("glm4_moe", dict(head_dim=0), "head_dim"),
    "hidden_not_divisible": ("mixtral", dict(hidden_size=130), "hidden_size 130"),
    "rotary_odd": ("glm4_moe", dict(head_dim=34), "partial_rotary_factor"),
    "partial_rotary_zero": ("glm-4.5", dict(partial_rotary_factor=0), "partial_rotary_factor"),
    "partial_rotary_above_one": ("glm-4.5", dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
    # olmoe's clip_qkv
    "clip_negative": ("olmoe", dict(clip_qkv=-1.0), "clip_qkv"),
    "clip_zero": ("olmoe", dict(clip_qkv=0), "clip_qkv"),
    "clip_nan": ("olmoe", dict(clip_qkv=float("nan")), "clip_qkv"),
    "clip_string": ("olmoe", dict(clip_qkv="8"), "clip_qkv"),
    "clip_bool": ("olmoe", dict(clip_qkv=True), "clip_qkv"),
    # floats: NaN, infinities, non-positive
    "rope_theta_nan": ("kimi-k2", dict(rope_theta=float("nan")), "rope_theta"),
    "rope_theta_inf": ("glm-4.5", dict(rope_theta=float("inf")), "rope_theta"),
    "rope_theta_zero": ("glm-5", dict(rope_theta=0), "rope_theta"),
    "rope_theta_null": ("kimi-k2", dict(rope_theta=None), "rope_theta"),
    "rope_parameters_theta_neg": ("qwen3_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
                                  "rope_theta"),
    "rope_scaling_factor_inf": ("kimi-k2", dict(rope_scaling={"type": "yarn", "factor": float("inf")}), "factor"),
    "rope_scaling_string": ("kimi-k2", dict(rope_scaling="yarn"), "rope_scaling"),
    "rope_huge_int": ("mixtral", dict(rope_theta=10**400), "rope_theta"),
    "eps_zero": ("deepseek_v3", dict(rms_norm_eps=0), "rms_norm_eps"),
    "eps_negative": ("olmoe", dict(rms_norm_eps=-1e-6), "rms_norm_eps"),
    "eps_inf": ("glm-5", dict(rms_norm_eps=float("-inf")), "rms_norm_eps"),
    "scaling_nan": ("glm-4.5", dict(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    "scaling_string": ("kimi-k2", dict(routed_scaling_factor="2.5"), "routed_scaling_factor"),
    "positions_zero": ("qwen3_moe", dict(max_position_embeddings=0), "max_position_embeddings"),
    # DeepSeek / GLM group-limited routing
    "groups_not_dividing": ("deepseek_v3", dict(n_group=3), "n_group 3"),
    "group_of_one": ("glm-5", dict(n_group=256, topk_group=4), "n_group 256"),
    "groups_zero": ("kimi-k2", dict(n_group=0), "n_group"),
    "topk_group_above_groups": ("glm-4.5", dict(topk_group=2), "topk_group 2"),
    "topk_beyond_chosen_groups": ("glm-5", dict(n_group=64, topk_group=1), "num_experts_per_tok 8"),
    "topk_group_zero": ("deepseek_v3", dict(topk_group=0), "topk_group"),
    "dense_beyond_layers": ("kimi-k2", dict(first_k_dense_replace=62), "first_k_dense_replace 62"),
    "dense_negative": ("glm4_moe", dict(first_k_dense_replace=-1), "first_k_dense_replace"),
    "scoring_unknown": ("glm-5", dict(scoring_func="relu"), "scoring_func"),
    # MLA ranks
    "q_rank_zero": ("kimi-k2", dict(q_lora_rank=0), "q_lora_rank"),
    "kv_rank_zero": ("deepseek_v3", dict(kv_lora_rank=0), "kv_lora_rank"),
    "nope_negative": ("glm-5", dict(qk_nope_head_dim=-1), "qk_nope_head_dim"),
    "rope_dim_zero": ("kimi-k2", dict(qk_rope_head_dim=0), "qk_rope_head_dim"),
    "rope_dim_odd": ("deepseek_v3", dict(qk_rope_head_dim=15), "qk_rope_head_dim 15"),
    "v_dim_zero": ("glm_moe_dsa", dict(v_head_dim=0), "v_head_dim"),
    "mla_dim_huge": ("kimi_k25", dict(v_head_dim=10**9), "v_head_dim"),
    # GLM-5's DSA indexer
    "index_heads_zero": ("glm-5", dict(index_n_heads=0), "index_n_heads"),
    "index_dim_negative": ("glm_moe_dsa", dict(index_head_dim=-32), "index_head_dim"),
    "index_dim_below_rope": ("glm-5", dict(index_head_dim=32), "index_head_dim 32"),
    "index_topk_zero": ("glm-5", dict(index_topk=0), "index_topk"),
    "mlp_layer_types_bad": ("glm_moe_dsa", dict(mlp_layer_types=["dense", 5]), "mlp_layer_types"),
    # sizes that would overflow or hang the byte arithmetic of plan
    "experts_1e30": ("kimi-k2", dict(n_routed_experts=10**30), "n_routed_experts"),
    "experts_times_layers": ("kimi-k2", dict(n_routed_experts=16384, num_experts_per_tok=8),
                             "routed experts"),
    "layers_1e30": ("glm-4.5", dict(num_hidden_layers=10**30), "num_hidden_layers"),
    "vocab_negative_huge": ("mixtral", dict(vocab_size=-10**5000), "vocab_size"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_value_is_one_named_error(case):
    base, changes, words = CASES[case]
    e = _refused(_with(base, **changes))
    assert words in e.message, e.message
    assert e.hint


@pytest.mark.parametrize("value", ["A" * 10_000 + "\n[red]x", ["\n"] * 10_000, {"a" * 5000: 1}, 10**4000])
def test_hostile_values_are_shown_short(value):
    for key in ("hidden_size", "attention_bias", "rope_theta", "scoring_func"):
        e = _refused(_with("glm-5", **{key: value}))
        assert key in e.message and len(e.message) < 200, e.message


# ---- the fuzzer: every field of every real and tiny config, mutated -------------------------------------
HOSTILE = [0, -1, 1, 2, 3, 4, 7, 8, 64, True, False, None, 10**9, 10**30, -10**30, 2**63, 1.5, 0.0, -0.0, -2.5, 0.5,
           1e308, 1e-320, float("nan"), float("inf"), -float("inf"), "", "8", "true", "x" * 60 + "\n", [], [1],
           ["dense"], ["full", "shared"], {}, {"rope_theta": float("nan")}, {"factor": 0}]
VALUES = st.one_of(st.sampled_from(HOSTILE), st.integers(-2**70, 2**70), st.integers(-3, 300),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                   st.integers(-4, 4).map(lambda d: ("near", d)))
ROPE_KEYS = ("rope_theta", "factor", "partial_rotary_factor", "rope_type", "original_max_position_embeddings",
             "mscale_all_dim", "beta_fast")


def _mutate(cfg: dict, key: str, value) -> None:
    target = _text(cfg)
    if key.startswith("rope."):  # a field of the RoPE parameters object (made when the config has none)
        rp = next((target[k] for k in ("rope_parameters", "rope_scaling") if isinstance(target.get(k), dict)), None)
        if rp is None:
            rp = target["rope_parameters"] = {}
        target, key = rp, key.removeprefix("rope.")
    old = target.get(key)
    if isinstance(value, tuple):  # ("near", d): the real value moved by d (exercises the relations)
        value = old + value[1] if isinstance(old, int) and not isinstance(old, bool) else value[1]
    target[key] = value


@st.composite
def _mutated(draw):
    base = draw(st.sampled_from(sorted(BASES)))
    cfg = copy.deepcopy(BASES[base])
    keys = sorted(k for k in _text(cfg) if k != "model_type") + [f"rope.{k}" for k in ROPE_KEYS] + [
        "head_dim", "clip_qkv", "n_group", "topk_group", "first_k_dense_replace", "num_key_value_heads"]
    for _ in range(draw(st.integers(1, 4))):
        _mutate(cfg, draw(st.sampled_from(keys)), draw(VALUES))
    return cfg


@settings(derandomize=True, max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(_mutated())
def test_fuzzed_configs_parse_consistently_or_fail_by_name(cfg):
    """parse_config either accepts (and what it returns holds together) or raises a quantkit error in one
    short line: never KeyError, TypeError, ZeroDivisionError, OverflowError, ValueError."""
    try:
        spec = arch.parse_config(cfg)
    except QuantkitError as e:
        assert isinstance(e, ConfigError), repr(e)
        assert "\n" not in e.message and len(e.message) < 300, e.message
        return
    _consistent(spec)


# ---- the command line: one line, exit 1, in seconds ---------------------------------------------------
def _copy_with(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))  # NaN / Infinity as Python's json writes them
    return dst


@pytest.mark.parametrize("arch_, changes, words", [
    ("qwen3_moe", dict(num_experts_per_tok=5), "num_experts_per_tok"),
    ("deepseek_v3", dict(hidden_size=True), "hidden_size"),
    ("deepseek_v3", dict(n_group=3), "n_group"),
])
def test_commands_stop_in_one_line(cli, tiny_models, tmp_path, arch_, changes, words):  # noqa: F811
    d = _copy_with(tiny_models(arch_), tmp_path / "src", **changes)
    for args, out in [(("plan", d), tmp_path / "none"),
                      (("convert", d, tmp_path / "out", "--recipe", "int4-experts-rtn", "--json"), tmp_path / "out")]:
        t0 = time.perf_counter()
        r = cli.run(*args)
        assert time.perf_counter() - t0 < 10.0
        line = assert_clean_failure(r, out)
        assert words in line and "internal error" not in line, line


@pytest.mark.parametrize("changes, words", [
    (dict(n_routed_experts=10**30), "n_routed_experts"),
    (dict(rope_theta=float("nan")), "rope_theta"),
    (dict(rms_norm_eps=float("-inf")), "rms_norm_eps"),
    (dict(num_experts_per_tok=385), "num_experts_per_tok"),
])
def test_plan_of_a_config_file_stops_in_one_line(cli, tmp_path, changes, words):  # noqa: F811
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**_reference("kimi-k2"), **changes}))
    if any(isinstance(v, float) for v in changes.values()):
        assert "NaN" in f.read_text() or "Infinity" in f.read_text()  # the literals Python's json reads back
    t0 = time.perf_counter()
    r = cli.run("plan", f, "--recipe", "int4-experts-rtn")
    assert time.perf_counter() - t0 < 10.0
    line = assert_clean_failure(r, tmp_path / "none")
    assert words in line, line
