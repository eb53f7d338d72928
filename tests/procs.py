"""No test leaves a process behind: the guard every test runs under (tests/conftest.py).

The test session becomes a child subreaper (Linux prctl PR_SET_CHILD_SUBREAPER), so a process orphaned by a
command (a worker whose parent exited, a daemonized grandchild) is re-parented to pytest instead of init and
stays visible as a descendant. Before each test (after the module- and session-scoped fixtures, whose
long-lived servers are the test's context) the live descendants are listed; after its teardown, any new one
still running a few seconds later is killed and the test fails naming it. Zombies are not processes left
running (they hold no resources but a table slot) and are left alone."""

from __future__ import annotations

import ctypes
import os
import signal
import time

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 5.0  # how long a process the test started may take to exit after its teardown


def become_subreaper() -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process /proc shows."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
        except OSError:
            continue
        rest = raw[raw.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
        out[int(name)] = (int(rest[1]), rest[0])
    return out


def live_descendants(root: int | None = None) -> set[int]:
    """Descendants of `root` (default: this process) that are not zombies."""
    root = os.getpid() if root is None else root
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return {p for p in out if table.get(p, (0, "Z"))[1] not in ("Z", "X")}


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200] or "?"
    except OSError:
        return "(gone)"


# Helpers of the test process itself, one per process and ending with it (not something a test left behind):
# multiprocessing's resource tracker and fork server, started on first use of a spawn/forkserver pool.
SESSION_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _not_session_helpers(pids: set[int]) -> set[int]:
    """`pids` without this process's own multiprocessing helpers (children of it running SESSION_HELPERS)."""
    table = _table()
    return {p for p in pids if not (table.get(p, (0, ""))[0] == os.getpid()
                                    and any(h in cmdline(p) for h in SESSION_HELPERS))}


def leftovers(before: set[int], grace_s: float = GRACE_S) -> dict[int, str]:
    """New live descendants that outlive `grace_s`: killed (their whole process group, where they lead one),
    and returned as pid -> command line. The test process's own multiprocessing helpers are not counted."""
    deadline = time.monotonic() + grace_s
    while True:
        new = _not_session_helpers(live_descendants() - before)
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    found = {p: cmdline(p) for p in sorted(new)}
    for p in found:
        for kill in (lambda: os.killpg(p, signal.SIGKILL) if os.getpgid(p) == p else None,
                     lambda: os.kill(p, signal.SIGKILL)):
            try:
                kill()
            except OSError:
                pass
    return found
