"""Stage 1 of `verify`, integrity (no model code): the manifest is complete; every shard it lists exists
with the recorded size and sha256; the index names no shard the manifest lacks and the directory holds no
shard or leftover temporary file the manifest lacks; the manifest's tensor table matches the headers.

One half of a prefill/decode pair (pack/manifest.py, `pair`) also records every other file convert wrote
(config.json, the index, the copied files) with its size and sha256: each is checked, and the directory may
hold nothing else (the files later commands write, pack.manifest.AFTER_CONVERT, aside). `verify --pair` and
`convert --pair`'s resume run `check_checkpoint` on both halves."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import QuantkitError
from ..pack.manifest import AFTER_CONVERT, JOURNAL_DIR, MANIFEST_NAME, PAIR_KEY, PAIR_PENDING, pair_problem
from ..read.checkpoint import INDEX_NAME, Checkpoint, read_json_file, read_manifest
from ..write.writer import sha256_file
from .common import Listing

_PLAIN_SHARD = re.compile(r"[A-Za-z0-9._+-]+\.safetensors")


def _plain_name(name) -> bool:
    return (isinstance(name, str) and _PLAIN_SHARD.fullmatch(name) is not None and not name.startswith(".")
            and ".." not in name)


def check_integrity(root: Path, say, manifest: dict | None = None,
                    pending: bool = False) -> tuple[dict | None, Listing, int]:
    """(manifest or None, mismatches, bytes hashed). Reads JSON files and hashes shards; never parses
    a safetensors header, so a corrupt shard is reported by name rather than failing to open. `manifest`: the
    manifest as the caller read it (else read here); `pending`: a pair half waiting for its partner
    (status "pair_pending") passes too."""
    mm = Listing()
    if manifest is None:
        try:
            manifest = read_manifest(root, QuantkitError)
        except QuantkitError as e:
            mm.add({"file": MANIFEST_NAME, "problem": e.message})
    shards, files = _manifest_files(manifest, pending, mm) if manifest is not None else ({}, None)
    hashed = _check_shards(root, shards, say, mm) + _check_pair_files(root, files or {}, shards, mm)
    _check_index(root, manifest, shards, mm)
    _check_directory(root, shards, files, mm)
    return manifest, mm, hashed


def _manifest_files(manifest: dict, pending: bool, mm: Listing) -> tuple[dict[str, dict], dict[str, dict] | None]:
    """(shards by name, a pair half's other files or None) the manifest records, and what is wrong with it: a
    status other than complete, no shards, a malformed or repeated shard entry, a malformed pair section."""
    shards: dict[str, dict] = {}
    files: dict[str, dict] | None = None  # a pair half's other files (None: not a pair half)
    status = manifest.get("status")
    if PAIR_KEY in manifest:
        problem = pair_problem(manifest[PAIR_KEY], complete=status == "complete")
        if problem:
            mm.add({"file": MANIFEST_NAME, "problem": problem})
        else:
            files = manifest[PAIR_KEY]["files"]
    if not (status == "complete" or (pending and status == PAIR_PENDING and files is not None)):
        mm.add({"file": MANIFEST_NAME, "problem": f"status is {str(status)[:40]!r}, not 'complete': "
                "the conversion did not finish"})
    raw = manifest.get("shards")
    if not isinstance(raw, list) or not raw:
        mm.add({"file": MANIFEST_NAME, "problem": "lists no shards"})
        raw = []
    for s in raw:
        ok = (isinstance(s, dict) and _plain_name(s.get("name")) and type(s.get("size")) is int
              and isinstance(s.get("sha256"), str))
        if not ok:
            mm.add({"file": MANIFEST_NAME, "problem": f"malformed shard entry {str(s)[:80]!r}"})
            continue
        if s["name"] in shards:
            mm.add({"file": s["name"], "problem": "listed twice in the manifest"})
        shards[s["name"]] = s
    return shards, files


def _check_shards(root: Path, shards: dict[str, dict], say, mm: Listing) -> int:
    """Every shard the manifest lists exists with its recorded size and sha256; returns the bytes hashed."""
    hashed = 0
    for i, (name, s) in enumerate(sorted(shards.items())):
        p = root / name
        if not p.is_file():  # symlinks are followed: a Hugging Face cache snapshot links into blobs/
            mm.add({"file": name, "problem": "missing (listed in the manifest)" if not p.exists() else
                    "not a regular file"})
            continue
        size = p.stat().st_size
        if size != s["size"]:
            mm.add({"file": name, "problem": f"size {size} B, the manifest records {s['size']} B"})
            continue
        say(f"integrity: sha256 {name} ({i + 1}/{len(shards)})")
        digest = sha256_file(p)
        hashed += size
        if digest != s["sha256"]:
            mm.add({"file": name, "problem": f"sha256 {digest[:16]}... differs from the manifest's "
                    f"{s['sha256'][:16]}..."})
    return hashed


def _check_pair_files(root: Path, files: dict[str, dict], shards: dict[str, dict], mm: Listing) -> int:
    """Every other file a pair half records exists with its recorded size and sha256; returns the bytes hashed
    of those that match."""
    hashed = 0
    for name, e in sorted(files.items()):
        p = root / name
        if name in shards:
            mm.add({"file": name, "problem": "recorded both as a shard and as a file"})
        elif not p.is_file():
            mm.add({"file": name, "problem": "missing (recorded in the manifest's pair section)" if not p.exists()
                    else "not a regular file"})
        elif (size := p.stat().st_size) != e["size"]:
            mm.add({"file": name, "problem": f"size {size} B, the manifest records {e['size']} B"})
        elif (digest := sha256_file(p)) != e["sha256"]:
            mm.add({"file": name, "problem": f"sha256 {digest[:16]}... differs from the manifest's "
                    f"{e['sha256'][:16]}..."})
        else:
            hashed += size
    return hashed


def _check_index(root: Path, manifest: dict | None, shards: dict[str, dict], mm: Listing) -> None:
    """The index: every shard it names must exist and be in the manifest, its total size theirs, and every shard
    of the manifest must hold a tensor of it."""
    listed_in_index: set[str] = set()
    try:
        index = read_json_file(root / INDEX_NAME, INDEX_NAME, QuantkitError)
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            mm.add({"file": INDEX_NAME, "problem": "has no weight_map"})
            wm = {}
        if not all(isinstance(f, str) for f in wm.values()):
            mm.add({"file": INDEX_NAME, "problem": "weight_map values must be shard file names"})
        for f in sorted({f for f in wm.values() if isinstance(f, str)}):
            if not _plain_name(f):
                mm.add({"file": INDEX_NAME, "problem": f"names {f[:80]!r}, not a plain shard file name"})
                continue
            listed_in_index.add(f)
            if manifest is not None and f not in shards:
                mm.add({"file": f, "problem": "named by the index but not listed in the manifest"})
            if f not in shards and not (root / f).is_file():
                mm.add({"file": f, "problem": "named by the index but missing"})
        total = (index.get("metadata") or {}).get("total_size") if isinstance(index.get("metadata"), dict) else None
        if shards and total is not None and total != sum(s["size"] for s in shards.values()):
            mm.add({"file": INDEX_NAME, "problem": f"total_size {total} differs from the shards' "
                    f"{sum(s['size'] for s in shards.values())} B"})
    except QuantkitError as e:
        mm.add({"file": INDEX_NAME, "problem": e.message})
    for name in shards:
        if listed_in_index and name not in listed_in_index:
            mm.add({"file": name, "problem": "listed in the manifest but the index maps no tensor to it"})


def _check_directory(root: Path, shards: dict[str, dict], files: dict[str, dict] | None, mm: Listing) -> None:
    """Nothing else that looks like weights, and nothing half-written; a pair half holds nothing convert did not
    record (the files later commands write aside)."""
    for p in sorted(root.iterdir()):
        if p.name.endswith(".safetensors") and p.name not in shards:
            mm.add({"file": p.name, "problem": "extra shard not listed in the manifest"})
        elif p.name.startswith(".") and p.name.endswith(".tmp"):
            mm.add({"file": p.name, "problem": "leftover temporary file of an unfinished write"})
        elif p.name == JOURNAL_DIR:
            mm.add({"file": p.name, "problem": "the conversion journal is still there: the conversion did not finish"})
        elif files is not None and p.name not in files and p.name not in shards and p.name != MANIFEST_NAME \
                and p.name not in AFTER_CONVERT:
            mm.add({"file": p.name[:120], "problem": "not written by convert: the manifest records no such file"})


def check_checkpoint(root: Path, say, manifest: dict | None = None,
                     pending: bool = False) -> tuple[dict | None, Listing, int]:
    """`check_integrity`, then, when the directory opens as a checkpoint, the manifest's tensor table against
    the headers (`check_manifest_tensors`): what `verify` checks of QMODEL, for a pair's other half."""
    manifest, mm, hashed = check_integrity(root, say, manifest, pending)
    if manifest is not None and not mm:
        try:
            ck = Checkpoint.open(root)
        except QuantkitError as e:
            mm.add({"file": "*", "problem": f"the checkpoint does not open: {e.message}"})
        else:
            check_manifest_tensors(ck, manifest, mm)
    return manifest, mm, hashed


def check_manifest_tensors(ck: Checkpoint, manifest: dict, mm: Listing) -> None:
    """The manifest's tensor table against the (validated) headers: same names, shards, shapes, dtypes."""
    table = manifest.get("tensors")
    if not isinstance(table, dict):
        mm.add({"file": MANIFEST_NAME, "problem": "has no tensor table"})
        return
    for name, e in table.items():
        where = ck.location.get(name)
        if where is None:
            shard = e.get("shard") if isinstance(e, dict) else None
            mm.add({"file": shard[:120] if isinstance(shard, str) else MANIFEST_NAME,
                    "problem": f"tensor {name[:120]} is in the manifest but in no shard"})
            continue
        info = ck.info(name)
        if not isinstance(e, dict):
            mm.add({"file": MANIFEST_NAME, "problem": f"tensor {name[:120]}: malformed entry"})
            continue
        if e.get("shard") != where:
            mm.add({"file": where, "problem": f"tensor {name[:120]}: the manifest places it in "
                    f"{str(e.get('shard'))[:120]}"})
        if e.get("shape") != list(info.shape) or e.get("dtype") != str(info.dtype).removeprefix("torch."):
            mm.add({"file": where, "problem": f"tensor {name[:120]}: header says "
                    f"{str(info.dtype).removeprefix('torch.')}{list(info.shape)}, the manifest "
                    f"{str(e.get('dtype'))[:40]}{str(e.get('shape'))[:80]}"})
    for name, where in ck.location.items():
        if name not in table:
            mm.add({"file": where, "problem": f"tensor {name} is not in the manifest"})
