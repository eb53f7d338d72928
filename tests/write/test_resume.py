"""Resume after any interruption, refusal to mix, and byte-identical output.

Interruptions are made deterministic: the CLI runs in a forked child (see test_hostile.py) that counts
its I/O events -- every shard write, both sides of every rename, both sides of the journal's removal --
and SIGKILLs itself at event k (a shard write is torn in half first) or fails that operation with ENOSPC.
An uninterrupted run logs the events of the whole conversion (287 for the 18-shard model), so kill
points can be drawn from, or named in, that sequence. After every interruption the same command is
run again and the final directory (every file, hidden ones included) must equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import pytest

from quantkit import errors as E
from quantkit.convert import JOURNAL_DIR, MANIFEST_NAME, ConvertOptions, convert
from harness import (GROUP48, assert_clean_failure, cli, manifest_status,  # noqa: F401
                     reference, run_bounded, src18, tree)

SIGKILLED = -9
M = "out/" + MANIFEST_NAME


# ---- the event sequence -----------------------------------------------------------------------------
def segments(events: list[str]) -> tuple[int, dict[str, int], int]:
    """(events before the first shard, events per output shard, events after the last journal record)."""
    first = next(i for i, e in enumerate(events) if e.startswith("emit "))
    last = max(i for i, e in enumerate(events) if e.split(" ", 1)[1].startswith(JOURNAL_DIR + "/"))
    per: dict[str, int] = {}
    shard = None
    for e in events[first:last + 1]:
        if e.startswith("emit "):
            shard = e.split(" ", 1)[1]
        per[shard] = per.get(shard, 0) + 1
    return first, per, len(events) - last - 1


def done_outputs(out: Path) -> set[str]:
    """Output shards the journal in `out` records as finished."""
    names: set[str] = set()
    for p in (out / JOURNAL_DIR).glob("*.json"):
        rec = json.loads(p.read_text())
        names |= {o["name"] for o in rec["outputs"]} if "outputs" in rec else {rec["output"]}
    return names


def expected_events(events: list[str], out: Path) -> int:
    """How many events a (re)run into `out` makes: the shards already journaled are skipped."""
    head, per, tail = segments(events)
    done = done_outputs(out)
    return head + sum(n for s, n in per.items() if s not in done) + tail


def at(events: list[str], label: str, nth: int = 0) -> int:
    """1-based index of the nth (negative: from the end) event called `label`."""
    idx = [i + 1 for i, e in enumerate(events) if e == label]
    return idx[nth]


# ---- SIGKILL at random points -----------------------------------------------------------------------
def _avoid(n: int, first_run: bool) -> set[int]:
    """Kill points not drawn in a run of n events. Event n (the final manifest's rename) always: the
    output is then complete and a further run is no resume (see
    test_sigkill_after_last_write_leaves_complete_output)."""
    return {n}


def test_sigkill_at_5_random_points_then_resume(cli, src18, reference, tmp_path):
    """Five SIGKILLs at seeded random I/O events, each in a run that resumes the previous one; the sixth
    run finishes, makes exactly the events of the shards not yet journaled (finished shards are not
    redone), and the output equals an uninterrupted run byte for byte (shards, manifest, index, config,
    copied files; no debris left)."""
    ref_out, events = reference
    rng = random.Random(20261201)
    out = tmp_path / "out"
    kills = []
    for i in range(5):
        n = expected_events(events, out) if out.exists() else len(events)
        k = rng.choice([j for j in range(1, n + 1) if j not in _avoid(n, first_run=i == 0)])
        kills.append((k, n))
        r = cli.convert(src18, out, faults={"kill_at": k})
        assert r.rc == SIGKILLED, (kills, r.rc, r.stderr)
        assert manifest_status(out) != "complete"
    done_before = len(done_outputs(out))
    n_left = expected_events(events, out)
    log = tmp_path / "final.log"
    r = cli.convert(src18, out, "--json", faults={"kill_at": 0, "log": str(log)})
    assert r.rc == 0, (kills, r.stderr)
    assert json.loads(r.stdout)["shards_resumed"] == done_before
    assert len(log.read_text().splitlines()) == n_left
    assert tree(out) == tree(ref_out), kills


NAMED_POINTS = {
    # name: (event label, occurrence) in the uninterrupted run
    "first_manifest_written": ("after-replace " + M, 0),
    "first_shard_torn": ("emit model-00001-of-00018.safetensors", 1),
    "shard_renamed_not_journaled": ("after-replace out/model-00001-of-00018.safetensors", 0),
    "journal_record_tmp": ("before-replace " + JOURNAL_DIR + "/model-00002-of-00018.safetensors.json", 0),
    "index_written": ("after-replace out/model.safetensors.index.json", 0),
    "full_manifest_in_progress": ("after-replace " + M, 1),
    "journal_about_to_go": ("before-rmtree out/" + JOURNAL_DIR, 0),
    "model_card_tmp": ("before-replace out/README.md", 0),  # the card's temporary has a random name
}

def _named(points, marks=()):
    return [pytest.param(*v, id=k, marks=marks) for k, v in points.items()]


def _kill_resume(cli, src18, events, out, label, nth):
    k = at(events, label, nth)
    r = cli.convert(src18, out, faults={"kill_at": k})
    assert r.rc == SIGKILLED, r.stderr
    assert manifest_status(out) != "complete"
    r = cli.convert(src18, out, "--json")
    assert r.rc == 0, r.stderr
    return r


# the windows between the first manifest, the journal's removal and the final manifest
NAMED_WINDOWS = {
    "debris_before_first_manifest": ("before-replace " + M, 0),
    "journal_removed": ("after-rmtree out/" + JOURNAL_DIR, 0),
    "final_manifest_tmp": ("before-replace " + M, -1),
}


@pytest.mark.parametrize("label,nth", _named(NAMED_POINTS) + _named(NAMED_WINDOWS))
def test_sigkill_at_named_point_then_resume(cli, src18, reference, tmp_path, label, nth):
    ref_out, events = reference
    out = tmp_path / "out"
    _kill_resume(cli, src18, events, out, label, nth)
    assert tree(out) == tree(ref_out)


def test_sigkill_after_last_write_leaves_complete_output(cli, src18, reference, tmp_path):
    """Killed after the final manifest rename: the output is complete and identical; running the same
    command again says so (exit 1, OutputExists) instead of calling OUT a foreign non-empty directory."""
    ref_out, events = reference
    out = tmp_path / "out"
    r = cli.convert(src18, out, faults={"kill_at": len(events)})
    assert r.rc == SIGKILLED and manifest_status(out) == "complete"
    assert tree(out) == tree(ref_out)
    r = cli.convert(src18, out)
    line = assert_clean_failure(r, out, was_complete=True)
    assert "already holds a complete conversion" in line and tree(out) == tree(ref_out)


def test_sigkill_process_group_with_workers_then_resume(cli, src18, reference, tmp_path):
    """--workers 2: the whole process group (parent and pool workers) is SIGKILLed once 3 shards are
    journaled -- a wall-clock point, not an event count; the resume with --workers 1 still gives the
    uninterrupted run's bytes."""
    ref_out, _ = reference
    out = tmp_path / "out"
    r = cli.convert(src18, out, "--workers", "2", killpg_when_journal=(out / JOURNAL_DIR, 3))
    assert r.rc == SIGKILLED, r.stderr
    assert manifest_status(out) != "complete"
    assert 3 <= len(done_outputs(out)) < 18
    r = cli.convert(src18, out)
    assert r.rc == 0, r.stderr
    assert tree(out) == tree(ref_out)


# ---- ENOSPC at named points -------------------------------------------------------------------------
ENOSPC_POINTS = {
    "shard_header": ("emit model-00001-of-00018.safetensors", 0),
    "mid_shard": ("emit model-00006-of-00018.safetensors", 3),
    "journal_record": ("before-replace " + JOURNAL_DIR + "/model-00004-of-00018.safetensors.json", 0),
    "full_manifest_in_progress": ("before-replace " + M, 1),
}


@pytest.mark.parametrize("label,nth", _named(ENOSPC_POINTS) + _named(
    {"first_manifest": ("before-replace " + M, 0), "final_manifest": ("before-replace " + M, -1)}))
def test_enospc_at_named_point_then_resume(cli, src18, reference, tmp_path, label, nth):
    """The disk fills at one write: DiskFull (one line + hint, exit 1, temporaries removed, nothing
    complete); finished shards stay journaled; after space is freed the same command resumes and the
    output equals an uninterrupted run."""
    ref_out, events = reference
    out = tmp_path / "out"
    r = cli.convert(src18, out, "--json", faults={"kill_at": at(events, label, nth), "action": "enospc"})
    line = assert_clean_failure(r, out, E.DiskFull.hint)
    assert "No space left on device" in line
    r = cli.convert(src18, out, "--json")
    assert r.rc == 0, r.stderr
    assert tree(out) == tree(ref_out)


# ---- refusing to mix --------------------------------------------------------------------------------
def _interrupted(cli, src, events, out, shards=5):
    """A conversion of `src` SIGKILLed right after `shards` shards were journaled."""
    label = "after-replace " + JOURNAL_DIR + f"/model-{shards:05d}-of-00018.safetensors.json"
    r = cli.convert(src, out, faults={"kill_at": at(events, label)})
    assert r.rc == SIGKILLED
    assert len(done_outputs(out)) == shards
    return tree(out)


def _refused(r, out, before):
    assert_clean_failure(r, out, E.ResumeMismatch.hint)
    assert tree(out) == before  # nothing finished was lost or touched


def test_resume_refuses_changed_source(cli, src18, reference, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(src18, src)  # copy2: same sizes and mtimes, so the same identity as src18
    out = tmp_path / "out"
    before = _interrupted(cli, src, reference[1], out)
    p = src / "model-00011-of-00018.safetensors"
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 1_000_000_000))  # re-downloaded shard
    _refused(cli.convert(src, out, "--json"), out, before)


def test_resume_refuses_changed_recipe(cli, src18, reference, tmp_path):
    out = tmp_path / "out"
    before = _interrupted(cli, src18, reference[1], out)
    (tmp_path / "g64.yaml").write_text(GROUP48.replace("48", "64"))
    _refused(cli.convert(src18, out, "--json", "--recipe", tmp_path / "g64.yaml"), out, before)


def test_resume_refuses_changed_version(cli, src18, reference, tmp_path, monkeypatch):
    out = tmp_path / "out"
    before = _interrupted(cli, src18, reference[1], out)
    import quantkit.convert as qc

    monkeypatch.setattr(qc, "__version__", "999.0.0")
    with pytest.raises(E.ResumeMismatch):
        convert(src18, out, ConvertOptions())
    assert tree(out) == before


def test_resume_refuses_changed_config(cli, src18, reference, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(src18, src)
    out = tmp_path / "out"
    before = _interrupted(cli, src, reference[1], out)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (src / "config.json").write_text(json.dumps(cfg))
    _refused(cli.convert(src, out, "--json"), out, before)


def test_no_resume_refuses_partial_output(cli, src18, reference, tmp_path):
    out = tmp_path / "out"
    before = _interrupted(cli, src18, reference[1], out)
    r = cli.convert(src18, out, "--no-resume", "--json")
    assert_clean_failure(r, out, E.OutputExists.hint)
    assert tree(out) == before


def test_resume_redoes_a_damaged_finished_shard(cli, src18, reference, tmp_path):
    """A finished shard damaged in place (same size) before the resume is redone, not trusted."""
    out = tmp_path / "out"
    _interrupted(cli, src18, reference[1], out)
    p = out / "model-00002-of-00018.safetensors"
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0xFF
    p.write_bytes(bytes(raw))
    r = cli.convert(src18, out)
    assert r.rc == 0, r.stderr
    assert tree(out) == tree(reference[0])


# ---- determinism ------------------------------------------------------------------------------------
def test_two_clean_runs_and_workers_are_byte_identical(cli, src18, reference, tmp_path):
    """Clean runs give the same bytes in every file: the harness's reference run, the installed `quantkit`
    console script in a fresh interpreter, and --workers 2 (shards finish out of order in two spawned
    worker processes, each with its own torch thread count)."""
    ref_out, _ = reference
    script = Path(sys.executable).parent / "quantkit"
    exe = [str(script)] if script.is_file() else [sys.executable, "-m", "quantkit.cli"]
    env = {k: v for k, v in os.environ.items() if k != "QUANTKIT_DEBUG"}
    p = run_bounded([*exe, "convert", str(src18), str(tmp_path / "a")], env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert tree(tmp_path / "a") == tree(ref_out)
    r = cli.convert(src18, tmp_path / "b", "--workers", "2")
    assert r.rc == 0, r.stderr
    assert tree(tmp_path / "b") == tree(ref_out)


# ---- hostile journal records ------------------------------------------------------------------------
SHARD = "model-00004-of-00018.safetensors"  # quantized experts only


def _first_tensor(rec):
    return sorted(rec["tensors"])[0]


# name: (edit of SHARD's journal record, caught when held against the plan: a note says so)
JOURNAL_EDITS = {
    "source_missing": (lambda r: r.pop("source"), False),
    "source_list": (lambda r: r.update(source=[SHARD]), False),
    "source_unknown": (lambda r: r.update(source="nope.safetensors"), False),
    "source_another_shard": (lambda r: r.update(source="model-00005-of-00018.safetensors"), False),
    "outputs_string": (lambda r: r.update(outputs="x"), False),
    "outputs_numbers": (lambda r: r.update(outputs=[1, 2]), False),
    "outputs_empty": (lambda r: r.update(outputs=[]), False),
    "outputs_escape": (lambda r: r["outputs"][0].update(name="../" + SHARD), False),
    "outputs_size_string": (lambda r: r["outputs"][0].update(size=str(r["outputs"][0]["size"])), False),
    "tensors_null": (lambda r: r.update(tensors=None), True),
    "tensors_string": (lambda r: r.update(tensors="x"), True),
    "tensors_number": (lambda r: r.update(tensors=5), True),
    "tensors_list": (lambda r: r.update(tensors=[]), True),
    "tensors_missing": (lambda r: r.pop("tensors"), True),
    "tensors_empty": (lambda r: r.update(tensors={}), True),  # once finished "complete" without them
    "tensor_dropped": (lambda r: r["tensors"].pop(_first_tensor(r)), True),
    "tensor_added": (lambda r: r["tensors"].update({"model.extra.weight": {"shape": [1], "dtype": "bfloat16",
                                                                           "shard": SHARD}}), True),
    "tensor_shape": (lambda r: r["tensors"][_first_tensor(r)].update(shape=[1, 2, 3]), True),
    "tensor_shard": (lambda r: r["tensors"][_first_tensor(r)].update(shard="model-00003-of-00018.safetensors"), True),
    "tensor_entry_string": (lambda r: r["tensors"].update({_first_tensor(r): "x"}), True),
    "scheme_undefined": (lambda r: r.update(schemes={}), True),
    "schemes_string": (lambda r: r.update(schemes="x"), True),
    "schemes_number": (lambda r: r.update(schemes=5), True),
    "notes_number": (lambda r: r.update(notes=5), True),
    "source_size": (lambda r: r.update(source_size=r["source_size"] + 1), True),
    "bytes_read_string": (lambda r: r.update(bytes_read="x"), True),
}


@pytest.mark.parametrize("case", list(JOURNAL_EDITS))
def test_resume_holds_each_journal_record_against_the_plan(cli, src18, reference, tmp_path, case):
    """A journal record that does not describe its shard as the plan writes it (a field missing, of the
    wrong type, naming other files or tensors) is never trusted: that shard is converted again, the four
    intact records are kept, and the output equals the uninterrupted run's byte for byte."""
    edit, noted = JOURNAL_EDITS[case]
    out = tmp_path / "out"
    _interrupted(cli, src18, reference[1], out)
    p = out / JOURNAL_DIR / f"{SHARD}.json"
    rec = json.loads(p.read_text())
    assert all("scheme" in e for e in rec["tensors"].values())
    edit(rec)
    p.write_text(json.dumps(rec))
    r = cli.convert(src18, out, "--json")
    assert r.rc == 0 and "internal error" not in r.stderr, r.stderr
    assert json.loads(r.stdout)["shards_resumed"] == 4
    assert ("is not trusted" in r.stderr) == noted, r.stderr
    assert tree(out) == tree(reference[0])


def test_sigterm_with_workers_ends_every_worker_then_resumes(src18, reference, tmp_path):
    """SIGTERM to `convert --workers 2` (a service manager stopping it, `timeout`): the command unwinds as for
    Ctrl-C, ends its pool workers (no process of it left running: the test's process guard checks too), says
    so in one line, exits 128 + 15, and the same command resumes to the uninterrupted run's bytes."""
    import signal
    import subprocess
    import time

    import procs

    ref_out, _ = reference
    out = tmp_path / "out"
    before = procs.live_descendants()
    p = subprocess.Popen([sys.executable, "-m", "quantkit.cli", "convert", str(src18), str(out), "--workers", "2"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "QUANTKIT_DEBUG": "0"})
    try:
        end = time.monotonic() + 300
        while len(done_outputs(out)) < 2 and p.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert p.poll() is None, p.stderr.read()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "terminated by signal 15; run the same command again to resume", err
    assert procs.leftovers(before, grace_s=2) == {}  # the pool's workers ended with the command
    assert manifest_status(out) != "complete"
    r = subprocess.run([sys.executable, "-m", "quantkit.cli", "convert", str(src18), str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert tree(out) == tree(ref_out)
