"""Atomic, streamed output: a safetensors shard written tensor by tensor under a temporary name, hashed
on the fly and renamed into place only when complete; JSON files written the same way.

The header is computed up front from the planned shapes, so memory stays bounded by the tensor being
written rather than the shard. Output is deterministic: same tensors in the same order -> same bytes.

Hashing and writing run on a background thread (both release the GIL), in order, while the caller
computes the next tensors; at most `QUEUE_BYTES` wait in between. Shard data is fsynced in the
background too (`durable()` waits for it): a finished shard is renamed into place at once, and before
anything claims the output complete, `wait_durable()` makes every shard durable. Resume re-hashes
journaled shards, so one lost to a power cut before its fsync is simply redone.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import torch

from ..errors import DiskFull, UnsupportedDtype
from ..read.safetensors import CODE_OF, ELEMENT_SIZE

QUEUE_BYTES = 64 << 20  # tensors handed to the writer thread and not yet written (one larger one may wait alone)

_fsyncs: list[Future] = []
_fsync_pool: ThreadPoolExecutor | None = None


def fsync_path(path: Path) -> None:
    """fsync a written file and its directory entry."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(path.parent)


def durable(path: Path) -> None:
    """Schedule `path` (a finished, renamed shard) and its directory entry to be fsynced."""
    global _fsync_pool
    if _fsync_pool is None:
        _fsync_pool = ThreadPoolExecutor(1, thread_name_prefix="quantkit-fsync")
    _fsyncs.append(_fsync_pool.submit(fsync_path, path))


def wait_durable() -> None:
    """Block until every shard scheduled by `durable` is on disk; re-raise the first failure."""
    while _fsyncs:
        f = _fsyncs.pop(0)
        try:
            f.result()
        except OSError as e:
            raise (_disk_full(e, Path(e.filename or "output")) or e) from None


def tmp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp")


def _disk_full(e: OSError, path: Path):
    """ENOSPC/EDQUOT (disk or quota full) and EFBIG (file size limit, e.g. `ulimit -f`) -> DiskFull."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DiskFull(f"no space left writing {path.name} ({os.strerror(e.errno)})")
    return None


def _fsync_dir(d: Path) -> None:
    """Make a rename in `d` durable (POSIX: the new directory entry survives a power cut only once the
    directory itself is synced). Best effort: some filesystems refuse fsync on directories."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class ShardWriter:
    """Write a safetensors file whose tensor list is known in advance: `ShardWriter(path, specs)`,
    then `write(name, tensor)` in the order of `specs`, then `finish()` -> (sha256, size)."""

    def __init__(self, path: str | os.PathLike, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.tmp = tmp_name(self.path)
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self._order = []
        for name, dtype, shape in specs:
            if dtype not in CODE_OF:
                raise UnsupportedDtype(f"cannot write tensor {name!r} of dtype {dtype}")
            n = ELEMENT_SIZE[dtype]
            for s in shape:
                n *= s
            header[name] = {"dtype": CODE_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._order.append((name, dtype, tuple(shape), n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((8 - len(raw) % 8) % 8)  # align the buffer to 8 bytes
        self.size = 8 + len(raw) + offset
        self._next = 0
        self._hash = hashlib.sha256()
        self._f = None
        self._cv = threading.Condition()
        self._queue: list = []  # memoryviews (each keeps its tensor alive) waiting for the writer thread
        self._queued = 0  # their bytes
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        try:
            self._f = open(self.tmp, "wb")
            self._emit(struct.pack("<Q", len(raw)) + raw)
        except OSError as e:
            self.abort()  # no half-written temporary left behind, no open file
            raise (_disk_full(e, self.path) or e) from None

    def _emit(self, data) -> None:
        self._hash.update(data)
        self._f.write(data)

    def write(self, name: str, t: torch.Tensor) -> None:
        exp_name, dtype, shape, n = self._order[self._next]
        if name != exp_name or t.dtype != dtype or tuple(t.shape) != shape:
            raise AssertionError(f"shard writer expected {exp_name} {dtype} {shape}, got {name} {t.dtype} {tuple(t.shape)}")
        self._next += 1
        if n:
            data = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            self._put(data)

    # ---- the writer thread ----
    def _put(self, data) -> None:
        with self._cv:
            while self._queue and self._queued + len(data) > QUEUE_BYTES and self._error is None:
                self._cv.wait()
            err = self._error
            if err is None:
                self._queue.append(data)
                self._queued += len(data)
                self._cv.notify_all()
        if err is not None:
            self._fail(err)
        if self._thread is None:
            self._thread = threading.Thread(target=self._drain, name=f"quantkit-write-{self.path.name}", daemon=True)
            self._thread.start()

    def _drain(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                data = self._queue[0]
            if data is None:
                return
            try:
                self._emit(data)
            except BaseException as e:  # handed to the caller at its next write/finish
                with self._cv:
                    self._error = e
                    self._queue.clear()
                    self._queued = 0
                    self._cv.notify_all()
                return
            with self._cv:
                # abort() may have emptied the queue (and queued its end marker) while this was written
                if self._queue and self._queue[0] is data:
                    self._queue.pop(0)
                    self._queued -= len(data)
                self._cv.notify_all()

    def _join(self) -> None:
        """Wait until every queued tensor is written (or the writer thread failed)."""
        if self._thread is None:
            return
        with self._cv:
            self._queue.append(None)
            self._cv.notify_all()
        self._thread.join()
        self._thread = None

    def _fail(self, err: BaseException):
        self.abort()
        if isinstance(err, OSError):
            raise (_disk_full(err, self.path) or err) from None
        raise err

    def finish(self) -> tuple[str, int]:
        """Write what is queued, rename the shard into place and schedule its fsync (see `durable`)."""
        if self._next != len(self._order):
            raise AssertionError(f"shard {self.path.name}: {len(self._order) - self._next} tensors not written")
        self._join()
        if self._error is not None:
            self._fail(self._error)
        try:
            self._f.flush()
            self._f.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise (_disk_full(e, self.path) or e) from None
        durable(self.path)
        return self._hash.hexdigest(), self.size

    def abort(self) -> None:
        if self._thread is not None:
            with self._cv:
                self._queue.clear()
                self._queued = 0
                self._queue.append(None)
                self._cv.notify_all()
            self._thread.join()
            self._thread = None
        if self._f is not None:
            try:
                self._f.close()  # may flush buffered bytes and fail again on a full disk
            except OSError:
                pass
        try:
            self.tmp.unlink(missing_ok=True)
        except OSError:
            pass


def write_atomic(path: str | os.PathLike, parts: Iterable, durable: bool = True) -> None:
    """Write the byte strings `parts` to `path` under a temporary name and rename it into place: readers
    see the old file or the new one, never a torn one. durable also fsyncs the data and the directory
    entry. A full disk is DiskFull; the temporary is removed when writing fails."""
    path = Path(path)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise (_disk_full(e, path) or e) from None
    if durable:
        _fsync_dir(path.parent)


def write_json_atomic(path: str | os.PathLike, doc, indent: int | None = 2, durable: bool = True) -> None:
    """Write JSON atomically (`write_atomic`). durable=False skips the fsyncs, for records whose loss in a
    power cut only costs redoing work (journal entries, the in-progress manifest)."""
    data = (json.dumps(doc, indent=indent, sort_keys=False, ensure_ascii=False) + "\n").encode()
    write_atomic(path, [data], durable)


def copy_file_atomic(src: Path, dst: Path) -> None:
    with open(src, "rb") as fi:
        write_atomic(dst, iter(lambda: fi.read(8 << 20), b""))


def sha256_file(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> int:
    """Write `tensors` (in the given order) as safetensors to `path`; return bytes written.
    The header is padded with spaces to a multiple of 8 bytes, as the reference writer does, so that
    every tensor is aligned. Deterministic: same tensors and order -> same bytes."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    blobs = []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        code = CODE_OF.get(t.dtype)
        if code is None:
            raise UnsupportedDtype(f"cannot write tensor {name!r} of dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        blobs.append(t)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in blobs:
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset
