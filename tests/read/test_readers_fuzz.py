"""Seeded fuzzers for the readers of what users hand in besides checkpoints: calibration rows, recipes and
timelines. Each holds its reader to "a value that is consistent, or the reader's named error in one line"; any
other exception (TypeError, KeyError, OverflowError, a torch error) fails."""

from __future__ import annotations

import json
import math
import warnings

import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from quantkit import errors as E

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(10 ** 30), 10 ** 30),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
_values = st.recursive(_scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                     st.dictionaries(st.text(max_size=6), c, max_size=3)),
                       max_leaves=12)
_ids = st.lists(st.one_of(st.integers(-5, 80), st.integers(-(10 ** 25), 10 ** 25), st.booleans(), st.floats(),
                          st.text(max_size=3)), max_size=12)
_row = st.one_of(
    st.fixed_dictionaries({"text": st.one_of(st.text(max_size=40), _values)}),
    st.fixed_dictionaries({"input_ids": st.one_of(_ids, _values)}),
    st.fixed_dictionaries({"messages": st.one_of(
        st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant"]), _scalars),
                                        "content": st.one_of(st.text(max_size=20), _scalars)}), max_size=3),
        _values)}),
    _values,
)


def _one_line(e: E.QuantkitError) -> None:
    assert e.message and "\n" not in e.message and len(e.message) < 1000, e.message


@seed(607)
@settings(max_examples=250, **SETTINGS)
@given(rows=st.lists(_row, min_size=1, max_size=4), n=st.integers(1, 3), seq_len=st.integers(1, 8),
       raw=st.booleans())
def test_fuzz_calibration_rows(tmp_path_factory, rows, n, seq_len, raw):
    """Rows of any shape, as JSONL (written by json.dumps, NaN included, or as raw lines): samples of in-vocabulary
    ids no longer than seq_len, or a DatasetError."""
    from quantkit.calib.data import load_calibration_data

    p = tmp_path_factory.mktemp("rows") / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) if not raw else str(r) for r in rows) + "\n", encoding="utf-8",
                 errors="surrogatepass")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            data = load_calibration_data(p, vocab_size=64, num_samples=n, seq_len=seq_len)
        except E.DatasetError as e:
            _one_line(e)
            return
    assert data.samples and all(0 < s.numel() <= seq_len for s in data.samples)
    assert all(int(s.min()) >= 0 and int(s.max()) < 64 for s in data.samples)


_recipe_group = st.fixed_dictionaries({
    "targets": st.one_of(st.just(["re:.*experts.*"]), _values),
    "scheme": st.one_of(st.fixed_dictionaries({
        "num_bits": st.one_of(st.sampled_from([4, 8]), _scalars),
        "type": st.one_of(st.sampled_from(["int", "float"]), _scalars),
        "strategy": st.one_of(st.sampled_from(["group", "channel", "tensor", "tensor_group", "block"]), _scalars),
        "group_size": st.one_of(st.sampled_from([16, 32, 128]), _scalars),
        "symmetric": st.one_of(st.booleans(), _scalars),
        "scale_search": st.one_of(st.sampled_from(["amax", "mse"]), _scalars)}), _values),
    "method": st.one_of(st.sampled_from(["rtn", "gptq", "awq"]), _scalars),
    "options": st.one_of(st.none(), st.dictionaries(st.sampled_from(
        ["damp", "block_size", "actorder", "min_tokens", "holdout", "observer", "n_grid", "balance_tokens",
         "fit_down", "refine_sweeps", "stats", "fallback"]), _scalars, max_size=3)),
})


@seed(608)
@settings(max_examples=300, **SETTINGS)
@given(groups=st.dictionaries(st.text(min_size=1, max_size=6), _recipe_group, min_size=0, max_size=2),
       kv=st.one_of(st.none(), st.fixed_dictionaries({"strategy": _scalars})), extra=_values)
def test_fuzz_recipes(groups, kv, extra):
    """Recipe documents of any values: a Recipe whose groups hold typed schemes and methods, or a RecipeError."""
    from quantkit.match.recipe import METHODS, parse_recipe

    doc = {"name": "fuzz", "groups": groups}
    if kv is not None:
        doc["kv_cache"] = kv
    if isinstance(extra, dict) and extra:
        doc["description"] = extra
    try:
        r = parse_recipe(yaml.safe_dump(doc, allow_unicode=True))
    except E.RecipeError as e:
        _one_line(e)
        return
    for g in r.groups:
        assert g.method in METHODS and g.scheme.num_bits in (4, 8) and g.targets
        assert not (g.scheme.scale_search == "mse" and g.method != "rtn")


_seconds = st.one_of(st.floats(0, 1e6), st.integers(0, 10 ** 6), _scalars)


@seed(609)
@settings(max_examples=300, **SETTINGS)
@given(ranks=st.one_of(st.lists(st.fixed_dictionaries(
    {"rank": st.one_of(st.integers(0, 4), _scalars),
     "phases": st.one_of(st.dictionaries(st.text(max_size=8), _seconds, max_size=4), _values)},
    optional={"wall_s": _seconds, "cpu_s": _seconds, "untracked_s": _seconds,
              "phases_cpu": st.dictionaries(st.text(max_size=8), _seconds, max_size=3),
              "wait_after": st.dictionaries(st.text(max_size=8), _seconds, max_size=3)}), max_size=3), _values),
       wrap=st.booleans())
def test_fuzz_timelines(tmp_path_factory, ranks, wrap):
    """Timeline documents (the `convert --json` object or its `timeline`): ranks of finite, non-negative seconds,
    or a ConfigError; through a file too (NaN and Infinity literals as Python's json writes them)."""
    from quantkit.report.timeline import read_timeline

    doc = {"timeline": {"ranks": ranks}} if wrap else {"ranks": ranks}
    p = tmp_path_factory.mktemp("tl") / "t.json"
    p.write_text(json.dumps(doc), encoding="utf-8", errors="surrogatepass")
    for source in (doc, p):
        try:
            out = read_timeline(source)
        except E.ConfigError as e:
            _one_line(e)
            continue
        for r in out:
            nums = [r["wall_s"], r["untracked_s"], *r["phases"].values(), *r["phases_cpu"].values(),
                    *r["wait_after"].values()] + ([r["cpu_s"]] if r["cpu_s"] is not None else [])
            assert all(isinstance(x, float) and math.isfinite(x) and x >= 0 for x in nums), r
