"""engine/worker.py: an engine worker and everything it started end with it, on success, error, time-out and a
SIGTERM to the command that runs it; its result file is hostile input (a FIFO, huge, deep or not JSON)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantkit.engine.worker import run_worker
from quantkit.errors import EngineError


def _fake(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "python"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return p


def _run(tmp_path: Path, body: str, timeout: int = 30) -> dict:
    return run_worker(str(_fake(tmp_path, body)), tmp_path / "worker.py", tmp_path / "req.json",
                      tmp_path / "result.json", tmp_path / "log.txt", dict(os.environ), timeout, "test engine",
                      "install it")


def _running(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_gone(pid: int, within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while _running(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not _running(pid)


def test_what_a_finished_worker_started_ends_with_it(tmp_path):
    pid = tmp_path / "child.pid"
    out = _run(tmp_path, f'sleep 300 & echo $! > "{pid}"\necho \'{{"status": "error", "error": "x"}}\' > "$3"')
    assert out["status"] == "error"
    assert _wait_gone(int(pid.read_text()))


@pytest.mark.parametrize("body,match", [
    ('mkfifo "$3"', "a FIFO, not a regular file"),
    ('python3 -c "print(\'[\' * 100000 + \']\' * 100000)" > "$3"', "not valid JSON"),
    ('python3 -c "print(\'{\\"status\\": \\"ok\\", \\"n\\": \' + \'9\' * 3000 + \'}\')" > "$3"', "digits"),
    ('printf \'{"status": "ok", "x": "\\377"}\' > "$3"', "not UTF-8"),
])
def test_hostile_result_files(tmp_path, body, match):
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=match):
        _run(tmp_path, body)
    assert time.monotonic() - t0 < 10


def _sigterm_once_the_worker_runs(code: str, pid: Path, check) -> tuple[int, int]:
    """Run `code` in a Python process; once the fake worker's child has written its pid to `pid` (it runs, and
    `check()` holds unless it returns None), SIGTERM that process. -> (its exit status, the child's pid)."""
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        end = time.monotonic() + 60
        while not (pid.exists() and pid.read_text().strip()) and time.monotonic() < end:
            time.sleep(0.05)
        child = int(pid.read_text())
        assert _running(child) and check() is not False
        p.send_signal(signal.SIGTERM)
        return p.wait(timeout=30), child
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_sigterm_to_the_command_ends_the_worker_group_first(tmp_path):
    """SIGTERM to a process running a worker: the worker's session (here a worker and its child) is killed
    before the process ends, and it ends by that signal as it would have."""
    pid = tmp_path / "child.pid"
    fake = _fake(tmp_path, f'sleep 300 & echo $! > "{pid}"\nwait')
    code = ("import os, sys\nfrom quantkit.engine.worker import run_worker\n"
            f"run_worker({str(fake)!r}, {str(tmp_path / 'w.py')!r}, {str(tmp_path / 'req')!r}, "
            f"{str(tmp_path / 'res')!r}, {str(tmp_path / 'log')!r}, dict(os.environ), 300, 'test', 'hint')\n")
    rc, child = _sigterm_once_the_worker_runs(code, pid, lambda: None)
    assert rc == -signal.SIGTERM
    assert _wait_gone(child)


def test_under_the_command_line_sigterm_unwinds_through_cleanup(tmp_path):
    """With the command line's handlers (quantkit/signals.py), SIGTERM while a worker runs raises Terminated:
    the worker's session is killed and the caller's temporary folder removed before the process exits."""
    pid = tmp_path / "child.pid"
    fake = _fake(tmp_path, f'sleep 300 & echo $! > "{pid}"\nwait')
    base = tmp_path / "tmp"
    base.mkdir()
    code = ("import os, sys, tempfile\nfrom quantkit import signals\nfrom quantkit.errors import Terminated\n"
            "from quantkit.engine.worker import run_worker\nsignals.raise_on_termination()\ntry:\n"
            f"    with tempfile.TemporaryDirectory(dir={str(base)!r}) as d:\n"
            f"        run_worker({str(fake)!r}, d + '/w.py', d + '/req', d + '/res', d + '/log', dict(os.environ), "
            "300, 'test', 'hint')\n"
            "except Terminated as t:\n    sys.exit(128 + t.signum)\n")
    # the temporary folder exists while the worker runs
    rc, child = _sigterm_once_the_worker_runs(code, pid, lambda: any(base.iterdir()))
    assert rc == 128 + signal.SIGTERM
    assert _wait_gone(child) and not any(base.iterdir())
