"""The report's timeline section: where a convert's time went, per rank and phase (quantkit/timeline.py).

Input: what `quantkit convert --json` printed (its `timeline` key), or the `{"ranks": [...]}` object itself,
given with `quantkit report OUT --timeline FILE`. The file is input like any other: its size is capped before
parsing, its shape checked (each rank an integer in [0, 2**31), each list and object of the type convert
writes), every number required finite and non-negative, and the ranks and phases drawn are capped (MAX_RANKS,
MAX_PHASES; names truncated), so a hostile file can neither crash the report nor make it slow.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from ..errors import ConfigError
from ..timeline import MAX_LAYERS
from ..read.checkpoint import read_json_file
from .model import _shown
from .page import _Page, _e, _new_figure

MAX_TIMELINE_BYTES = 16 << 20
MAX_RANKS = 256  # ranks drawn one bar each; more are summarized by the table's totals only
MAX_TABLE_RANKS = 16  # ranks given a column in the table
MAX_PHASES = 16  # phases drawn; the rest of a rank's time is shown as "other"
MAX_NAME = 40
HINT = "pass the JSON `quantkit convert --json` printed (it holds `timeline`), or its `timeline` object"
# one colour per phase the pass records, in pipeline order; phases not listed use the grey of "other"
COLOURS = {"setup": "#7f7f7f", "load": "#bcbd22", "forward": "#1f77b4", "statistics": "#17becf",
           "grams": "#aec7e8", "solve": "#2ca02c", "exchange": "#ff7f0e", "wait": "#d62728", "write": "#9467bd",
           "stream": "#8c564b", "kv": "#e377c2", "untracked": "#dddddd", "other": "#c7c7c7"}


def _seconds(x, where: str) -> float:
    if (isinstance(x, bool) or not isinstance(x, (int, float)) or (isinstance(x, int) and not 0 <= x <= 10**9)
            or not math.isfinite(x) or x < 0 or x > 1e9):  # an int range first: math.isfinite(10**400) raises
        raise ConfigError(f"timeline: {where} is not a number of seconds ({_shown(x)})", hint=HINT)
    return float(x)


def read_timeline(source: dict | str | Path) -> list[dict]:
    """The ranks of a timeline document, checked: [{"rank", "wall_s", "cpu_s", "phases", "phases_cpu",
    "untracked_s", "wait_after"}] with numbers only ("wait_after" {} where the document has none). Raises
    ConfigError (one line) for anything else."""
    doc = source if isinstance(source, dict) else read_json_file(Path(source), "timeline JSON", ConfigError,
                                                                   limit=MAX_TIMELINE_BYTES, hint=HINT)
    tl = doc.get("timeline", doc) if isinstance(doc, dict) else None
    ranks = tl.get("ranks") if isinstance(tl, dict) else None
    if not isinstance(ranks, list) or not ranks:
        raise ConfigError("timeline JSON has no `timeline.ranks` (or `ranks`) list", hint=HINT)
    out = []
    for i, r in enumerate(ranks):
        if not isinstance(r, dict) or not isinstance(r.get("phases"), dict):
            raise ConfigError(f"timeline: rank entry {i} is not an object with `phases`", hint=HINT)
        rank = r.get("rank", i)  # a bare entry is numbered by its place; a wrong rank is refused, not renumbered
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 1 << 31:
            raise ConfigError(f"timeline: rank entry {i}: `rank` is not an integer in [0, 2**31) "
                              f"({_shown(rank)})", hint=HINT)
        phases = _phases(r["phases"], f"rank {rank} phase")
        cpu = _phases(_object(r, "phases_cpu", rank), f"rank {rank} CPU of")
        after = _object(r, "wait_after", rank)  # the section lists the first MAX_PHASES; only they are read
        after = _phases(dict(itertools.islice(after.items(), MAX_PHASES)), f"rank {rank} wait after")
        layers = r.get("layers")  # each decoder layer's phases: not drawn, but typed like the rest
        if layers is not None and not isinstance(layers, list):
            raise ConfigError(f"timeline: rank {rank} `layers` is not a list ({_shown(layers)})", hint=HINT)
        if layers is not None and len(layers) > MAX_LAYERS:
            raise ConfigError(f"timeline: rank {rank} `layers` holds {len(layers):,} entries, more than the "
                              f"{MAX_LAYERS} convert records", hint=HINT)
        for j, lay in enumerate(layers or ()):
            idx = lay.get("layer") if isinstance(lay, dict) else None
            if (not isinstance(lay, dict) or isinstance(idx, bool) or not isinstance(idx, int)
                    or not 0 <= idx < 1 << 31 or not isinstance(lay.get("phases"), dict)):
                raise ConfigError(f"timeline: rank {rank} layers[{j}] is not an object with an integer `layer` "
                                  f"in [0, 2**31) and `phases` ({_shown(lay)})", hint=HINT)
            _phases(lay["phases"], f"rank {rank} layer {idx} phase")
        out.append({"rank": rank,
                    "wall_s": _seconds(r.get("wall_s", sum(phases.values())), f"rank {rank} wall_s"),
                    "cpu_s": _seconds(r["cpu_s"], f"rank {rank} cpu_s") if "cpu_s" in r else None,
                    "untracked_s": _seconds(r.get("untracked_s", 0.0), f"rank {rank} untracked_s"),
                    "phases": phases, "phases_cpu": cpu, "wait_after": after})
    return out


def _object(r: dict, key: str, rank: int) -> dict:
    """A rank's optional object `key` ({} when absent or null)."""
    v = r.get(key)
    if v is not None and not isinstance(v, dict):
        raise ConfigError(f"timeline: rank {rank} `{key}` is not an object ({_shown(v)})", hint=HINT)
    return v or {}


def _phases(d: dict, where: str) -> dict[str, float]:
    """{phase name (cut to MAX_NAME): seconds}, every value checked."""
    return {str(k)[:MAX_NAME]: _seconds(v, f"{where} {str(k)[:MAX_NAME]!r}") for k, v in d.items()}


def _order(ranks: list[dict]) -> list[str]:
    """The phases to draw: the MAX_PHASES largest by their largest time on any rank, in pipeline order."""
    best: dict[str, float] = {}
    for r in ranks:
        for k, v in r["phases"].items():
            best[k] = max(best.get(k, 0.0), v)
    top = sorted(best, key=lambda k: -best[k])[:MAX_PHASES]
    known = [k for k in COLOURS if k in top]
    return known + sorted(k for k in top if k not in COLOURS)


def section_timeline(page: _Page, ranks: list[dict]) -> None:
    page.section("sec-timeline", "Where the time went")
    drawn = ranks[:MAX_RANKS]
    phases = _order(drawn)
    fig, axs = _new_figure(1.4 + 0.4 * len(drawn))
    ax = axs[0, 0]
    labelled: set[str] = set()  # each phase named once in the legend
    for row, r in enumerate(drawn):
        left = 0.0
        for k in phases + ["other", "untracked"]:
            if k == "other":
                v = sum(x for p, x in r["phases"].items() if p not in phases)
            elif k == "untracked":
                v = r["untracked_s"]
            else:
                v = r["phases"].get(k, 0.0)
            if v > 0:
                ax.barh(row, v, left=left, color=COLOURS.get(k, COLOURS["other"]),
                        label=None if k in labelled else k)
                labelled.add(k)
                left += v
    ax.set_yticks(range(len(drawn)))
    ax.set_yticklabels([f"rank {r['rank']}" for r in drawn], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("wall seconds")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(6, len(labelled)), loc="lower center",
              bbox_to_anchor=(0.5, 1.0), frameon=False)
    more = f" The first {MAX_RANKS} of {len(ranks)} ranks are drawn." if len(ranks) > MAX_RANKS else ""
    cap = ("Each rank's wall time by phase (<code>quantkit convert --json</code>, <code>timeline</code>): "
           "<b>setup</b> model skeleton and plan, <b>load</b> a layer's weights, <b>forward</b> and "
           "<b>statistics</b> over the rank's batches, <b>solve</b> GPTQ/AWQ with quantize and pack, "
           "<b>exchange</b> tensor collectives, <b>wait</b> waiting for the slowest rank at a step's check, "
           "<b>write</b> spool, records and manifest, <b>stream</b> the shards. A long red <b>wait</b> on one "
           "rank and not the others is the serial part: the others did work it waited for." + more)
    page.figure("fig-timeline", fig, cap)
    cols = drawn[:MAX_TABLE_RANKS]
    head = "".join(f"<th class=\"num\">rank {r['rank']} wall / CPU</th>" for r in cols)
    rows = []
    for k in phases:
        cells = "".join(f"<td class=\"num\">{r['phases'].get(k, 0.0):.2f} / "
                        f"{r['phases_cpu'].get(k, 0.0):.2f}</td>" for r in cols)
        rows.append(f"<tr><td class=\"mono\">{_e(k)}</td>{cells}</tr>")
    total = "".join(f"<td class=\"num\"><b>{r['wall_s']:.2f}</b> / "
                    f"{'' if r['cpu_s'] is None else format(r['cpu_s'], '.2f')}</td>" for r in cols)
    rows.append(f"<tr><td><b>whole rank</b></td>{total}</tr>")
    page.add(f"<table><tr><th>phase (seconds)</th>{head}</tr>{''.join(rows)}</table>"
             "<p>CPU seconds are the rank's main thread: unlike wall time they do not depend on what else ran on "
             "the machine, so they show how the work split. Wall much above CPU in a phase means waiting.</p>")
    waits = [r for r in cols if r["wait_after"]]
    if waits:
        items = "".join(f"<li>rank {r['rank']}: " + ", ".join(
            f"after <span class=\"mono\">{_e(k)}</span> {v:.2f} s"
            for k, v in sorted(r["wait_after"].items(), key=lambda kv: -kv[1])) + "</li>" for r in waits)
        page.add("<p>Each rank's <b>wait</b> by the step whose check it waited at: the step another rank was "
                 f"still busy with.</p><ul>{items}</ul>")
