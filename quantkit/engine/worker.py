"""Running an engine's worker: the engine's Python (`--engine-python`), ending a worker and all it started, and
reading its result file as the hostile input it is. Shared by the vLLM and llama.cpp runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..errors import EngineError


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
    """End an engine worker started in a session of its own, and everything it started."""
    import signal

    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


def read_result(path: Path, engine: str) -> dict:
    """An engine worker's result file: a JSON object with a known status, or a named error (it is input)."""
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise EngineError(f"the {engine} worker's result is not JSON") from None
    if not isinstance(out, dict) or out.get("status") not in ("ok", "cannot_run", "error"):
        raise EngineError(f"the {engine} worker's result has no valid status")
    return out
