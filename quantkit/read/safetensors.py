"""A validating safetensors reader. Headers are parsed and checked here before any tensor byte is read.

Format (https://github.com/huggingface/safetensors, "Format"): 8-byte little-endian u64 N, N bytes of
UTF-8 JSON `{name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {str: str}}`, then the
byte buffer. Offsets are relative to the buffer. We require what the reference implementation requires
(header cap, exact sizes, full contiguous coverage with no holes or overlap) and treat every field as
hostile: sizes are computed with Python ints (no overflow) and compared to the real file size.

Reads are lazy: `SafetensorsFile.get(name)` maps the file (mmap) and returns a tensor viewing just that
tensor's bytes (copy-on-write, so torch never sees a read-only buffer); `close()` drops the mapping and
with it the resident pages.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import (DuplicateKey, HeaderError, HeaderNotJSON, HeaderTooLarge, InvalidOffsets, TensorSizeMismatch,
                      TruncatedShard, UnsupportedDtype)

MAX_HEADER_BYTES = 100_000_000  # the reference implementation's cap
MAX_TENSORS = 1_000_000
MAX_NDIM = 16

# safetensors dtype code -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2), "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
    "U16": (torch.uint16, 2), "U32": (torch.uint32, 4), "U64": (torch.uint64, 8),
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = (torch.float8_e8m0fnu, 1)
CODE_OF: dict[torch.dtype, str] = {dt: code for code, (dt, _) in DTYPES.items()}
ELEMENT_SIZE: dict[torch.dtype, int] = {dt: size for dt, size in DTYPES.values()}  # bytes an element


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offset in the buffer
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorInfo]  # in file (offset) order
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the buffer
    file_size: int


def _short(x, limit: int = 80) -> str:
    """repr() of hostile header content, cut so that an error message stays one short line."""
    r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object_pairs_hook: a repeated key is an error (readers disagree on which entry wins)."""
    d = {}
    for k, v in pairs:
        if k in d:
            raise DuplicateKey(f"key {_short(k)} appears twice in one JSON object")
        d[k] = v
    return d


def parse_header_bytes(raw: bytes, file_size: int, where: str = "<bytes>") -> Header:
    """Validate `raw` (the start of a file of `file_size` bytes; at least 8 bytes, ideally the whole
    header) and return its Header. Pure, so it can be fuzzed without touching disk. Raises only
    HeaderError (or a subclass) and UnsupportedDtype."""
    if file_size < 8 or len(raw) < 8:
        raise TruncatedShard(f"{where}: file is {file_size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > MAX_HEADER_BYTES:
        raise HeaderTooLarge(f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > file_size:
        raise TruncatedShard(f"{where}: header length {n} runs past the end of the {file_size}-byte file")
    if len(raw) < 8 + n:
        raise TruncatedShard(f"{where}: header is incomplete")
    try:
        doc = json.loads(raw[8:8 + n].decode("utf-8"), object_pairs_hook=_unique_keys)
    except DuplicateKey as e:
        raise DuplicateKey(f"{where}: header {e.message}") from None
    # ValueError covers JSONDecodeError and integers with more digits than Python converts (4300)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise HeaderNotJSON(f"{where}: header is not valid UTF-8 JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise HeaderNotJSON(f"{where}: header is not a JSON object")
    meta = doc.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise HeaderError(f"{where}: __metadata__ must map strings to strings")
    if len(doc) > MAX_TENSORS:
        raise HeaderError(f"{where}: {len(doc)} tensors exceeds the {MAX_TENSORS} cap")
    infos = []
    for name, t in doc.items():
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise HeaderError(f"{where}: tensor {_short(name)} entry must have exactly dtype, shape, data_offsets")
        code, shape, offs = t["dtype"], t["shape"], t["data_offsets"]
        if not isinstance(code, str) or code not in DTYPES:
            raise UnsupportedDtype(f"{where}: tensor {_short(name)} has unsupported dtype {_short(code, 40)}")
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(type(s) is int and s >= 0 for s in shape)):
            raise HeaderError(f"{where}: tensor {_short(name)} has an invalid shape {_short(shape)}",
                              hint=f"a shape is a list of at most {MAX_NDIM} non-negative integers; the shard is corrupt")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int and o >= 0 for o in offs)
                or offs[0] > offs[1]):
            raise InvalidOffsets(f"{where}: tensor {_short(name)} has invalid data_offsets {_short(offs)}")
        numel = 1
        for s in shape:
            numel *= s  # Python ints: no overflow
        dtype, size = DTYPES[code]
        if numel * size != offs[1] - offs[0]:
            raise TensorSizeMismatch(f"{where}: tensor {_short(name)} {code}{_short(shape)} needs {numel * size} "
                                     f"bytes, data_offsets give {offs[1] - offs[0]}")
        infos.append(TensorInfo(name, dtype, tuple(shape), offs[0], offs[1]))
    infos.sort(key=lambda i: (i.begin, i.end))
    pos = 0
    for i in infos:
        if i.begin != pos:
            kind = "overlaps the previous tensor" if i.begin < pos else "leaves a hole before it"
            raise InvalidOffsets(f"{where}: tensor {_short(i.name)} at offset {i.begin} {kind} (expected {pos})")
        pos = i.end
    data_start = 8 + n
    if data_start + pos > file_size:
        # either the file was cut short or the offsets point past its end: the same thing to a reader
        raise TruncatedShard(f"{where}: tensors need {pos} bytes of data, file has {file_size - data_start}")
    if data_start + pos != file_size:
        raise InvalidOffsets(f"{where}: {file_size - data_start - pos} trailing bytes after the last tensor")
    return Header(Path(where), {i.name: i for i in infos}, meta, data_start, file_size)


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate the header of one .safetensors file (reads only the header bytes)."""
    path = Path(path)
    where = path.name if path.name.isprintable() else repr(path.name)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO must not block
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise HeaderError(f"{where} is not a regular file (a FIFO, device or directory)")
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if n <= MAX_HEADER_BYTES and 8 + n <= size:
                head += f.read(n)
        # a file name is hostile too: keep messages on one line
        h = parse_header_bytes(head, size, where=where)
    return Header(path, h.tensors, h.metadata, h.data_start, h.file_size)


class SafetensorsFile:
    """Lazy reader over one validated file. Use as a context manager; tensors returned by `get` are
    copies detached from the mapping only if `copy=True` (default), so closing is always safe."""

    def __init__(self, path_or_header: str | os.PathLike | Header):
        self.header = path_or_header if isinstance(path_or_header, Header) else read_header(path_or_header)
        self._f = None
        self._mm = None
        self._mv = None

    @property
    def path(self) -> Path:
        return self.header.path

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            self._f = open(self.header.path, "rb")
            size = os.fstat(self._f.fileno()).st_size
            if size != self.header.file_size:
                raise TruncatedShard(f"{self.header.path.name}: file changed size while open "
                                     f"({self.header.file_size} -> {size} bytes)")
            if size > 0:
                self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_COPY)
                self._mv = memoryview(self._mm)
        return self._mm

    def get(self, name: str, copy: bool = True) -> torch.Tensor:
        info = self.header.tensors[name]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        self._map()
        start = self.header.data_start + info.begin
        # through a memoryview: a tensor keeps a reference to it, and so an export of the mapping,
        # which then stays mapped as long as any view of it lives (torch.frombuffer on the mmap
        # itself holds no export: closing would unmap memory under live tensors)
        t = torch.frombuffer(self._mv, dtype=torch.uint8, count=info.nbytes, offset=start)
        t = t.view(info.dtype).reshape(info.shape)
        return t.clone() if copy else t

    def readinto(self, name: str, out: torch.Tensor, offset: int = 0) -> None:
        """Fill the contiguous tensor `out` with the bytes of tensor `name` from byte `offset` on (e.g. one
        expert of a fused [E, N, K] tensor), by positioned reads: the page cache is copied once, with no
        page faults on a mapping."""
        info = self.header.tensors[name]
        buf = memoryview(out.view(-1).view(torch.uint8).numpy())
        if not out.is_contiguous() or offset < 0 or offset + len(buf) > info.nbytes:
            raise ValueError(f"{name}: bytes [{offset}, {offset + len(buf)}) are not inside the tensor "
                             f"({info.nbytes} bytes) or the destination is not contiguous")
        self._map()
        pos = self.header.data_start + info.begin + offset
        done = 0
        while done < len(buf):
            n = os.preadv(self._f.fileno(), [buf[done:]], pos + done)
            if n <= 0:
                raise TruncatedShard(f"{self.header.path.name}: file ended inside tensor {name}")
            done += n

    def close(self):
        if self._mm is not None:
            self._mv = None
            try:
                self._mm.close()
            except BufferError:
                pass  # a zero-copy view is still alive; the mapping goes when the last one does
            self._mm = None
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
