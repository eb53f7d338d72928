"""The command-line harness shared by the tests that run `quantkit` as users do: commands run in
processes forked from a small server that has already imported quantkit (and torch), so each costs a fork
instead of a 3-5 s interpreter start; the child calls `quantkit.cli.main(argv)`, exactly what the
`quantkit` console script does, with its own stdout/stderr, exit status, environment, resource limits
and fault injection (tests/read/test_hostile.py checks it against a real `python -m quantkit.cli`)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from quantkit.convert import MANIFEST_NAME

# ---- the fork server --------------------------------------------------------------------------------
# Protocol: one JSON request per line on stdin, one JSON reply per line on stdout.
# request: {argv, stdout, stderr, env, fsize, faults: {kill_at, log, action} | null,
#           killpg_when_journal: [journal dir, n] | null}
# reply:   {rc, timed_out}  (rc negative: killed by that signal, as subprocess reports it)
# A child that runs past `timeout` seconds is sent SIGUSR1 (faulthandler dumps every thread's stack into its
# stderr file), then SIGKILL with its process group: a hang fails that one test with the stacks, never the run.
SERVER = r'''
import faulthandler, json, os, resource, signal, sys, time, traceback
import quantkit.cli, quantkit.convert, quantkit.write.writer  # torch etc. imported once, before any fork


def install_faults(kill_at, log, action="kill"):
    """Count I/O events (a shard write, each side of a rename, each side of rmtree) and at event number
    `kill_at` (1-based) either SIGKILL this process (a shard write is cut in half first: a torn file) or,
    action "enospc", fail that operation with ENOSPC as a full disk would."""
    import errno, shutil
    w = quantkit.write.writer
    count = [0]
    logf = open(log, "a") if log else None

    def label(p):
        p = str(p)
        return os.path.basename(os.path.dirname(p)) + "/" + os.path.basename(p)

    def event(what, before_kill=None):
        count[0] += 1
        if logf:
            logf.write(what + "\n")
            logf.flush()
        if count[0] == kill_at:
            if action == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if before_kill:
                before_kill()
            os.kill(os.getpid(), signal.SIGKILL)

    real_replace, real_rmtree, real_emit = os.replace, shutil.rmtree, w.ShardWriter._emit

    def replace(a, b, *args, **kw):
        event("before-replace " + label(b))
        real_replace(a, b, *args, **kw)
        event("after-replace " + label(b))

    def rmtree(p, *args, **kw):
        event("before-rmtree " + label(p))
        real_rmtree(p, *args, **kw)
        event("after-rmtree " + label(p))

    def emit(self, data):
        mv = memoryview(data).cast("B")

        def torn():
            real_emit(self, mv[: len(mv) // 2])
            self._f.flush()

        event("emit " + self.path.name, torn)
        real_emit(self, data)

    os.replace, shutil.rmtree, w.ShardWriter._emit = replace, rmtree, emit


def child(req):
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.update(req.get("env") or {})
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the server asks for the stacks of a hung child
    if req.get("fsize"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
    if req.get("faults"):
        install_faults(req["faults"]["kill_at"], req["faults"].get("log"), req["faults"].get("action", "kill"))
    code = 0
    try:
        quantkit.cli.main(req["argv"])
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()  # what the interpreter would print for an uncaught exception
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def journal_count(d):
    try:
        return sum(1 for n in os.listdir(d) if n.endswith(".json"))
    except OSError:
        return 0


for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()  # its own process group, so that its worker processes die with it
        try:
            child(req)
        finally:
            os._exit(99)
    watch = req.get("killpg_when_journal")
    deadline = time.monotonic() + float(req.get("timeout") or 600)
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if watch and journal_count(watch[0]) >= watch[1]:
            os.killpg(pid, signal.SIGKILL)
            watch = None
        if not timed_out and time.monotonic() > deadline:
            timed_out = True
            os.kill(pid, signal.SIGUSR1)
            time.sleep(2)
            os.killpg(pid, signal.SIGKILL)
        time.sleep(0.005)
    sys.stdout.write(json.dumps({"rc": os.waitstatus_to_exitcode(status), "timed_out": timed_out}) + "\n")
    sys.stdout.flush()
'''


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str


class ForkCli:
    """`quantkit` commands run in processes forked from one pre-imported server (see module doc)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        env = {k: v for k, v in os.environ.items() if k != "QUANTKIT_DEBUG"}
        env.update(TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=str(workdir))
        self.lock = threading.Lock()
        self.n = 0

    def run(self, *argv, env=None, fsize=None, faults=None, killpg_when_journal=None, timeout=600) -> Result:
        with self.lock:
            self.n += 1
            out, err = self.workdir / f"{self.n}.out", self.workdir / f"{self.n}.err"
            req = {"argv": [str(a) for a in argv], "stdout": str(out), "stderr": str(err), "env": env or {},
                   "fsize": fsize, "faults": faults, "timeout": timeout,
                   "killpg_when_journal": [str(killpg_when_journal[0]), killpg_when_journal[1]]
                   if killpg_when_journal else None}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            assert line, "the fork server died"
            reply = json.loads(line)
            r = Result(reply["rc"], out.read_text(errors="replace"), err.read_text(errors="replace"))
            assert not reply.get("timed_out"), (f"`quantkit {' '.join(req['argv'])}` ran over {timeout} s and was "
                                                f"killed; its stacks and stderr:\n{r.stderr[-6000:]}")
            return r

    def convert(self, src, out, *args, **kw) -> Result:
        return self.run("convert", src, out, *args, **kw)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_SERVER: ForkCli | None = None


def fork_cli(tmp_path_factory) -> ForkCli:
    global _SERVER
    if _SERVER is None:
        _SERVER = ForkCli(tmp_path_factory.mktemp("forkcli"))
        atexit.register(_SERVER.close)
    return _SERVER


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> ForkCli:
    return fork_cli(tmp_path_factory)


@pytest.fixture(scope="module")
def src18(tiny_models) -> Path:
    """qwen3_moe, 4 layers, 18 source shards of <= 100 KB: many independent units of work."""
    return tiny_models("qwen3_moe", max_shard_size="100KB", layers=4)


@pytest.fixture(scope="module")
def reference(cli, src18, tmp_path_factory):
    """An uninterrupted conversion of src18 and the I/O events it made (one label per line)."""
    d = tmp_path_factory.mktemp("reference")
    log = d / "events.log"
    r = cli.convert(src18, d / "out", faults={"kill_at": 0, "log": str(log)})
    assert r.rc == 0, r.stderr
    return d / "out", log.read_text().splitlines()


def run_bounded(cmd, *, timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) in a process group of its own: past `timeout`
    the whole group is killed (subprocess.run kills only the direct child, and then waits for pipes that its
    children may hold open forever: torchrun's workers, a browser's helpers) and the test fails."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            try:
                out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a child that left the group still holds a pipe
                out, err = "", ""
            raise AssertionError(f"{' '.join(map(str, cmd))[:300]} ran over {timeout} s; its process group was "
                                 f"killed; stderr:\n{(err or '')[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones included) -> its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def manifest_status(out: Path) -> str | None:
    p = out / MANIFEST_NAME
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text()).get("status")
    except ValueError:
        return "unreadable"


def assert_clean_failure(r: Result, out: Path, hint: str | None = None, was_complete: bool = False) -> str:
    """The CLI contract for a domain failure; returns the error line. Unless OUT held a complete
    conversion before the command (`was_complete`), it must not look complete after it."""
    assert r.rc == 1, (r.rc, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout == "", r.stdout  # --json: no result object for a failed run
    # progress bar lines (rich renders the bar once on a non-terminal) aside, exactly: error [+ hint]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "━" not in ln and not ln.startswith("converting")]
    assert len(lines) in (1, 2) and lines[0].startswith("error: "), r.stderr
    assert len(lines) == 1 or lines[1].startswith("hint: "), r.stderr
    if hint is not None:
        assert lines[-1] == f"hint: {hint}", r.stderr
    assert (manifest_status(out) == "complete") == was_complete
    if out.is_dir():
        assert not [p for p in out.rglob("*.tmp")], "a temporary file was left behind"
    return lines[0]




GROUP48 = ("name: g48\ngroups:\n  experts:\n    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']\n"
           "    scheme: {group_size: 48}\n")
