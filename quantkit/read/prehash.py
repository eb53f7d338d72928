"""sha256 of the source shards, started before the heavy imports.

`quantkit convert` must record every source shard's sha256, which costs ~0.65 s of CPU per GB here
(more than the rest of an RTN conversion). Importing torch takes seconds of mostly single-threaded
CPU, so the CLI calls `start(src_dir)` first: a background thread hashes the shards (hashlib and
file reads release the GIL) while the interpreter imports, and convert's `sha256(path)` picks up the
result. A digest is used only if the file's size and mtime are still those it had when hashing began
(and is re-checked after), otherwise the file is hashed again. Imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future
from pathlib import Path

_CHUNK = 8 << 20
_lock = threading.Lock()
_jobs: dict[str, tuple[tuple[int, int], Future]] = {}


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _hash_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def start(src_dir: str | os.PathLike, rank: int = 0, size: int = 1) -> None:
    """Hash every `*.safetensors` directly in `src_dir` (regular files only), in name order, on one
    daemon thread. Best effort: anything odd is left for convert to hash (and to report).

    Rank `rank` of `size` (a torchrun job) hashes only the shards it will convert: convert gives each rank its
    share by `dist.balance` of the shard sizes in name order, computed here the same way, so no shard is
    hashed by two ranks (on a node of 8 ranks, not 8 times its checkpoint's bytes). Where the shares differ
    after all (a resumed job's remaining shards, a stray file), convert hashes what it lacks itself."""
    try:
        entries = sorted((e.name, e.stat(follow_symlinks=False).st_size) for e in os.scandir(src_dir)
                         if e.name.endswith(".safetensors") and e.is_file(follow_symlinks=False))
    except OSError:
        return
    names = [n for n, _ in entries]
    if size > 1:
        from ..dist import balance

        names = [n for (n, _), r in zip(entries, balance([b for _, b in entries], size)) if r == rank]
    todo = []
    with _lock:
        for name in names:
            p = str(Path(src_dir, name).resolve())
            if p in _jobs:
                continue
            try:
                stamp = _stamp(p)
            except OSError:
                continue
            fut: Future = Future()
            _jobs[p] = (stamp, fut)
            todo.append((p, fut))

    def run():
        for p, fut in todo:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(_hash_file(p))
            except BaseException as e:  # noqa: BLE001 - handed to whoever asks
                fut.set_exception(e)

    if todo:
        threading.Thread(target=run, name="quantkit-prehash", daemon=True).start()


def sha256(path: str | os.PathLike) -> str:
    """sha256 of `path`: the background digest when it is of the file as it is now, else hashed here."""
    p = str(Path(path).resolve())
    with _lock:
        job = _jobs.pop(p, None)
    if job is not None:
        stamp, fut = job
        try:
            digest = fut.result()
            if _stamp(p) == stamp:
                return digest
        except OSError:
            pass
    return _hash_file(p)
