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
])
def test_recipe_errors_are_helpful(text, msg):
    with pytest.raises(RecipeError, match=msg):
        parse_recipe(text)


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
