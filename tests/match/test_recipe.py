"""Recipe schema validation and target matching on every supported architecture."""

import re

import pytest

from quantkit.errors import GroupSizeError, RecipeError
from quantkit.read.checkpoint import Checkpoint
from quantkit.match.recipe import Scheme, load_recipe, matches, parse_recipe, shipped_recipes


def test_matching_rules_follow_compressed_tensors():
    assert matches("lm_head", "lm_head") and not matches("lm_head", "model.lm_head")
    assert matches("re:.*mlp", "model.layers.0.mlp.gate")  # re.match: anchored at the start only
    assert not matches("re:mlp", "model.layers.0.mlp")


def _modules(ck):
    return sorted(n[: -len(".weight")] for n in ck.location if n.endswith(".weight") and len(ck.info(n).shape) == 2)


def test_int4_experts_rtn_targets_exactly_the_routed_experts(arch, tiny_models):
    """On every supported architecture the shipped recipe selects each routed expert Linear and nothing
    else: never the router, shared experts, attention, dense MLPs, embeddings or lm_head."""
    r = load_recipe("int4-experts-rtn")
    ck = Checkpoint.open(tiny_models(arch))
    selected = {m for m in _modules(ck) if r.match(m)}
    # independent structural definition: a module under `experts.<int>.` that is a projection
    routed = {m for m in _modules(ck) if re.search(r"\.experts\.\d+\.[a-z0-9_]+$", m) and "shared" not in m}
    assert selected == routed and len(routed) > 0
    for m in _modules(ck):
        if m.endswith((".gate", "lm_head", "embed_tokens")) or "shared_expert" in m or "self_attn" in m:
            assert not r.match(m), m
    # every routed expert of every MoE layer, for all three projections
    num_experts = ck.config.get("n_routed_experts") or ck.config.get("num_experts") or ck.config.get("num_local_experts")
    assert len(routed) % (3 * num_experts) == 0


def test_shipped_recipes_load():
    names = shipped_recipes()
    assert "int4-experts-rtn" in names
    for n in names:
        r = load_recipe(n)
        assert r.name == n and r.text


def test_default_int4_scheme():
    g = load_recipe("int4-experts-rtn").groups[0]
    assert (g.scheme.num_bits, g.scheme.group_size, g.scheme.symmetric, g.method) == (4, 32, True, "rtn")


@pytest.mark.parametrize("text, msg", [
    ("groups: {e: {targets: [x], scheme: {group_size: 30}}}", "multiple of 8"),
    ("groups: {e: {targets: [x], scheme: {num_bits: 3}}}", "num_bits"),
    ("groups: {e: {targets: [x], method: magic}}", "method"),
    ("groups: {e: {targets: ['re:(']}}", "bad regex"),
    ("groups: {e: {scheme: {}}}", "targets"),
    ("groups: {e: {targets: [x], sceme: {}}}", "unknown key"),
    ("groups: {e: {targets: [x], scheme: {type: float, num_bits: 8, strategy: group}}}", "strategy"),
    ("name: x", "nothing"),
    ("[1, 2", "YAML"),
    ("- a\n- b", "mapping"),
    ("groups: {e: {targets: [x]}}\nkv_cache: {strategy: head}", "kv_cache.strategy"),
    ("groups: {e: {targets: [x], scheme: {num_bits: 8, scale_search: mse}}}", "FP4 and INT4"),
    ("groups: {e: {targets: [x], scheme: {type: float, num_bits: 8, strategy: channel, scale_search: mse}}}",
     "FP4 and INT4"),
    ("groups: {e: {targets: [x], scheme: {scale_search: best}}}", "amax or mse"),
])
def test_recipe_errors_are_helpful(text, msg):
    with pytest.raises(RecipeError, match=msg):
        parse_recipe(text)


def test_int4_scale_search_accepted():
    g = parse_recipe("groups: {e: {targets: [x], scheme: {group_size: 32, scale_search: mse}}}").groups[0]
    assert g.scheme.scale_search == "mse"
    g = parse_recipe("groups: {e: {targets: [x], scheme: {symmetric: false, scale_search: mse}}}").groups[0]
    assert g.scheme.scale_search == "mse" and not g.scheme.symmetric


def test_unknown_recipe_name_lists_shipped():
    with pytest.raises(RecipeError) as e:
        load_recipe("no-such-recipe")
    assert "int4-experts-rtn" in e.value.hint


def test_group_size_fallback():
    s = Scheme(group_size=32)
    assert s.for_in_features(64) is s
    with pytest.raises(GroupSizeError):
        s.for_in_features(48)
    assert Scheme(group_size=32, fallback="channel").for_in_features(48).strategy == "channel"
    assert Scheme(group_size=32, fallback=16).for_in_features(48).group_size == 16
    with pytest.raises(GroupSizeError):
        Scheme(group_size=32, fallback=16).for_in_features(44)


def test_ignore_wins_and_first_group_wins():
    r = parse_recipe("groups:\n  a: {targets: ['re:.*proj$'], scheme: {group_size: 64}}\n"
                     "  b: {targets: ['re:.*up_proj$']}\nignore: ['re:.*shared']\n")
    assert r.match("m.up_proj").name == "a"
    assert r.match("m.shared_expert.up_proj") is None


# ---- hostile recipes: every case a named RecipeError, in bounded time (docs/recipes.md, Limits) -------------
import time  # noqa: E402

from quantkit.match.recipe import MAX_MATCH_NAME, MAX_RECIPE_BYTES, check_regex  # noqa: E402


def _refused_fast(fn, msg, seconds=2.0):
    t = time.perf_counter()
    with pytest.raises(RecipeError, match=msg):
        fn()
    assert time.perf_counter() - t < seconds


def test_huge_recipe_file_is_refused_before_parsing(tmp_path):
    p = tmp_path / "big.yaml"
    with open(p, "wb") as f:  # 100 MB, sparse: only the first MAX_RECIPE_BYTES + 1 bytes may be read
        f.truncate(100 << 20)
    _refused_fast(lambda: load_recipe(p), "limit")
    _refused_fast(lambda: parse_recipe("ignore: [" + "x, " * MAX_RECIPE_BYTES + "]"), "limit")


def test_non_utf8_and_deep_yaml_are_named_errors(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"name: caf\xe9\ngroups: {e: {targets: [x]}}\n")
    _refused_fast(lambda: load_recipe(p), "not UTF-8")
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000)
    _refused_fast(lambda: load_recipe(deep), "nested more than")
    _refused_fast(lambda: parse_recipe("groups: {e: {targets: [x], options: " + "{a: " * 1000 + "1" + "}" * 1001 + "}}"),
                  "nested more than")


@pytest.mark.parametrize("rx", [r"(.*)*(.*)*(.*)*(.*)*(.*)*Z$", r"(a|a)*Z", r"(?:\w+\.)*experts", r"(a?){30}a{30}",
                                r".*.*.*.*Z$", r"(a|aa){30}", r"a{0,1000}a{0,1000}b", r"(?=(.*)*)x", "x" * 1001])
def test_explosive_regexes_are_refused_at_load(rx):
    """Each of these takes seconds to hours on a name of 20-400 characters (measured by hand: (.*)*(.*)*Z$ on
    16 chars 0.66 s, .*.*.*.*Z$ on 400 chars 11.8 s); the rule refuses them by their parsed form."""
    for where in ("ignore", "groups: {e: {targets"):
        text = (f"ignore: ['re:{rx}']\ngroups: {{e: {{targets: [x]}}}}" if where == "ignore"
                else f"groups: {{e: {{targets: ['re:{rx}']}}}}")
        _refused_fast(lambda: parse_recipe(text), "bad regex")
    with pytest.raises(RecipeError, match="refused regex"):  # also when matched without a parsed recipe
        matches("re:" + rx, "a")


def test_allowed_regexes_stay_fast_on_the_longest_names():
    """The worst pattern the rule admits (three unbounded repeats) on the longest name it matches."""
    check_regex(r".*layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
    check_regex(r".*.*.*Z$")
    t = time.perf_counter()
    assert not matches("re:.*.*.*Z$", "a" * MAX_MATCH_NAME)
    assert time.perf_counter() - t < 5  # ~0.2 s on one core here
    with pytest.raises(RecipeError, match="longer than"):
        matches("re:.*x", "a" * (MAX_MATCH_NAME + 1))
    assert not matches("lm_head", "a" * 10**6)  # exact names are compared, never matched


def test_shipped_recipes_follow_the_regex_rule():
    for n in shipped_recipes():
        r = load_recipe(n)
        for p in r.ignore + tuple(t for g in r.groups for t in g.targets):
            if p.startswith("re:"):
                check_regex(p[3:])


def test_recipe_that_matches_nothing_is_an_error_unless_allowed(tiny_models, tmp_path):
    from quantkit.convert import ConvertOptions, convert

    src = tiny_models("qwen3_moe")
    r = parse_recipe("groups: {e: {targets: ['re:.*mlp\\.expertz\\.\\d+\\.(gate|up|down)_proj$']}}", "typo")
    with pytest.raises(RecipeError, match="match no module"):
        convert(src, tmp_path / "o", ConvertOptions(recipe=r))
    assert not (tmp_path / "o").exists()  # refused before anything is written
    res = convert(src, tmp_path / "o2", ConvertOptions(recipe=r, allow_unmatched=True))
    assert res.tensors_quantized == 0


@pytest.mark.parametrize("method,scheme", [
    ("gptq", "{num_bits: 4, type: int, strategy: group, group_size: 32, scale_search: mse}"),
    ("awq", "{num_bits: 4, type: int, strategy: group, group_size: 32, scale_search: mse}"),
    ("gptq", "{num_bits: 4, type: float, strategy: tensor_group, group_size: 16, scale_search: mse}"),
    ("gptq", "{num_bits: 4, type: float, strategy: group, group_size: 32, scale_search: mse}"),
])
def test_scale_search_mse_with_a_method_that_ignores_it_is_refused(method, scheme):
    """docs/recipes.md: `scale_search` is RTN's; GPTQ and AWQ choose their own scales, so a recipe asking for
    both would silently not get what it asked for."""
    text = f"name: t\ngroups:\n  g:\n    targets: ['re:.*experts.*']\n    scheme: {scheme}\n    method: {method}\n"
    with pytest.raises(RecipeError, match=f"scale_search: mse is RTN's scale search; method {method}"):
        parse_recipe(text)
    rtn = parse_recipe(text.replace(f"method: {method}", "method: rtn"))  # the same scheme under RTN is fine
    assert rtn.groups[0].scheme.scale_search == "mse"
    amax = parse_recipe(text.replace("scale_search: mse", "scale_search: amax"))  # amax is what they do anyway
    assert amax.groups[0].method == method


def test_a_key_given_twice_is_refused():
    """PyYAML keeps the last of two equal keys: `method: rtn` then `method: gptq` ran GPTQ unannounced."""
    text = ("name: t\ngroups:\n  g:\n    targets: ['re:.*experts.*']\n    scheme: {num_bits: 4, type: int, "
            "strategy: group, group_size: 32}\n    method: rtn\n    method: gptq\n")
    with pytest.raises(RecipeError, match=r"gives the key 'method' twice in one mapping \(line 7\)"):
        parse_recipe(text)
    assert parse_recipe(text.replace("    method: rtn\n", "")).groups[0].method == "gptq"


def test_a_calibration_section_that_nothing_uses_is_refused():
    base = "name: t\ngroups:\n  g:\n    targets: ['re:.*experts.*']\n    scheme: {group_size: 32}\n"
    with pytest.raises(RecipeError, match="calibration section but calibrates nothing"):
        parse_recipe(base + "calibration: {num_samples: 8}\n")
    assert parse_recipe(base + "kv_cache: {strategy: tensor}\ncalibration: {num_samples: 8}\n").calibration
    assert parse_recipe(base.replace("{group_size: 32}", "{group_size: 32}\n    method: gptq")
                        + "calibration: {num_samples: 8}\n").calibration
