"""A checkpoint directory: config.json, safetensors shards, optional sharded index. All validated on open.

`Checkpoint.open(dir)` reads only JSON and safetensors headers; tensors are read lazily per shard.
Everything in the directory is untrusted: the index's file names must be plain file names inside the
directory (no separators, no `..`, no absolute paths, no symlinks escaping it except into the `blobs/` of a
Hugging Face cache snapshot), every shard named by the index must exist and hold exactly the tensors the
index assigns to it, and a tensor may live in one shard only. Pickle-based weights (.bin/.pt/.pth) are
never opened. Errors quote hostile names cut short and escaped, so each stays one line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import (CheckpointNotFound, ConfigError, ConfigMissing, DuplicateKey, DuplicateTensor, IndexError_,
                      MissingShard, UnsafeCheckpoint, UnsafeShardName)
from ..pack.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from .files import MAX_INT_DIGITS, parse_json, read_bytes
from .safetensors import Header, TensorInfo, _short, _unique_keys, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_JSON_BYTES = 64 << 20  # config/index files larger than this are refused
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_SAFE_NAME = re.compile(r"[A-Za-z0-9._+-]+\.safetensors")  # used with fullmatch: `$` would let "x.safetensors\n" in
MAX_NAME_BYTES = 255  # longer names fail in the OS (ENAMETOOLONG) rather than here


def read_json_file(path: Path, what: str, error=ConfigError, unique_keys: bool = False,
                   limit: int = MAX_JSON_BYTES, hint: str | None = None, int_digits: int = MAX_INT_DIGITS) -> dict:
    """Read a JSON object from the regular file `path` (read/files.py: no FIFO or device, at most `limit`
    bytes, bounded nesting and integers), raising `error` (one line) for anything else. `unique_keys`: a
    repeated key in any object is an error too (for files whose readers must agree, like the index).
    `hint`: the hint of every error raised here (default: `error`'s own, which speaks of config.json)."""
    try:
        text = read_bytes(path, what, error, limit, hint).decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not valid JSON: UnicodeDecodeError: {str(e)[:120]}", hint=hint) from None
    try:
        # lone surrogates ("\ud800") parse but cannot be written back as UTF-8 (config.json is rewritten)
        doc = parse_json(text, what, error, hint, object_pairs_hook=_unique_keys if unique_keys else None,
                         int_digits=int_digits)
    except DuplicateKey as e:
        raise error(f"{what}: {e.message}", hint=hint) from None
    if not isinstance(doc, dict):
        raise error(f"{what} must hold a JSON object, got {type(doc).__name__}", hint=hint)
    return doc


@dataclass(frozen=True)
class Shard:
    name: str  # file name inside the checkpoint directory
    header: Header

    @property
    def path(self) -> Path:
        return self.header.path

    @property
    def size(self) -> int:
        return self.header.file_size

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self.header.tensors


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    config: dict
    shards: tuple[Shard, ...]
    location: dict[str, str]  # tensor name -> shard file name
    # a read.rotate.Rotation the readers over this checkpoint turn its tensors by (TensorReader.of), or None
    rotation: object = field(default=None, compare=False, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Checkpoint":
        root = Path(path)
        if not root.is_dir():
            raise CheckpointNotFound(f"checkpoint directory {str(root)!r} does not exist")
        cfg_path = root / "config.json"
        if not os.path.lexists(cfg_path):  # a FIFO or a directory is refused by kind when read
            raise ConfigMissing(f"{root}: config.json is missing")
        config = read_json_file(cfg_path, "config.json")
        names = _shard_names(root)
        shards = []
        location: dict[str, str] = {}
        for name in names:
            header = read_header(root / name)
            for t in header.tensors:
                if t in location:
                    raise DuplicateTensor(f"tensor {_short(t)} appears in both {location[t]} and {name}")
                location[t] = name
            shards.append(Shard(name, header))
        index_path = root / INDEX_NAME
        if os.path.lexists(index_path):
            _check_index_matches(read_json_file(index_path, INDEX_NAME, IndexError_, unique_keys=True), location)
        return cls(root, config, tuple(shards), location)

    # -- queries -----------------------------------------------------------------------------------
    def shard(self, name: str) -> Shard:
        for s in self.shards:
            if s.name == name:
                return s
        raise KeyError(name)

    def info(self, tensor: str) -> TensorInfo:
        return self.shard(self.location[tensor]).tensors[tensor]

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def quantization_config(self) -> dict | None:
        q = self.config.get("quantization_config")
        return q if isinstance(q, dict) else None

    def non_weight_files(self) -> list[Path]:
        """Files copied verbatim to a converted checkpoint: tokenizer, generation config, chat
        template, ... Never shards, the index, config.json (rewritten) or pickles, and regular files only."""
        out = []
        for p in sorted(self.root.iterdir()):
            if p.is_symlink() and not _link_allowed(self.root, p):
                continue
            if (not p.is_file() or p.name.endswith(".safetensors") or p.name in
                    (INDEX_NAME, "config.json", MANIFEST_NAME) or p.name.endswith(PICKLE_SUFFIXES)
                    or p.name.startswith(".")):
                continue
            out.append(p)
        return out


def _shard_names(root: Path) -> list[str]:
    index_path = root / INDEX_NAME
    if os.path.lexists(index_path):
        index = read_json_file(index_path, INDEX_NAME, IndexError_, unique_keys=True)
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise IndexError_(f"{INDEX_NAME}: 'weight_map' must be a non-empty object")
        names = set()
        for t, f in wm.items():
            if not isinstance(f, str) or not isinstance(t, str):
                raise IndexError_(f"{INDEX_NAME}: weight_map entries must map strings to strings")
            names.add(_safe_shard_name(root, f))
        for n in sorted(names):
            if not os.path.lexists(root / n):  # a FIFO or device: read_header refuses it by kind
                raise MissingShard(f"{INDEX_NAME} names shard {n!r}, which is missing from {root}")
        return sorted(names)
    if (root / SINGLE_NAME).is_file():
        _check_link(root, root / SINGLE_NAME)
        return [SINGLE_NAME]
    st = sorted(p.name for p in root.glob("*.safetensors") if p.is_file())
    for n in st:
        _check_link(root, root / n)
    if st:
        if len(st) > 1:
            raise IndexError_(f"{root} holds {len(st)} safetensors files but no {INDEX_NAME}",
                              hint="add the model.safetensors.index.json that came with the checkpoint")
        return st
    pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise UnsafeCheckpoint(f"{root} holds only pickle-based weights ({', '.join(pickles[:3])}); "
                               "quantkit refuses to unpickle them")
    raise CheckpointNotFound(f"{root} holds no *.safetensors weights")


def plain_shard_name(name: str) -> bool:
    """Whether `name` is a plain `.safetensors` file name (no directory part, no leading dot, no "..", no
    character outside [A-Za-z0-9._+-], at most MAX_NAME_BYTES): what a shard of any directory may be called."""
    return (_SAFE_NAME.fullmatch(name) is not None and not name.startswith(".") and ".." not in name
            and len(name.encode()) <= MAX_NAME_BYTES)


def _safe_shard_name(root: Path, name: str) -> str:
    if not plain_shard_name(name):
        raise UnsafeShardName(f"{INDEX_NAME} names shard {_short(name)}, which is not a plain file name in the "
                              "checkpoint directory")
    _check_link(root, root / name)
    return name


def _link_allowed(root: Path, p: Path) -> bool:
    """A symlink may point inside the checkpoint directory, or, for a Hugging Face cache snapshot
    (`.../models--org--name/snapshots/<rev>/`), into that repository's `blobs/` directory, which is
    where the hub client keeps the files. Loops and unreadable links are not allowed."""
    try:
        target = p.resolve(strict=True)
        base = root.resolve(strict=True)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        return False
    if target.is_relative_to(base):
        return True
    return base.parent.name == "snapshots" and target.is_relative_to(base.parent.parent / "blobs")


def _check_link(root: Path, p: Path) -> None:
    if p.is_symlink() and not _link_allowed(root, p):
        raise UnsafeShardName(f"shard {_short(p.name)} is a symlink pointing outside the checkpoint directory "
                              "(or a broken or looping link)")


def _check_index_matches(index: dict, location: dict[str, str]) -> None:
    wm = index["weight_map"]
    for t, f in wm.items():
        if t not in location:
            raise IndexError_(f"{INDEX_NAME} lists tensor {_short(t)} in {f}, but no shard holds it")
        if location[t] != f:
            raise IndexError_(f"{INDEX_NAME} places {_short(t)} in {f}, but it is in {location[t]}")
    missing = [t for t in location if t not in wm]
    if missing:
        raise IndexError_(f"shards hold {len(missing)} tensor(s) the index does not list, e.g. {_short(missing[0])}")


def read_manifest(root: str | Path, error) -> dict:
    """The manifest of the checkpoint in `root` as a dict; `error` (a QuantkitError class) for anything
    that is not a readable JSON object."""
    return read_json_file(Path(root) / MANIFEST_NAME, MANIFEST_NAME, error, limit=MAX_MANIFEST_BYTES)
