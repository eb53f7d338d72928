"""quantkit/timeline.py: exclusive, nested phases in wall and CPU seconds; a no-op when not recording; and what
a real convert records (its --json `timeline`, never in the manifest)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from harness import run_bounded
from quantkit import timeline


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_nested_phases_are_exclusive_and_add_up():
    tl = timeline.start()
    try:
        with timeline.phase("outer"):
            time.sleep(0.05)
            with timeline.phase("inner"):
                _busy(0.1)
            time.sleep(0.05)
        with timeline.phase("inner"):
            time.sleep(0.02)
        doc = tl.to_json()
    finally:
        timeline.stop()
    ph, cpu = doc["phases"], doc["phases_cpu"]
    assert 0.09 <= ph["outer"] < 0.2, ph  # the two sleeps, not the nested busy loop
    # busy loop + the second, separate entry; no upper bound: 0.1 s of CPU takes longer on a loaded machine
    assert ph["inner"] >= 0.11 and ph["inner"] >= cpu["inner"], ph
    assert cpu["inner"] >= 0.09 and cpu["outer"] < 0.05, cpu  # sleeping costs no CPU, the loop does
    assert abs(sum(ph.values()) + doc["untracked_s"] - doc["wall_s"]) < 0.01
    assert list(ph) == sorted(ph, key=lambda k: -ph[k])  # largest first


def test_waits_are_split_by_the_step_they_followed():
    """`after=`: a phase's seconds also counted under what it followed ("wait_after"), exclusive of phases
    nested in it, adding up to the phase's total; absent when nothing used it."""
    tl = timeline.start()
    try:
        with timeline.phase("wait", after="solve"):
            time.sleep(0.06)
            with timeline.phase("exchange"):  # nested: the exchange's, not the wait's
                time.sleep(0.05)
        with timeline.phase("wait", after="statistics"):
            time.sleep(0.02)
        with timeline.phase("wait", after="solve"):
            time.sleep(0.02)
        doc = tl.to_json()
    finally:
        timeline.stop()
    after = doc["wait_after"]
    assert list(after) == ["solve", "statistics"], after  # largest first
    assert 0.075 <= after["solve"] < 0.13 and 0.015 <= after["statistics"] < 0.06, after
    assert abs(sum(after.values()) - doc["phases"]["wait"]) < 1e-3, (after, doc["phases"])
    assert doc["phases"]["exchange"] >= 0.045
    tl = timeline.start()
    try:
        with timeline.phase("wait"):
            pass
        assert "wait_after" not in tl.to_json()
    finally:
        timeline.stop()


def test_per_layer_view_and_no_op_without_a_timeline():
    assert timeline.current() is None
    with timeline.phase("x"):  # nothing records, nothing fails
        pass
    timeline.set_layer(3)
    tl = timeline.start()
    try:
        timeline.set_layer(2)
        with timeline.phase("solve"):
            _busy(0.01)
        timeline.set_layer(None)
        with timeline.phase("write"):
            pass
        doc = tl.to_json()
    finally:
        timeline.stop()
    assert [row["layer"] for row in doc["layers"]] == [2]
    assert set(doc["layers"][0]["phases"]) == {"solve"}
    assert timeline.stop() is None


def test_a_calibrated_convert_reports_its_phases_outside_the_manifest(tmp_path):
    from quantkit.testing import make_tiny_model

    src = make_tiny_model("qwen3_moe", tmp_path / "src", layers=2)
    out = tmp_path / "q"
    p = run_bounded([sys.executable, "-m", "quantkit", "convert", str(src), str(out), "-r", "int4-experts-gptq",
                     "--num-samples", "4", "--seq-len", "32", "--json"], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout[p.stdout.find("{"):])
    (rank,) = res["timeline"]["ranks"]
    assert rank["rank"] == 0
    for name in ("setup", "load", "statistics", "grams", "solve", "forward", "write", "stream"):
        assert rank["phases"][name] > 0, (name, rank["phases"])
    assert [row["layer"] for row in rank["layers"]] == [0, 1]
    assert all("grams" in row["phases"] for row in rank["layers"])  # the Hessians of each layer, apart
    assert abs(sum(rank["phases"].values()) + rank["untracked_s"] - rank["wall_s"]) < 0.05 * rank["wall_s"]
    assert rank["wall_s"] <= res["seconds"] + 0.5
    assert "timeline" not in (out / "quantkit_manifest.json").read_text()
