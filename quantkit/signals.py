"""SIGTERM and SIGHUP as an exception (`errors.Terminated`) in the main thread, so that a command stopped by a
service manager, `timeout` or a closed terminal cleans up as it does for Ctrl-C: an engine worker's session is
killed, a process pool's workers are ended, temporary folders are removed, a conversion's journal stays for the
resume. The command line installs it for the whole command; a library caller that has not can use `scope()`."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from .errors import Terminated

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise(signum, _frame):
    raise Terminated(signum)


def installed() -> bool:
    """Whether SIGTERM already raises Terminated in this process."""
    return signal.getsignal(signal.SIGTERM) is _raise


def raise_on_termination() -> None:
    """Install the handlers for the rest of the process (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _raise)


@contextlib.contextmanager
def scope():
    """Within the block, SIGTERM/SIGHUP raise Terminated; on leaving it, the previous handlers come back and a
    signal that arrived is delivered again to them, so the process ends as it would have (after the block's
    own cleanup). Nothing changes where the handlers are already installed or off the main thread."""
    if installed() or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise) for s in SIGNALS}
    try:
        yield
    except Terminated as t:
        for s, h in old.items():
            signal.signal(s, h)
        old = {}
        os.kill(os.getpid(), t.signum)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
