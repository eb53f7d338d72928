"""`torchrun -m quantkit convert`: the shards split over ranks (gloo on the CPU), one output.

Launched for real with torchrun (--standalone: a free port per job). What must hold: the output is byte
for byte the single-process one for 2 and 3 ranks; ranks given different work refuse to start; a rank that
fails stops every rank with an error naming it; a job whose rank was SIGKILLed mid-way resumes, run again
with the same command, to the same bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quantkit.convert import ConvertOptions, convert
from quantkit.pack.manifest import JOURNAL_DIR, MANIFEST_NAME
from harness import run_bounded

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "QUANTKIT_DIST_TIMEOUT": "120"}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _torchrun(n: int, *args, script: str | None = None, cwd=None) -> subprocess.CompletedProcess:
    target = [str(script)] if script else ["-m", "quantkit"]
    return run_bounded(TORCHRUN + [f"--nproc-per-node={n}"] + target + [str(a) for a in args],
                       env=ENV, timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from quantkit.testing import make_tiny_model

    d = tmp_path_factory.mktemp("dist")
    return make_tiny_model("qwen3_moe", d / "src", max_shard_size="100KB")  # 10 shards


@pytest.fixture(scope="module")
def single(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "q"
    convert(src, out, ConvertOptions(recipe="int4-experts-rtn"))
    return _files(out)


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_write_the_single_process_bytes(src, single, tmp_path, ranks):
    out = tmp_path / "q"
    p = _torchrun(ranks, "convert", src, out, "-r", "int4-experts-rtn", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    assert _files(out) == single
    assert p.stdout.count('"tensors_quantized"') == 1  # rank 0 alone prints the result


RANKED = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import quantkit.convert as qc
    from quantkit.cli import main
    from quantkit.errors import QuantkitError
    rank = int(os.environ["RANK"])
    src, out, mode, marker = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    recipe = "int4-experts-rtn"
    if mode == "disagree" and rank == 1:
        recipe = "nvfp4-experts"
    if mode in ("fail", "kill") and rank == 1:
        real, seen = qc.run_shard, []
        def run_shard(*a, **k):
            if mode == "fail":
                raise QuantkitError("injected failure")
            seen.append(real(*a, **k))
            if len(seen) == 2 and not marker.exists():  # the first run only: SIGKILL mid-job
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return seen[-1]
        qc.run_shard = run_shard
    main(["convert", src, out, "-r", recipe])
""")


def _ranked(tmp_path, src, out, mode) -> subprocess.CompletedProcess:
    p = tmp_path / "ranked.py"
    p.write_text(RANKED)
    return _torchrun(2, src, out, mode, tmp_path / "killed", script=p)


def test_ranks_given_different_work_refuse(src, tmp_path):
    p = _ranked(tmp_path, src, tmp_path / "q", "disagree")
    assert p.returncode != 0
    assert "rank 1 was started with different work than rank 0 (identity differs)" in p.stderr
    assert not (tmp_path / "q" / MANIFEST_NAME).exists()


def test_a_failing_rank_stops_every_rank(src, tmp_path):
    p = _ranked(tmp_path, src, tmp_path / "q", "fail")
    assert p.returncode != 0
    assert "injected failure" in p.stderr  # rank 1's own error
    assert "rank 1 failed while converting its shards" in p.stderr  # and rank 0's, naming it


def test_a_killed_rank_resumes_to_the_same_bytes(src, single, tmp_path):
    out = tmp_path / "q"
    first = _ranked(tmp_path, src, out, "kill")
    assert first.returncode != 0 and (tmp_path / "killed").exists()
    journaled = len(list((out / JOURNAL_DIR).glob("*.json")))
    assert 0 < journaled < 10  # it died mid-way, some shards done
    again = _ranked(tmp_path, src, out, "kill")  # the same command; the marker says the kill has happened
    assert again.returncode == 0, again.stderr[-3000:]
    assert _files(out) == single


LEAVE = textwrap.dedent("""
    import atexit, sys
    import torch.distributed as dist
    from quantkit import dist as qdist
    w = qdist.world()
    assert dist.is_initialized() and w.size == 2
    w.all_gather(w.rank)
    qdist.shutdown(ok=sys.argv[1] == "ok")
    print(f"rank {w.rank} left: initialized={dist.is_initialized()}", flush=True)
    qdist.shutdown()  # idempotent: the atexit hook runs it again
""")


@pytest.mark.parametrize("how", ["ok", "failed"])
def test_every_rank_leaves_the_process_group(tmp_path, how):
    """shutdown(): the closing barrier then destroy_process_group, on success and after a failure, and
    again at exit (world() registers it) without harm."""
    script = tmp_path / "leave.py"
    script.write_text(LEAVE)
    p = _torchrun(2, how, script=script)
    assert p.returncode == 0, p.stderr[-3000:]
    for r in (0, 1):
        assert f"rank {r} left: initialized=False" in p.stdout
    assert "terminate called" not in p.stderr


STEP_ALL = textwrap.dedent("""
    import sys
    from quantkit import dist as qdist
    from quantkit.errors import RankFailed
    w = qdist.world()
    print(f"rank {w.rank} got {w.step_all(lambda: {'rank': w.rank, 'sq': w.rank * w.rank}, 'squaring')}", flush=True)
    def fail():
        if w.rank == int(sys.argv[1]):
            raise ValueError("injected")
        return w.rank
    try:
        w.step_all(fail, "failing on purpose")
    except RankFailed as e:
        print(f"rank {w.rank} RankFailed: {e}", flush=True)
    except ValueError as e:
        print(f"rank {w.rank} own error: {e}", flush=True)
    qdist.shutdown()
""")


def test_step_all_gives_every_rank_the_results_and_the_failure(tmp_path):
    """World.step_all: every rank's result in rank order on every rank (sent with the check); a rank's failure
    raised there as its own error and on the others as RankFailed naming it and the step."""
    script = tmp_path / "step_all.py"
    script.write_text(STEP_ALL)
    p = _torchrun(3, 1, script=script)
    assert p.returncode == 0, p.stderr[-3000:]
    want = "[{'rank': 0, 'sq': 0}, {'rank': 1, 'sq': 1}, {'rank': 2, 'sq': 4}]"
    for r in (0, 1, 2):
        assert f"rank {r} got {want}" in p.stdout, p.stdout
    assert "rank 1 own error: injected" in p.stdout
    for r in (0, 2):
        assert f"rank {r} RankFailed: rank 1 failed while failing on purpose: ValueError: injected" in p.stdout
