"""The output directory of a conversion: an exclusive lock for the whole run, and what to do with what is
already there (refuse, empty it for --overwrite, or find the shards a journal says are finished for
--resume). The journal itself is one JSON record per finished source shard in JOURNAL_DIR."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import OutputBusy, OutputExists, QuantkitError, ResumeMismatch
from ..pack.manifest import JOURNAL_DIR, MANIFEST_NAME
from ..read.checkpoint import plain_shard_name, read_json_file, read_manifest
from .writer import sha256_file


def _only_own_debris(out: Path) -> bool:
    """What a run killed before its first manifest leaves: an empty journal and temporaries."""
    for p in out.iterdir():
        if p.name == JOURNAL_DIR and p.is_dir() and not any(p.glob("*.json")):
            continue
        if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file():
            continue
        return False
    return True


def _remove_temporaries(out: Path) -> None:
    """The temporaries a killed run left in OUT (`.NAME.tmp`, `.NAME.<random>.tmp`: every writer's, regular
    files only; the output lock is held, so no live writer owns them). verify refuses a checkpoint that holds one."""
    for p in out.iterdir():
        if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)


def _finished(out: Path, o: Any) -> bool:
    """A journaled output shard (hostile: the journal is whatever OUT holds) names a plain file in OUT that is
    still the one the journal describes (size, then sha256)."""
    if not isinstance(o, dict):
        return False
    name, size, digest = o.get("name"), o.get("size"), o.get("sha256")
    if not isinstance(name, str) or not plain_shard_name(name) or type(size) is not int or not isinstance(digest, str):
        return False
    p = out / name
    return p.is_file() and not p.is_symlink() and p.stat().st_size == size and sha256_file(p) == digest


@contextlib.contextmanager
def output_lock(out: Path):
    """Hold an exclusive lock on the output directory (created if missing) for the whole conversion, so that
    a second convert into the same OUT fails at once instead of interleaving its shards and journal with
    this one's. The lock is the directory's own (flock on its descriptor): nothing is added to OUT or
    beside it, and it goes with the process however that ends."""
    if out.exists() and not out.is_dir():
        raise OutputExists(f"output {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock on this platform: no lock
        yield
        return
    fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputBusy(f"{out} is being written by another quantkit convert") from None
        except OSError:
            pass  # a filesystem without flock support: convert unlocked, as before
        yield
    finally:
        os.close(fd)


def clear_dir(d: Path) -> None:
    """Remove everything inside d, keeping d itself."""
    for p in d.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def prepare_output(out: Path, identity: dict, *, overwrite: bool, resume: bool) -> dict[str, dict]:
    """Validate the output dir (created by `output_lock`); return journal records of shards already
    finished (resume)."""
    journal = out / JOURNAL_DIR
    if any(out.iterdir()):
        manifest = out / MANIFEST_NAME
        if overwrite:
            clear_dir(out)  # in place: the lock is held on this directory
        elif resume and manifest.is_file():
            m = read_manifest(out, ResumeMismatch)
            if m.get("status") == "complete":
                raise OutputExists(f"{out} already holds a complete conversion",
                                   hint="pass --overwrite to convert again, or choose another directory")
            if m.get("identity") != identity:
                raise ResumeMismatch(f"{out} holds an unfinished conversion of a different source, recipe, "
                                     "calibration or quantkit version; refusing to mix them")
            journal.mkdir(exist_ok=True)  # killed after _finalize removed it: every shard is redone
            _remove_temporaries(out)  # a kill mid-write (a shard, the card, a JSON file) leaves its temporary
            done = {}
            for p in sorted(journal.glob("*.json")):
                try:
                    rec = read_json_file(p, p.name, ResumeMismatch)
                except QuantkitError:
                    continue  # a torn journal entry: redo that shard
                # a record is kept only if its output shards are still on disk as it says; convert then
                # holds every field against its plan of that shard (convert/journal.py) before trusting it
                outs = rec.get("outputs") if isinstance(rec, dict) else None
                if (isinstance(outs, list) and outs and p.name == f"{rec.get('source')}.json"
                        and all(_finished(out, o) for o in outs)):
                    done[rec["source"]] = rec
            return done
        elif not (resume and _only_own_debris(out)):
            raise OutputExists(f"output directory {str(out)!r} is not empty")
        else:
            _remove_temporaries(out)
    journal.mkdir(exist_ok=True)
    return {}
