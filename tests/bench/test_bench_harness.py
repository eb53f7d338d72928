"""bench/ as one tool: every committed result passes the one schema (and the validator can fail), bench/README.md's
generated tables are what `python -m bench readme` writes now, no bench module edits sys.path, and
`python -m bench --list` names every module. (No __init__.py here: the test package would be named `bench` and
shadow the bench package it tests.)"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("bench") is None:  # pytest run without the repository root on the path
    sys.path.insert(0, str(ROOT))

from bench import harness, readme  # noqa: E402

RESULTS = sorted((ROOT / "bench" / "results").glob("*.json"))


@functools.lru_cache(maxsize=1)
def _record() -> dict:
    run = harness.Run("example", {"size": 1, "smoke": False}, argv=["--size", "1"])
    return run.record([{"case": "a", "wall_s": 1.5}], {"note": "x"})


def good_record() -> dict:
    return copy.deepcopy(_record())


def test_results_are_committed():
    assert RESULTS, "bench/results/ holds no result"


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_committed_result_passes_the_schema(path):
    doc = json.loads(path.read_text())
    harness.validate(doc)
    assert path.stem == doc["bench"] + (f"-{doc['tag']}" if doc.get("tag") else "")
    assert not doc.get("smoke"), "a smoke run's figures are not results"
    assert path.stat().st_size < 200_000, "results are small files"


def test_a_good_record_passes():
    doc = good_record()
    harness.validate(json.loads(json.dumps(doc)))
    assert doc["command"] == ["python", "-m", "bench", "example", "--size", "1"]
    assert len(doc["commit"]) == 40 and doc["machine"]["cpu_count"] >= 1


@pytest.mark.parametrize("breakage", [
    lambda d: d.pop("commit"),
    lambda d: d.update(schema=2),
    lambda d: d.update(rows=[]),
    lambda d: d.update(rows=[1, 2]),
    lambda d: d.update(commit="abc"),
    lambda d: d.update(date="yesterday"),
    lambda d: d["machine"].pop("cpu_model"),
    lambda d: d.update(command="python -m bench x"),
    lambda d: d.update(extra=1),
    lambda d: d["rows"][0].update(wall_s=float("nan")),
    lambda d: d.update(loadavg={"start": [1.0]}),
], ids=["no-commit", "schema-2", "no-rows", "rows-not-objects", "short-commit", "bad-date", "machine-incomplete",
        "command-string", "unknown-key", "nan", "loadavg-half"])
def test_the_validator_rejects_a_broken_record(breakage):
    doc = copy.deepcopy(good_record())
    breakage(doc)
    with pytest.raises(ValueError):
        harness.validate(doc)


def test_readme_generated_sections_are_current():
    text = (ROOT / "bench" / "README.md").read_text()
    names = readme.names(text)
    assert names, "bench/README.md has no generated section"
    assert sorted(set(names)) == sorted(p.stem for p in RESULTS), "every committed result has a section, and only they"
    assert readme.render(text) == text, "stale: run `python -m bench readme`"


def test_the_readme_check_fails_on_an_edited_figure(tmp_path):
    text = (ROOT / "bench" / "README.md").read_text()
    first = readme.names(text)[0]
    start = text.index(f"<!-- bench:{first}")
    edited = text[:start] + text[start:].replace("| ", "| 9", 1)
    assert readme.render(edited) != edited


def test_no_bench_module_edits_sys_path():
    # the bench's own files (bench/.cache holds venvs and fixtures the benches install: not the bench's code)
    own = [p for p in (ROOT / "bench").rglob("*.py") if ".cache" not in p.relative_to(ROOT / "bench").parts]
    assert any(p.name == "harness.py" for p in own)
    offenders = [p.name for p in own if "sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text()]
    assert not offenders


def test_the_list_names_every_bench_module():
    out = subprocess.run([sys.executable, "-m", "bench", "--list"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    listed = {line.split()[0] for line in out.splitlines() if line.strip()}
    modules = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"__init__", "__main__", "harness", "readme"}
    assert modules == listed
    readme_text = (ROOT / "bench" / "README.md").read_text()
    assert not [m for m in modules if f"`{m}`" not in readme_text], "bench/README.md describes every module"


def test_fixture_keys_survive_new_training_fields():
    # the cache key covers every training setting; a field added later must not move the keys of the fixtures
    # trained before it (their cached models and every committed result name them), and setting it must
    from dataclasses import replace

    from bench.fixture import MASSIVE, NORMTOPK, FixtureSpec

    assert FixtureSpec().key == "53201bd9cef5" and NORMTOPK.key == "401ded54c7e5"
    assert MASSIVE.key not in (FixtureSpec().key, NORMTOPK.key)
    assert replace(NORMTOPK, offset_channels=4).key not in (NORMTOPK.key, MASSIVE.key)
