"""Scratch directories for the benchmarks.

A benchmark writes models and converted checkpoints (hundreds of MB to GB per run) under one directory.
`scratch_dir` makes it and removes it when the process ends, whether the run finishes, raises, is
interrupted (Ctrl-C) or is terminated (SIGTERM), so repeated runs do not fill the disk. A directory the
user names is theirs: it is created if missing and kept.
"""

from __future__ import annotations

import atexit
import shutil
import signal
import tempfile
from pathlib import Path


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like an error, so atexit handlers run


def scratch_dir(prefix: str, keep: str | Path | None = None) -> Path:
    """`keep` if given (made if missing, never removed), else a new temporary directory removed at exit."""
    if keep:
        path = Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return path
