"""The one tensor reader: tensors of a checkpoint by name, expert slices of fused tensors, and stored-
quantized weights decoded to floats (block/channel/tensor FP8 and pack-quantized INT4).

Two ways to read, one interface:
- mapped (convert, verify, the runtime): zero-copy views of each shard's memory map. Streaming a shard
  through the page cache costs no copy; `release()` drops every mapping (verify does it per shard).
- positioned (`mapped=False`, the calibration executor): each tensor is read with pread into fresh
  memory. Mapped pages would count towards the process's resident memory until the mapping goes; a
  read holds exactly one tensor's bytes.

Headers are validated before a reader sees them (read/safetensors.py): offsets and sizes lie inside the
file. Not here: deciding what a tensor means (read/sources.py) or where it goes (match/).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ..errors import TruncatedShard
from ..pack.fp4 import dequantize_module as fp4_module
from ..pack.int4 import dequantize_module
from ..quant.fp8 import FP8Layout, dequantize as fp8_dequantize, is_power_of_two
from .safetensors import Header, SafetensorsFile, read_header


class TensorReader:
    """Tensors of one checkpoint. `location`: tensor name -> shard file name (inside `root`); `headers`:
    shard file name -> validated Header, read on first use when not given."""

    def __init__(self, root: str | os.PathLike, location: Mapping[str, str],
                 headers: Mapping[str, Header] | None = None, *, mapped: bool = True, rotation=None):
        self.root = Path(root)
        # a read.rotate.Rotation: the tensors it touches are handed out turned (float32 math, their dtype once)
        self.rotation = rotation
        self.location = location
        self._headers = dict(headers or {})
        self.mapped = mapped
        self._files: dict[str, SafetensorsFile] = {}
        self._fds: dict[str, int] = {}

    @classmethod
    def of(cls, ckpt, *, mapped: bool = True) -> "TensorReader":
        """A reader over a read.checkpoint.Checkpoint (turned by the checkpoint's rotation, if it has one)."""
        return cls(ckpt.root, ckpt.location, {s.name: s.header for s in ckpt.shards}, mapped=mapped,
                   rotation=getattr(ckpt, "rotation", None))

    # -- plumbing -------------------------------------------------------------------------------------
    def header(self, shard: str) -> Header:
        h = self._headers.get(shard)
        if h is None:
            h = self._headers[shard] = read_header(self.root / shard)
        return h

    def _file(self, shard: str) -> SafetensorsFile:
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = SafetensorsFile(self.header(shard))
        return f

    def _fd(self, shard: str) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(self.root / shard, os.O_RDONLY)
        return fd

    def _pread(self, shard: str, nbytes: int, offset: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        while done < nbytes:
            n = os.preadv(self._fd(shard), [view[done:]], offset + done)
            if n <= 0:
                raise TruncatedShard(f"{shard}: short read at byte {offset + done}: the shard changed on disk")
            done += n
        return buf

    # -- reads ----------------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.location

    def info(self, name: str):
        return self.header(self.location[name]).tensors[name]

    def turns(self, name: str) -> bool:
        """Whether the rotation turns tensor `name` (as `get` and `view` hand it out)."""
        return self._turns(name, self.info(name).dtype)

    def _turns(self, name: str, dtype: torch.dtype) -> bool:
        """The rotation turns tensor `name` as read (a float; FP8 codes are turned after decoding)."""
        return self.rotation is not None and dtype.is_floating_point and dtype.itemsize > 1 \
            and self.rotation.touches(name)

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name`: a view of the mapping (mapped), or a fresh tensor (positioned); a fresh tensor, turned,
        when the rotation touches it."""
        t = self._get(name)
        return self.rotation.rotated(name, t) if self._turns(name, t.dtype) else t

    def _get(self, name: str) -> torch.Tensor:
        shard = self.location[name]
        if self.mapped:
            return self._file(shard).get(name, copy=False)
        h = self.header(shard)
        info = h.tensors[name]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        return self._pread(shard, info.nbytes, h.data_start + info.begin).view(info.dtype).reshape(info.shape)

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """table[index] for a 2-D tensor (embeddings), reading only the distinct rows used."""
        shard = self.location[name]
        h = self.header(shard)
        info = h.tensors[name]
        uniq, inverse = torch.unique(index, return_inverse=True)
        row_bytes = info.nbytes // info.shape[0]
        out = torch.empty((len(uniq), row_bytes), dtype=torch.uint8)
        for j, r in enumerate(uniq.tolist()):
            out[j] = self._pread(shard, row_bytes, h.data_start + info.begin + r * row_bytes)
        t = out.view(info.dtype)
        if self._turns(name, t.dtype):  # embedding rows: each row turned on its own (E Q)
            t = self.rotation.rotated(name, t)
        return t[inverse]  # [*index.shape, D]

    def view(self, name: str, expert: int | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name`, or expert `expert` of a fused [E, N, K] tensor, or rows r0:r1 of either (a turned
        expert alone, when the rotation touches it)."""
        t = self._get(name)
        if expert is not None:
            t = t[expert]
        if self._turns(name, t.dtype):
            t = self.rotation.rotated(name, t)
        if rows is not None:
            t = t[rows[0]:rows[1]]
        return t

    def read_into(self, name: str, out: torch.Tensor, expert: int | None = None,
                  rows: tuple[int, int] | None = None) -> None:
        """`out` [N, K] <- `view(name, expert, rows)`. When the slice is one byte range of the file in
        `out`'s dtype it is read in place by positioned reads (no page faults on a mapping)."""
        info = self.info(name)
        shape = info.shape[1:] if expert is not None else info.shape
        if rows is not None:
            shape = (rows[1] - rows[0], *shape[1:])
        if (self.mapped and info.dtype == out.dtype and out.is_contiguous() and tuple(out.shape) == tuple(shape)
                and not self._turns(name, info.dtype)):
            per_expert = info.nbytes // info.shape[0] if expert is not None else 0
            row = info.shape[-1] * out.element_size()
            offset = (expert or 0) * per_expert + (rows[0] * row if rows is not None else 0)
            self._file(self.location[name]).readinto(name, out, offset)
            return
        if (self._turns(name, info.dtype) and out.dtype == info.dtype and out.is_contiguous()
                and (rows is None or self.rotation.by_rows(name))):
            t = self._get(name)  # turned straight into `out` (cast once, as `view`): no turned copy of the whole
            t = t[expert] if expert is not None else t  # tensor first
            t = t[rows[0]:rows[1]] if rows is not None else t
            if tuple(t.shape) == tuple(out.shape):
                self.rotation.rotated(name, t, out.dtype, out=out)
                return
        out.copy_(self.view(name, expert, rows))

    def decode(self, sw, dtype: torch.dtype = torch.float32, notes=None,
               device: torch.device | str | None = None) -> torch.Tensor:
        """The float weight [N, K] of a module the source stores quantized (a read.sources.StoredWeight):
        FP8 as q.float() * scale (per tensor / row / block, edge blocks partial), INT4 as (q - zp) * scale,
        NVFP4 / MXFP4 as e2m1 * the group's scale; returned in `dtype`. With `device`, the stored tensors are
        moved there first and decoded there (the same arithmetic, on e.g. a GPU)."""
        get = self._get if device is None else (lambda name: self._get(name).to(device))
        if sw.encoding == "int4":
            return dequantize_module({suffix: get(t) for suffix, t in sw.tensors}, dtype,
                                     int(sw.weights.get("num_bits", 4)))
        if sw.encoding in ("nvfp4", "mxfp4"):
            return fp4_module(sw.encoding, {suffix: get(t) for suffix, t in sw.tensors}, dtype)
        scale = read_scale(get, sw.scale, sw.layout, sw.scale_fmt, notes)
        name = sw.module + ".weight"
        if self.rotation is not None and self.rotation.touches(name):  # decoded in float32, turned, cast once
            w = fp8_dequantize(get(sw.primary), scale, sw.layout, torch.float32)
            return self.rotation.rotated(name, w.cpu(), dtype).to(w.device)
        return fp8_dequantize(get(sw.primary), scale, sw.layout, dtype)

    def turned(self, name: str, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A module's decoded float weight `w` (float32, e.g. an FP8 module dequantized by the caller) as the
        rotation turns tensor `name`, in `dtype`; `w` itself in `dtype` when nothing turns it."""
        if self.rotation is not None and self.rotation.touches(name):
            return self.rotation.rotated(name, w, dtype)
        return w.to(dtype)

    # -- lifetime -------------------------------------------------------------------------------------
    def release(self) -> None:
        """Drop every mapping and descriptor (a later read opens them again)."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    close = release

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_scale(get: Callable[[str], torch.Tensor], name: str, layout: FP8Layout, scale_fmt: str | None = None,
               notes=None) -> torch.Tensor:
    """The float32 scale tensor `name` of an FP8 weight (e8m0/bf16 widened exactly), shaped as `layout`
    says. With `scale_fmt: ue8m0` the scales must be powers of two; a scale that is not is recorded in
    `notes` (a read.sources.Notes; the weight still dequantizes correctly: the math is a multiplication either
    way)."""
    s = get(name).float()
    if layout.strategy == "tensor":
        s = s.reshape(1)
    if scale_fmt == "ue8m0" and notes is not None and not is_power_of_two(s):
        notes.add(f"{name}: config says scale_fmt ue8m0, but not every scale is a power of two "
                  "(dequantized by multiplication all the same)")
    return s
