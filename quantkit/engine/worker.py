"""Running an engine's worker: the engine's Python (`--engine-python`), ending a worker and all it started, and
reading its result file as the hostile input it is. Shared by the vLLM and llama.cpp runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from .. import signals
from ..errors import EngineError
from ..read.files import parse_json, read_bytes


def locate_python(python: str | os.PathLike | None) -> str:
    """The engine's Python: the path given (a file, or a venv directory), else this interpreter."""
    if python is None:
        return sys.executable
    p = Path(python)
    if p.is_dir():
        p = p / "bin" / "python"
    if not p.is_file() or not os.access(p, os.X_OK):
        raise EngineError(f"--engine-python {str(python)!r} is not an executable Python",
                          hint="pass the python of the environment vLLM is installed in, e.g. VENV/bin/python")
    return str(p)


def kill_group(p: subprocess.Popen) -> None:
    """End an engine worker started in a session of its own, and everything it started (also after the worker
    itself exited: the group outlives its leader while a member runs)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


MAX_RESULT_BYTES = 64 << 20  # logits are never in it: metrics, token ids and a log tail


def read_result(path: Path, engine: str) -> dict:
    """An engine worker's result file: a JSON object with a known status, or a named error (it is input: a regular
    file of bounded size and nesting, read/files.py)."""
    what = f"the {engine} worker's result"
    try:
        text = read_bytes(path, what, EngineError, MAX_RESULT_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise EngineError(f"{what} is not JSON (not UTF-8)") from None
    out = parse_json(text, what, EngineError)
    if not isinstance(out, dict) or out.get("status") not in ("ok", "cannot_run", "error"):
        raise EngineError(f"the {engine} worker's result has no valid status")
    return out


def run_worker(python: str, worker: Path, request: Path, result: Path, log: Path, env: dict, timeout: int,
               engine: str, install_hint: str) -> dict:
    """Start `python worker REQUEST RESULT` in a session of its own (a time-out ends it and every process it
    started), its output to `log`; return its result (read_result) with `log_tail`. EngineError when it times out
    or leaves no result."""
    with open(log, "w") as lf, signals.scope():
        p = subprocess.Popen([python, str(worker), str(request), str(result)], stdout=lf, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(p)
            raise EngineError(f"{engine} did not finish within {timeout} s",
                              hint="raise --engine-timeout, or use fewer --num-samples") from None
        except BaseException:  # an error, Ctrl-C, or SIGTERM/SIGHUP to this process (quantkit/signals.py)
            kill_group(p)
            raise
        kill_group(p)  # the worker exited: whatever it started (an engine's core process) ends with it
    tail = log.read_text(errors="replace")[-3000:]
    if not os.path.lexists(result):  # a FIFO or a device is refused by read_result, by name
        last = [ln for ln in tail.splitlines() if ln.strip()][-1:] or ["no output"]
        raise EngineError(f"the {engine} worker exited with code {p.returncode} without a result: {last[0][:300]}",
                          hint=install_hint)
    out = read_result(result, engine)
    out["log_tail"] = tail[-1500:]
    return out
