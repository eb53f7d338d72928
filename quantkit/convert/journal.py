"""The resume journal held against the plan: a record (one per finished source shard, JSON in OUT's
journal directory) is hostile input like any other file in OUT. write/output.py keeps only records whose
output shards are still on disk byte for byte as the record says; here each kept record is checked field by
field against the plan of its shard and against the headers of the shards it names. A record that fails is
not trusted: its shard is converted again, and a note says why."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import QuantkitError
from ..match.shards import ShardPlan
from ..pack.manifest import dtype_name, entry_fields_ok
from ..read.safetensors import TensorInfo, read_header

_SHA256 = re.compile(r"[0-9a-f]{64}")


def _is_int(v: Any) -> bool:
    return type(v) is int and v >= 0


def _scheme_problem(label: Any, cfg: Any) -> str | None:
    if not isinstance(label, str) or not isinstance(cfg, Mapping):
        return "a scheme that is not a label and an object"
    if not isinstance(cfg.get("format"), str) or not isinstance(cfg.get("weights"), Mapping):
        return f"scheme {label[:60]!r} without a format and weights"
    if cfg.get("input_activations") is not None and not isinstance(cfg["input_activations"], Mapping):
        return f"scheme {label[:60]!r} with input_activations that are not an object"
    return None


def record_problem(rec: Mapping, plan: ShardPlan, source_size: int, out: Path,
                   info: Callable[[str], TensorInfo]) -> str | None:
    """What makes the journal record `rec` of `plan.source` untrustworthy, or None. The record must name
    the plan's output shards in order, carry exactly the tensors the plan writes to each (names, shapes and
    dtypes, as those shards' headers also hold them), and have the types convert's finishing step reads."""
    if rec.get("source") != plan.source:
        return "it names another source shard"
    if rec.get("source_size") != source_size or not isinstance(rec.get("source_sha256"), str) \
            or not _SHA256.fullmatch(rec["source_sha256"]):
        return "its source size or sha256 does not describe the source shard"
    if not _is_int(rec.get("bytes_read")):
        return "bytes_read is not a count"
    notes = rec.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        return "notes is not a list of strings"
    schemes = rec.get("schemes", {})
    if not isinstance(schemes, Mapping):
        return "schemes is not an object"
    for label, cfg in schemes.items():
        problem = _scheme_problem(label, cfg)
        if problem:
            return problem
    outputs, tensors = rec.get("outputs"), rec.get("tensors")
    if not isinstance(outputs, list) or [o.get("name") if isinstance(o, Mapping) else None for o in outputs] != [
            name for name, _ in plan.parts]:
        return "its output shards are not the ones the plan writes"
    if not isinstance(tensors, Mapping):
        return "tensors is not an object"
    seen = 0
    for part, units in plan.parts:
        want = {n: ([int(d) for d in shape], dtype_name(dtype)) for u in units for n, dtype, shape in u.outputs(info)}
        try:
            held = read_header(out / part).tensors
        except QuantkitError as e:
            return f"{part} is not readable: {e.message}"
        if set(held) != set(want) or any(([*held[n].shape], dtype_name(held[n].dtype)) != want[n] for n in want):
            return f"{part} does not hold the tensors the plan writes to it"
        for n, (shape, dtype) in want.items():
            e = tensors.get(n)
            if not isinstance(e, Mapping) or e.get("shard") != part or e.get("shape") != shape \
                    or e.get("dtype") != dtype:
                return f"its entry for {n[:120]} does not describe that tensor in {part}"
            if "scheme" in e and e["scheme"] not in schemes:
                return f"its entry for {n[:120]} names a scheme the record does not define"
            if not entry_fields_ok(e) or ("scheme" in e and not isinstance(e.get("method"), str)):
                return f"its entry for {n[:120]} has fields of the wrong type"
        seen += len(want)
    if len(tensors) != seen:
        return "it lists tensors the plan does not write"
    return None


def trusted(done: Mapping[str, Any], plans: list[ShardPlan], sizes: Mapping[str, int], out: Path,
            info: Callable[[str], TensorInfo], log: Callable[[str], None] | None = None) -> dict[str, dict]:
    """The records of `done` (source shard -> journal record) that `record_problem` finds nothing wrong
    with; each other one is logged, and its shard is converted again."""
    by_source = {p.source: p for p in plans}
    kept = {}
    for source, rec in done.items():
        plan = by_source.get(source)
        problem = "no shard of the source has that name" if plan is None else \
            record_problem(rec, plan, sizes[source], out, info)
        if problem is None:
            kept[source] = rec
        elif log:
            log(f"resume: the journal record of {str(source)[:120]} is not trusted ({problem}); converting that "
                "shard again")
    return kept
