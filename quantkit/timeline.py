"""Where a job's time goes, per rank and per phase: the tool for finding the serial part of a pass.

    with timeline.phase("forward"):
        ...

A process has at most one active Timeline (`start()` makes it; `phase` is a no-op without one, so library
code is instrumented unconditionally at no cost). Phases nest and their times are exclusive: time spent in a
phase opened inside another counts for the inner one only, so the phases of a rank add up to its wall time
less what no phase covered ("untracked"). The phases the calibrated pass and convert use:

    load       reading a decoder layer's weights from the source
    forward    the layer forward over this rank's batches (the next layer's inputs)
    statistics the statistics forward (Hessians, activation statistics) over this rank's batches
    solve      GPTQ / AWQ solves and the quantization and packing of what this rank owns
    exchange   tensor collectives: statistics to their owners, weights to every rank, results to rank 0
    wait       the check after each step that no rank failed: a rank that finished early waits here
    write      spool files, activations, progress records, output shards, index and manifest
    stream     convert's shard streaming (RTN, pass-through, packing, writing) outside the calibrated pass
    setup      reading the source, planning, KV scales, preparing the output

`to_json()` gives {"rank", "wall_s", "phases": {name: seconds}, "untracked_s", "layers": [...]} where
"layers" holds each decoder layer's phases, capped at MAX_LAYERS, and, when a phase was entered with
`after=` (the wait at a distributed step's check, dist.World.step), "wait_after": {step's phase: seconds}:
the same seconds as the phase's total, split by the step whose check it waited at, so that a rank's wait
says which step the others were still busy with.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

MAX_LAYERS = 4096  # decoder layers recorded one by one; beyond, only the totals

_current: "Timeline | None" = None


class Timeline:
    def __init__(self, rank: int = 0):
        self.rank = rank
        self.t0 = time.perf_counter()
        self.c0 = time.thread_time()
        self.totals: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.per_layer: dict[int, dict[str, float]] = {}
        self.layer: int | None = None
        self.after: dict[str, float] = defaultdict(float)  # `after=` phases' seconds, by what they followed
        self._stack: list[list] = []  # [name, started, cpu started] of the open phases, innermost last

    def _charge(self, name: str, seconds: float, cpu: float) -> None:
        self.totals[name] += seconds
        self.cpu[name] += cpu
        if self.layer is not None and (self.layer in self.per_layer or len(self.per_layer) < MAX_LAYERS):
            d = self.per_layer.setdefault(self.layer, defaultdict(float))
            d[name] += seconds

    @contextlib.contextmanager
    def phase(self, name: str, after: str | None = None):
        spent = self.totals[name]
        now, cnow = time.perf_counter(), time.thread_time()
        if self._stack:  # the enclosing phase pauses
            outer = self._stack[-1]
            self._charge(outer[0], now - outer[1], cnow - outer[2])
        self._stack.append([name, now, cnow])
        try:
            yield
        finally:
            end, cend = time.perf_counter(), time.thread_time()
            _, began, cbegan = self._stack.pop()
            self._charge(name, end - began, cend - cbegan)
            if after is not None:  # this entry's exclusive seconds (a nested phase's are not in them)
                self.after[after] += self.totals[name] - spent
            if self._stack:  # the enclosing phase resumes
                self._stack[-1][1], self._stack[-1][2] = end, cend

    def to_json(self) -> dict:
        wall = time.perf_counter() - self.t0
        phases = {k: round(v, 4) for k, v in sorted(self.totals.items(), key=lambda kv: -kv[1])}
        return {"rank": self.rank, "wall_s": round(wall, 4), "cpu_s": round(time.thread_time() - self.c0, 4),
                "phases": phases, "phases_cpu": {k: round(self.cpu[k], 4) for k in phases},
                "untracked_s": round(max(0.0, wall - sum(self.totals.values())), 4),
                "layers": [{"layer": i, "phases": {k: round(v, 4) for k, v in d.items()}}
                           for i, d in sorted(self.per_layer.items())],
                **({"wait_after": {k: round(v, 4) for k, v in sorted(self.after.items(), key=lambda kv: -kv[1])}}
                   if self.after else {})}


def start(rank: int = 0) -> Timeline:
    """Begin recording this process's phases (replacing any earlier timeline)."""
    global _current
    _current = Timeline(rank)
    return _current


def current() -> Timeline | None:
    return _current


def stop() -> dict | None:
    """End recording; the timeline's JSON, or None when none was active."""
    global _current
    tl, _current = _current, None
    return None if tl is None else tl.to_json()


def phase(name: str, after: str | None = None):
    """A context manager charging the time inside it to `name` on the active timeline (no-op without one);
    `after`: also to that key of the timeline's "wait_after" (what the time followed)."""
    tl = _current
    return tl.phase(name, after) if tl is not None else contextlib.nullcontext()


def set_layer(idx: int | None) -> None:
    """Attribute the phases from now on to decoder layer `idx` (None: to no layer) in the per-layer view."""
    if _current is not None:
        _current.layer = idx
