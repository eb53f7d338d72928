"""`quantkit report OUT --timeline FILE`: the per-rank, per-phase section drawn from what `convert --json` printed
(a real calibrated convert here), and the timeline file treated as hostile input (bounded, checked, one-line
errors, capped drawing)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import time

import pytest

pytest.importorskip("matplotlib")

from harness import run_bounded  # noqa: E402
from quantkit.errors import ConfigError  # noqa: E402
from quantkit.report import build_report  # noqa: E402
from quantkit.report.timeline import MAX_RANKS, MAX_TIMELINE_BYTES  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from quantkit.testing import make_tiny_model

    d = tmp_path_factory.mktemp("tl-report")
    src = make_tiny_model("qwen3_moe", d / "src", layers=2)
    p = run_bounded([sys.executable, "-m", "quantkit", "convert", str(src), str(d / "q"), "-r", "int4-experts-gptq",
                     "--num-samples", "4", "--seq-len", "32", "--json"], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    (d / "convert.json").write_text(p.stdout)
    return d


def test_the_section_shows_every_phase_of_a_real_convert(converted):
    res = build_report(converted / "q", output=converted / "r.html", timeline=converted / "convert.json")
    page = (converted / "r.html").read_text()
    assert "fig-timeline" in res.figures and "Where the time went" in page
    rank = json.loads((converted / "convert.json").read_text())["timeline"]["ranks"][0]
    for phase, seconds in rank["phases"].items():  # every recorded phase has its row, with its wall time
        assert f'<td class="mono">{phase}</td><td class="num">{seconds:.2f} / ' in page
    assert f"<b>{rank['wall_s']:.2f}</b>" in page
    # the bare timeline object is accepted too, and without --timeline there is no such section
    build_report(converted / "q", output=converted / "r2.html", timeline={"ranks": [rank]})
    assert "Where the time went" in (converted / "r2.html").read_text()
    assert "fig-timeline" not in build_report(converted / "q", output=converted / "r3.html").figures
    # a distributed rank's waits by the step they followed (timeline "wait_after"), largest first
    ranks = [{**rank, "rank": 0, "wait_after": {"statistics": 0.25, "solve": 1.5}}, {**rank, "rank": 1}]
    build_report(converted / "q", output=converted / "r4.html", timeline={"ranks": ranks})
    page = (converted / "r4.html").read_text()
    assert ('<li>rank 0: after <span class="mono">solve</span> 1.50 s, after <span class="mono">statistics</span> '
            '0.25 s</li>') in page and "<li>rank 1:" not in page


@pytest.mark.parametrize("doc,msg", [
    ({"seconds": 1}, "no `timeline.ranks`"),
    ({"ranks": []}, "no `timeline.ranks`"),
    ({"ranks": [5]}, "rank entry 0 is not an object"),
    ({"ranks": [{"phases": {"solve": "fast"}}]}, "not a number of seconds"),
    ({"ranks": [{"phases": {"solve": -1.0}}]}, "not a number of seconds"),
    ({"ranks": [{"phases": {"solve": 1e300}}]}, "not a number of seconds"),
    ({"ranks": [{"phases": {"solve": True}}]}, "not a number of seconds"),
    ({"ranks": [{"phases": {}, "cpu_s": float("nan")}]}, "cpu_s is not a number"),
    ({"ranks": [{"phases": {}, "wait_after": {"solve": "long"}}]}, "wait after 'solve' is not a number"),
    ({"ranks": [{"phases": {}, "wait_after": {"solve": float("inf")}}]}, "wait after 'solve' is not a number"),
    # a rank is an integer in [0, 2**31): a wrong one is refused, not renumbered (each was drawn, exit 0)
    ({"ranks": [{"phases": {}, "rank": "x"}]}, "rank entry 0: `rank` is not an integer in [0, 2**31) ('x')"),
    ({"ranks": [{"phases": {}, "rank": 10 ** 30}]}, "`rank` is not an integer in [0, 2**31) (a 100-bit integer)"),
    ({"ranks": [{"phases": {}, "rank": 10 ** 1000}]}, "`rank` is not an integer in [0, 2**31) (a 3322-bit integer)"),
    ({"ranks": [{"phases": {}, "rank": 1 << 31}]}, "`rank` is not an integer in [0, 2**31)"),
    ({"ranks": [{"phases": {}, "rank": -1}]}, "`rank` is not an integer in [0, 2**31) (-1)"),
    ({"ranks": [{"phases": {}, "rank": True}]}, "`rank` is not an integer in [0, 2**31) (true)"),
    ({"ranks": [{"phases": {}, "rank": None}]}, "`rank` is not an integer in [0, 2**31) (null)"),
    # every list and object of a rank typed
    ({"ranks": [{"phases": {}, "layers": [5, "x", None]}]}, "rank 0 layers[0] is not an object with an integer"),
    ({"ranks": [{"phases": {}, "layers": "x"}]}, "rank 0 `layers` is not a list ('x')"),
    ({"ranks": [{"phases": {}, "layers": [{"layer": "0", "phases": {}}]}]}, "rank 0 layers[0] is not an object"),
    ({"ranks": [{"phases": {}, "layers": [{"layer": 0}]}]}, "rank 0 layers[0] is not an object"),
    ({"ranks": [{"phases": {}, "layers": [{"layer": 0, "phases": {"solve": "x" * 10_000}}]}]},
     "rank 0 layer 0 phase 'solve' is not a number of seconds ('xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'...)"),
    ({"ranks": [{"phases": {}, "layers": [{"layer": 0, "phases": {}}] * 4097}]}, "more than the 4096 convert records"),
    ({"ranks": [{"phases": {}, "phases_cpu": [1]}]}, "rank 0 `phases_cpu` is not an object (a list)"),
    ({"ranks": [{"phases": {}, "wait_after": "long"}]}, "rank 0 `wait_after` is not an object ('long')"),
    ({"ranks": [{"phases": {"solve": 10 ** 5000}}]}, "phase 'solve' is not a number of seconds (a 16610-bit integer)"),
], ids=lambda x: None if isinstance(x, dict) else x[:30])
def test_malformed_timelines_are_one_line_errors(converted, doc, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)) as e:
        build_report(converted / "q", output=converted / "bad.html", timeline=doc)
    assert len(e.value.message) < 200 and "convert --json" in e.value.hint
    assert not (converted / "bad.html").exists()


def test_hostile_sizes_are_bounded(converted, tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # over the cap: refused from its size, before parsing
        f.truncate(MAX_TIMELINE_BYTES + 1)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="over the"):
        build_report(converted / "q", output=tmp_path / "r.html", timeline=big)
    assert time.perf_counter() - t0 < 2
    # 20,000 ranks, 1 MB phase names: drawn capped, names truncated, in bounded time (a 1000-digit rank is refused)
    name = "$x" * 500_000
    after = {name: 0.5, **{f"step{j}": 0.5 for j in range(100_000)}}  # one object, shared by every rank
    ranks = [{"rank": i, "wall_s": 2.0, "phases": {name: 1.0, "solve": 1.0},
              "wait_after": after} for i in range(20_000)]
    t0 = time.perf_counter()
    res = build_report(converted / "q", output=tmp_path / "r.html", timeline={"ranks": ranks})
    assert time.perf_counter() - t0 < 30
    page = (tmp_path / "r.html").read_text()
    assert f"The first {MAX_RANKS} of 20000 ranks are drawn" in page and "fig-timeline" in res.figures
    assert len(page) < 3_000_000 and "$x" * 21 not in page  # the name truncated to 40 characters


def test_cli_option(converted):
    out = io.StringIO()
    from quantkit.cli import main

    with contextlib.redirect_stdout(out):
        main(["report", str(converted / "q"), "--timeline", str(converted / "convert.json"), "--json",
              "-o", str(converted / "cli.html")])  # success returns (failures exit non-zero)
    assert "fig-timeline" in json.loads(out.getvalue())["figures"]
