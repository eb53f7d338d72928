"""Hidden states of all calibration samples between decoder layers: one flat buffer in RAM, a memory-mapped
temporary file when larger than the budget, or (calibrating on a GPU, when they fit there) device memory;
saved and restored whole for a resumable pass."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ..write.writer import write_atomic


class ActivationStore:
    """Hidden states of all calibration samples, [T_i, D] each, in one flat buffer: RAM, or a
    memory-mapped temporary file when larger than the budget (the file is deleted on close), or on
    `device` (an accelerator) when one is given."""

    SAVE_CHUNK = 1 << 26  # bytes copied between the device and the host at once when saving or loading

    def __init__(self, lengths: Sequence[int], hidden: int, dtype: torch.dtype, *, budget_bytes: int,
                 workdir: str | Path | None = None, device: torch.device | str | None = None):
        self.lengths = [int(t) for t in lengths]
        self.hidden = hidden
        self.dtype = dtype
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        tokens = int(self.offsets[-1])
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.nbytes = tokens * hidden * itemsize
        self.path: Path | None = None
        self._mm = None
        self.device = torch.device("cpu") if device is None else torch.device(device)
        if self.device.type != "cpu":
            self.data = torch.empty((tokens, hidden), dtype=dtype, device=self.device)
        elif self.nbytes > budget_bytes:
            fd, name = tempfile.mkstemp(prefix="quantkit-act-", suffix=".bin", dir=workdir)
            os.close(fd)
            self.path = Path(name)
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="w+", shape=(max(self.nbytes, 1),))
            self.data = torch.from_numpy(self._mm)[: self.nbytes].view(dtype).view(tokens, hidden)
        else:
            self.data = torch.empty((tokens, hidden), dtype=dtype)  # [sum T_i, D]

    @property
    def on_disk(self) -> bool:
        return self.path is not None

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:  # [T_i, D] view
        return self.data[self.offsets[i]:self.offsets[i + 1]]

    def __setitem__(self, i: int, value: torch.Tensor):
        self[i].copy_(value)

    def batches(self, batch_tokens: int, only: set[int] | None = None) -> Iterator[tuple[list[int], torch.Tensor]]:
        """(sample indices, [B, T, D]) with equal-length samples grouped (no padding needed): the batches of
        `batch_plan(self.lengths, batch_tokens)`, in order; with `only`, just those batch numbers."""
        for n, chunk in enumerate(batch_plan(self.lengths, batch_tokens)):
            if only is not None and n not in only:
                continue
            t = self.lengths[chunk[0]]
            if chunk == list(range(chunk[0], chunk[0] + len(chunk))):  # contiguous: a view
                x = self.data[self.offsets[chunk[0]]:self.offsets[chunk[-1] + 1]].view(len(chunk), t, -1)
            else:
                x = torch.stack([self[i] for i in chunk])
            yield chunk, x

    def write(self, indices: list[int], x: torch.Tensor):
        for k, i in enumerate(indices):
            self[i] = x[k]

    def _bytes(self) -> memoryview:
        return memoryview(self.data.view(-1).view(torch.uint8).numpy()) if self.nbytes else memoryview(b"")

    def _device_chunks(self, chunk: int) -> Iterator[tuple[int, int]]:
        """Row ranges of about `chunk` bytes (device stores move through the host a chunk at a time)."""
        rows = int(self.data.shape[0]) if self.data is not None else 0
        per = max(1, chunk // max(1, self.hidden * self.data.element_size()))
        for r in range(0, rows, per):
            yield r, min(rows, r + per)

    def save(self, path: str | Path, chunk: int = 1 << 26) -> None:
        """Write the raw buffer to `path` atomically and durably (a reader finds the whole store or none)."""
        if self.device.type != "cpu":
            write_atomic(path, (memoryview(self.data[a:b].cpu().view(-1).view(torch.uint8).numpy())
                                for a, b in self._device_chunks(chunk)))
            return
        buf = self._bytes()
        write_atomic(path, (buf[i:i + chunk] for i in range(0, len(buf), chunk)))

    def load(self, path: str | Path) -> None:
        """Fill this store from a file written by `save` for the same lengths, hidden size and dtype."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != self.nbytes:
                raise ValueError(f"{path}: {size} bytes, expected {self.nbytes}")
            if self.device.type != "cpu":
                for a, b in self._device_chunks(self.SAVE_CHUNK):
                    host = torch.empty((b - a, self.hidden), dtype=self.dtype)
                    _read_exact(f, memoryview(host.view(-1).view(torch.uint8).numpy()), path)
                    self.data[a:b].copy_(host)
                return
            _read_exact(f, self._bytes(), path)

    def save_samples(self, path: str | Path, samples: Sequence[int], chunk: int = 1 << 26) -> None:
        """Write the rows of `samples` (in the order given) to `path`, atomically and durably: the part of
        the store one rank of a distributed pass holds (`load_samples` reads it back)."""
        def parts():
            for i in samples:
                rows = self[i]
                if self.device.type != "cpu":
                    rows = rows.cpu()
                buf = memoryview(rows.contiguous().view(-1).view(torch.uint8).numpy()) if rows.numel() \
                    else memoryview(b"")
                for a in range(0, len(buf), chunk):
                    yield buf[a:a + chunk]
        write_atomic(path, parts())

    def load_samples(self, path: str | Path, samples: Sequence[int]) -> None:
        """Fill the rows of `samples` from a file written by `save_samples` with the same samples (ValueError
        when its size does not fit them)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        want = sum(self.lengths[i] for i in samples) * self.hidden * itemsize
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != want:
                raise ValueError(f"{path}: {size} bytes, expected {want}")
            for i in samples:
                host = torch.empty((self.lengths[i], self.hidden), dtype=self.dtype)
                if host.numel():
                    _read_exact(f, memoryview(host.view(-1).view(torch.uint8).numpy()), path)
                self[i].copy_(host)

    def close(self):
        self.data = None
        if self._mm is not None:
            del self._mm
            self._mm = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


def batch_plan(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """The forward batches of samples of these lengths: equal-length samples grouped (shortest first, each
    length's samples in index order), max(1, batch_tokens // T) samples per batch. A distributed pass
    forwards the same batches, each on one rank, so that every batch is computed as one process computes it."""
    by_len: dict[int, list[int]] = {}
    for i, t in enumerate(lengths):
        by_len.setdefault(int(t), []).append(i)
    plan = []
    for t in sorted(by_len):
        idx = by_len[t]
        b = max(1, batch_tokens // max(t, 1))
        plan.extend(idx[j:j + b] for j in range(0, len(idx), b))
    return plan


def _read_exact(f, buf: memoryview, path) -> None:
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:])
        if not n:
            raise ValueError(f"{path}: short read")
        got += n
