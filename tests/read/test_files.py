"""read/files.py: every file a user hands in is read one way. FIFOs, devices, directories, huge files, deep
nesting, huge integers and lone surrogates end in the caller's named error within a second, through every
reader that takes a path (config.json, manifests, recipes, datasets, timelines, tokenizer.json), and a
hypothesis fuzzer holds the JSON reader to "a value or the named error, never anything else"."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from quantkit import errors as E
from quantkit.read.checkpoint import read_json_file
from quantkit.read.files import MAX_DEPTH, MAX_INT_DIGITS, parse_json, read_bytes


def _fifo(tmp_path: Path, name: str = "f.json") -> Path:
    p = tmp_path / name
    os.mkfifo(p)
    return p


def _fast(fn, error, match: str):
    """`fn()` raises `error` with `match` in a one-line message, within a second (a FIFO never blocks it)."""
    box: dict = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (reported below)
            box["e"] = e
    t = threading.Thread(target=run, daemon=True)
    t0 = time.perf_counter()
    t.start()
    t.join(5)
    assert not t.is_alive(), "the reader blocked"
    assert time.perf_counter() - t0 < 1.5
    e = box.get("e")
    assert isinstance(e, error), repr(e)
    assert match in e.message and "\n" not in e.message, e.message
    return e.message


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory", "symlink_to_fifo", "symlink_to_dev_zero"])
def test_special_files_are_refused_by_kind(tmp_path, kind):
    target = {"fifo": lambda: _fifo(tmp_path), "dev_zero": lambda: Path("/dev/zero"),
              "directory": lambda: tmp_path,
              "symlink_to_fifo": lambda: _fifo(tmp_path, "real"),
              "symlink_to_dev_zero": lambda: Path("/dev/zero")}[kind]()
    if kind.startswith("symlink"):
        (tmp_path / "link.json").symlink_to(target)
        target = tmp_path / "link.json"
    want = {"fifo": "a FIFO", "dev_zero": "a character device", "directory": "a directory",
            "symlink_to_fifo": "a FIFO", "symlink_to_dev_zero": "a character device"}[kind]
    _fast(lambda: read_json_file(target, "config.json"), E.ConfigError, want)


def test_a_file_over_the_limit_is_never_read(tmp_path):
    p = tmp_path / "big.json"
    with open(p, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB on paper
    _fast(lambda: read_json_file(p, "config.json", limit=1 << 20), E.ConfigError, "over the 1048576-byte limit")


@pytest.mark.parametrize("text,match", [
    ('{"a": ' + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "}", "nested deeper"),
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "not valid JSON"),  # Python's own recursion limit
    ('{"a": ' + "9" * (MAX_INT_DIGITS + 1) + "}", f"at most {MAX_INT_DIGITS}"),
    ('{"a": -' + "9" * 5000 + "}", "not valid JSON"),
    ('{"a": "\\ud800"}', "lone UTF-16 surrogate"),
    ('{"a": 1', "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
])
def test_hostile_json_is_one_named_line(tmp_path, text, match):
    p = tmp_path / "x.json"
    p.write_text(text)
    _fast(lambda: read_json_file(p, "config.json"), E.ConfigError, match)


def test_real_json_still_reads(tmp_path):
    doc = {"a": [1, 2.5, None, True, "x" * 1000, {"b": -(2 ** 63), "c": 2 ** 64 - 1}], "é": "\u00e9\U0001F600"}
    p = tmp_path / "ok.json"
    p.write_text("\ufeff" + json.dumps(doc))  # a byte-order mark is dropped, as Python's utf-8-sig reads it
    assert read_bytes(p, "x", E.ConfigError, 1 << 20).startswith(b"\xef\xbb\xbf")
    p.write_text(json.dumps(doc))
    assert read_json_file(p, "x") == doc


def _tree(depth: int):
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-(10 ** 30), 10 ** 30), st.floats(allow_nan=False),
                       st.text(max_size=8))
    return st.recursive(leaves, lambda c: st.one_of(st.lists(c, max_size=4),
                                                    st.dictionaries(st.text(max_size=4), c, max_size=4)),
                        max_leaves=20)


@seed(20261207)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_tree(6), cut=st.integers(0, 400), junk=st.binary(max_size=6))
def test_fuzz_json_reader_returns_the_document_or_the_named_error(doc, cut, junk):
    """Valid JSON reads back equal; any mangling of it (cut short, bytes spliced in) is the named error or a
    valid document, never another exception."""
    text = json.dumps(doc)
    assert parse_json(text, "x", E.ConfigError) == doc
    mangled = text[:cut] + junk.decode("latin-1") + text[cut:]
    try:
        parse_json(mangled, "x", E.ConfigError)
    except E.ConfigError as e:
        assert "\n" not in e.message


def test_readers_that_take_a_path_refuse_a_fifo(tmp_path):
    """Each reader of a user's path: a FIFO under the name it expects is refused in one line, not waited on."""
    from quantkit.calib.data import load_calibration_data
    from quantkit.match.recipe import load_recipe
    from quantkit.report.timeline import read_timeline

    _fast(lambda: load_recipe(_fifo(tmp_path, "r.yaml")), E.RecipeError, "a FIFO")
    _fast(lambda: load_calibration_data(_fifo(tmp_path, "d.jsonl"), vocab_size=64, num_samples=1, seq_len=4),
          E.DatasetError, "a FIFO")
    _fast(lambda: read_timeline(_fifo(tmp_path, "t.json")), E.ConfigError, "a FIFO")


@pytest.mark.parametrize("row,match", [
    ('{"input_ids": [1, ' + "9" * 30 + "]}", "outside [0, 64)"),
    ('{"input_ids": [1, 64]}', "token id 64, outside"),
    ('{"input_ids": [-1]}', "token id -1"),
    ('{"text": "\\udc00 lone"}', "lone UTF-16 surrogate"),
    ('{"text": ' + "[" * 80 + "]" * 80 + "}", "nested deeper"),
    ('{"input_ids": [1, ' + "9" * 60 + "]}", f"at most {MAX_INT_DIGITS}"),
])
def test_hostile_calibration_rows(tmp_path, row, match):
    from quantkit.calib.data import load_calibration_data

    p = tmp_path / "d.jsonl"
    p.write_text(row + "\n")
    _fast(lambda: load_calibration_data(p, vocab_size=64, num_samples=1, seq_len=4), E.DatasetError, match)


@pytest.mark.parametrize("value,ok", [("", True), ("120", True), ("0.5", True), ("inf", False), ("nan", False),
                                      ("-1", False), ("0", False), ("1e300", False), ("ten", False)])
def test_dist_timeout_from_the_environment_is_finite_and_bounded(monkeypatch, value, ok):
    from quantkit.dist import dist_timeout_s

    monkeypatch.setenv("QUANTKIT_DIST_TIMEOUT", value)
    if ok:
        assert 0 < dist_timeout_s() < float("inf")
    else:
        with pytest.raises(E.DistributedError, match="QUANTKIT_DIST_TIMEOUT"):
            dist_timeout_s()


def test_a_file_that_is_not_parquet_is_a_dataset_error(tmp_path):
    pytest.importorskip("pyarrow", reason="reading .parquet datasets needs pyarrow")
    from quantkit.calib.data import load_calibration_data

    p = tmp_path / "x.parquet"
    p.write_text("not parquet")
    _fast(lambda: load_calibration_data(p, vocab_size=64, num_samples=1, seq_len=4), E.DatasetError,
          "not a readable parquet file")
    _fast(lambda: load_calibration_data(_fifo(tmp_path, "f.parquet"), vocab_size=64, num_samples=1, seq_len=4),
          E.DatasetError, "a FIFO")


def test_special_files_in_a_checkpoint_are_named_by_kind(tmp_path):
    """A config.json, index or --kv-scales file that is a FIFO is refused for what it is, not as missing."""
    from quantkit.read.kv_scales import read_kv_scales as read_file
    from quantkit.plan.source import resolve
    from quantkit.read.checkpoint import Checkpoint

    ck = tmp_path / "ck"
    ck.mkdir()
    _fifo(ck, "config.json")
    _fast(lambda: Checkpoint.open(ck), E.ConfigError, "a FIFO")
    _fast(lambda: resolve(ck), E.ConfigError, "a FIFO")
    _fast(lambda: read_file(_fifo(tmp_path, "kv.safetensors")), E.HeaderError, "not a regular file")
