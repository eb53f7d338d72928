"""Atomic, streamed output: a safetensors shard written tensor by tensor under a temporary name, hashed
on the fly and renamed into place only when complete; JSON files written the same way.

The header is computed up front from the planned shapes, so memory stays bounded by the tensor being
written rather than the shard. Output is deterministic: same tensors in the same order -> same bytes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from ..errors import DiskFull, UnsupportedDtype
from .safetensors import CODE_OF

ELEMENT_SIZE = {dt: torch.empty(0, dtype=dt).element_size() for dt in CODE_OF}


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
            try:
                self._emit(data)
            except OSError as e:
                self.abort()
                raise (_disk_full(e, self.path) or e) from None

    def finish(self) -> tuple[str, int]:
        if self._next != len(self._order):
            raise AssertionError(f"shard {self.path.name}: {len(self._order) - self._next} tensors not written")
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise (_disk_full(e, self.path) or e) from None
        _fsync_dir(self.path.parent)
        return self._hash.hexdigest(), self.size

    def abort(self) -> None:
        if self._f is not None:
            try:
                self._f.close()  # may flush buffered bytes and fail again on a full disk
            except OSError:
                pass
        try:
            self.tmp.unlink(missing_ok=True)
        except OSError:
            pass


def write_json_atomic(path: str | os.PathLike, doc, indent: int | None = 2) -> None:
    path = Path(path)
    tmp = tmp_name(path)
    data = (json.dumps(doc, indent=indent, sort_keys=False, ensure_ascii=False) + "\n").encode()
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise (_disk_full(e, path) or e) from None
    _fsync_dir(path.parent)


def copy_file_atomic(src: Path, dst: Path) -> None:
    tmp = tmp_name(dst)
    try:
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            while chunk := fi.read(8 << 20):
                fo.write(chunk)
            fo.flush()
            os.fsync(fo.fileno())
        os.replace(tmp, dst)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise (_disk_full(e, dst) or e) from None
    _fsync_dir(dst.parent)


def sha256_file(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()
