"""Hub ids as sources: `ORG/NAME` -> a local snapshot directory in the Hugging Face cache.

`resolve_source(name_or_path)` is what every command that reads a checkpoint calls first. A local path is
returned unchanged (it always wins over a hub id of the same spelling). Anything else must be a hub model
id `ORG/NAME` (validated strictly, below); it is resolved through `huggingface_hub.snapshot_download` to
`<cache>/models--ORG--NAME/snapshots/<commit>/`, a directory `Checkpoint.open` reads like any other (its
symlinks point into the repository's `blobs/`, which the checkpoint reader allows for cache snapshots).

Only what quantkit needs is fetched, in two steps pinned to one commit:
1. the metadata files (`METADATA_FILES`: config, shard index, tokenizer, chat template, generation and
   processor configs);
2. the weight shards: those the index names, else the repository's root `*.safetensors` (never a
   `consolidated.safetensors` next to an index, never subfolders such as `original/`).
Never `*.py` (quantkit runs no checkpoint code, so there is no trust_remote_code to ask for), never pickles:
a repository whose weights are only `*.bin`/`*.pt`/`*.pth`/`*.ckpt` is refused (`PickleOnlyRepo`) before a
byte of weights is downloaded.

The cache is huggingface_hub's own: downloads resume, files already cached are not fetched again, and with
`HF_HUB_OFFLINE=1` (or `allow_download=False`) everything comes from the cache or fails with `HubOffline`.
The file listing used for the checks comes from the hub client's cached tree listing when it has one
(`get_cached_repo_tree`, which recent releases' `snapshot_download` writes), else from the hub, else
(offline, older caches) from the snapshot folder itself. Checked with huggingface_hub 2.4.0.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from .errors import CheckpointNotFound, IndexError_, QuantkitError, UnsafeCheckpoint
from .read.checkpoint import INDEX_NAME, PICKLE_SUFFIXES, SINGLE_NAME, read_json_file


# --- errors ----------------------------------------------------------------------------------------
class HubError(QuantkitError):
    """A hub id could not be resolved to a usable local snapshot."""

    hint = ("check the id (ORG/NAME) and revision; pass a local checkpoint directory (config.json + "
            "*.safetensors) instead if you have one")


class HubOffline(HubError):
    """The hub may not (HF_HUB_OFFLINE) or cannot be reached, and the cache lacks what is needed."""

    hint = ("download it where the hub is reachable (e.g. run the same quantkit command there, or `hf download "
            "ORG/NAME`) and copy that Hugging Face cache here (point HF_HUB_CACHE or HF_HOME at it), or unset "
            "HF_HUB_OFFLINE if this machine can reach the hub")


class HubRepoNotFound(HubError):
    hint = ("check the spelling of ORG/NAME; for a private or gated model, log in (`hf auth login`, or set "
            "HF_TOKEN) and accept its license on the model page")


class PickleOnlyRepo(HubError, UnsafeCheckpoint):
    """The repository's weights are pickles only (no safetensors): never downloaded, never unpickled."""

    hint = ("quantkit reads safetensors only; use a safetensors release of the model, or load the pickles in a "
            "trusted environment and save them with model.save_pretrained(dir, safe_serialization=True)")


# --- what a hub id is, and what is fetched ---------------------------------------------------------
# One part of a repo id: ASCII letters, digits, '-', '_', '.'; no '-' or '.' at either end (the hub's own
# rules, plus: exactly one '/', which the hub's validator leaves optional for legacy ids such as `gpt2`).
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
HUB_ID = re.compile(rf"({_PART})/({_PART})")
# A git revision: a branch, tag, `refs/pr/N` or commit hash. It becomes a file name under `refs/` in the
# cache, so no '..', no leading '/', no empty path parts.
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,199}")

METADATA_FILES = (
    "config.json", INDEX_NAME, "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json",
)


def shown(s: str, limit: int = 120) -> str:
    """`s` as an error message echoes it: repr'd, cut to `limit` characters (a hostile argument may be
    megabytes long; the message stays one short line)."""
    return repr(s) if len(s) <= limit else f"{s[:limit]!r}... ({len(s)} characters)"


_COMMIT = re.compile(r"[0-9a-f]{40}")


def check_cached_ref(cache: Path, repo_id: str, revision: str) -> None:
    """A branch or tag in the hub cache (`refs/<revision>`) must hold a commit hash: the hub client joins
    what it holds onto `snapshots/`, so `../../..` there would make it read a folder outside the cache."""
    ref = cache / ("models--" + repo_id.replace("/", "--")) / "refs" / revision
    if _COMMIT.fullmatch(revision) or not os.path.lexists(ref):
        return
    text = None
    if ref.is_file() and not ref.is_symlink() and ref.stat().st_size <= 100:
        try:
            text = ref.read_text(encoding="ascii").strip()
        except (OSError, UnicodeError):
            text = None
    if text is None or not _COMMIT.fullmatch(text):
        raise HubError(f"the hub cache's refs/{revision} of {repo_id} does not hold a commit hash "
                       f"({shown(text, 60) if text is not None else 'not a small text file'}): the cache is "
                       "corrupt or was tampered with", hint=f"delete {ref} (or the whole models--"
                       f"{repo_id.replace('/', '--')} folder) and download the model again")


def parse_hub_id(s: str) -> str | None:
    """`s` if it is a well-formed hub model id `ORG/NAME`, else None."""
    m = HUB_ID.fullmatch(s)
    if m is None or any("--" in p or ".." in p for p in m.groups()) or m[2].endswith(".git"):
        return None
    return s


def hub_cache_dir() -> Path:
    """The hub cache as the environment says now (HF_HUB_CACHE, else HF_HOME/hub, else the default).
    Read at call time, not at import time like `huggingface_hub.constants`, so that a process that sets
    the variables after importing huggingface_hub (tests, notebooks) is honoured."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set to a true value."""
    v = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return v.strip().upper() in ("1", "ON", "YES", "TRUE")


def snapshot_repo_id(path: str | os.PathLike) -> str | None:
    """`ORG/NAME` when `path` is a snapshot directory of the hub cache (`.../models--ORG--NAME/snapshots/<rev>`),
    else None. Lets callers (the model card) name the source of a resolved path."""
    p = Path(path)
    if p.parent.name != "snapshots" or not p.parent.parent.name.startswith("models--"):
        return None
    parts = p.parent.parent.name[len("models--"):].split("--")
    return parse_hub_id("/".join(parts)) if len(parts) == 2 else None


# --- resolution ------------------------------------------------------------------------------------
def resolve_source(name_or_path: str | os.PathLike, revision: str | None = None, *,
                   allow_download: bool | None = None, log: Callable[[str], None] | None = None,
                   cache_dir: str | os.PathLike | None = None) -> Path:
    """A local checkpoint directory for `name_or_path`.

    - An existing local path is returned as is (`Path(name_or_path)`); `revision` must then be None.
    - A hub model id `ORG/NAME` is resolved to its snapshot directory in the hub cache at `revision` (a
      branch, tag or commit hash; default `main`), fetching what is missing unless downloads are off.
      `allow_download`: None follows HF_HUB_OFFLINE (download unless it is set); False never touches the
      network; True downloads, but HF_HUB_OFFLINE still wins (the user said no network).
    - Anything else raises CheckpointNotFound.

    Raises HubOffline (offline or unreachable, and not cached), HubRepoNotFound, PickleOnlyRepo, HubError.
    `log` receives one-line notes (what was resolved, what is skipped). `cache_dir` overrides the cache.
    """
    say = log or (lambda _msg: None)
    raw = os.fspath(name_or_path)
    if os.path.exists(raw):
        if revision is not None:
            raise HubError(f"--revision applies to hub ids, but {shown(raw)} is a local path",
                           hint="drop --revision, or check out that revision into the directory yourself")
        return Path(raw)
    repo_id = parse_hub_id(raw)
    if repo_id is None:
        raise CheckpointNotFound(f"{shown(raw)} is not a local directory, nor a hub model id (ORG/NAME)",
                                 hint="pass a local checkpoint directory (config.json + *.safetensors) or a hub "
                                      "model id such as Qwen/Qwen3-30B-A3B")
    if revision is not None and (not _REVISION.fullmatch(revision) or ".." in revision or "//" in revision
                                 or revision.endswith("/")):
        raise HubError(f"revision {shown(revision)} is not a branch, tag or commit hash",
                       hint="pass a branch or tag name (main, v1.0, refs/pr/3) or a 40-hex-digit commit hash")
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise HubError(f"{raw!r} is not a local directory, and resolving hub ids needs huggingface_hub",
                       hint="pip install huggingface_hub, or pass a local checkpoint directory") from None

    cache = Path(cache_dir).expanduser() if cache_dir is not None else hub_cache_dir()
    offline = allow_download is False or hub_offline()
    if allow_download and offline:
        say("HF_HUB_OFFLINE is set: using the local hub cache only")
    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    check_cached_ref(cache, repo_id, revision or "main")  # before the hub client follows it
    job = _Job(repo_id, where, cache, offline)

    # step 1: metadata (pins the commit: step 2 asks for that exact commit)
    snap = job.download(revision, list(METADATA_FILES))
    commit = snap.name
    files, listed_from = job.listing(commit, snap)
    if job.offline and not offline:
        say(f"hub: could not reach the hub for {where}: using what the local cache holds")
    say(f"hub: {where} -> commit {commit[:12]} in {snap.parent.parent} ({len(files)} files listed from "
        f"{listed_from})")
    _check_files(where, files, listed_from)

    meta = [n for n in METADATA_FILES if n in files]
    shards = _shard_names(where, snap, files)
    config = read_json_file(snap / "config.json", f"{where}: config.json")
    if config.get("auto_map") or "auto_map" in _tokenizer_config(snap):
        say(f"hub: {where} ships custom code (auto_map); quantkit neither downloads nor runs it (*.py skipped)")

    # step 2: the shards (already cached ones are not fetched again; partial downloads resume)
    snap = job.download(commit, meta + shards)
    missing = [n for n in ["config.json", *shards] if not (snap / n).is_file()]
    if missing:
        raise HubOffline(f"the cached snapshot of {where} (commit {commit[:12]}) lacks {len(missing)} file(s), "
                         f"e.g. {missing[0]}") if job.offline else \
            HubError(f"the download of {where} left {len(missing)} file(s) missing, e.g. {missing[0]}",
                     hint="run the same command again: finished files are kept and partial ones resume")
    return snap


class _Job:
    """One hub repository being resolved: maps the hub client's exceptions to quantkit's."""

    def __init__(self, repo_id: str, where: str, cache: Path, offline: bool):
        self.repo_id, self.where, self.cache, self.offline = repo_id, where, cache, offline

    def download(self, revision: str | None, patterns: list[str]) -> Path:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)

        # Exact file names as patterns: fnmatch's `*` also matches '/', so globs would pull in subfolders.
        try:
            return Path(snapshot_download(self.repo_id, revision=revision, cache_dir=str(self.cache),
                                          allow_patterns=patterns, local_files_only=self.offline))
        except GatedRepoError:
            raise HubRepoNotFound(f"hub repo {self.repo_id} is gated and this machine has no access to it") from None
        except RepositoryNotFoundError:
            raise HubRepoNotFound(f"hub repo {self.repo_id} does not exist or is private") from None
        except RevisionNotFoundError:
            raise HubError(f"hub repo {self.repo_id} has no revision {revision!r}",
                           hint="pass an existing branch, tag or commit hash with --revision") from None
        except LocalEntryNotFoundError as e:  # offline/unreachable and not (completely) cached
            why = ("HF_HUB_OFFLINE is set" if self.offline and hub_offline() else
                   "downloads are off" if self.offline else "the hub could not be reached")
            incomplete = type(e).__name__ == "IncompleteSnapshotError"
            state = "is only partly in" if incomplete else "is not in"
            hint = None if self.offline else (
                "check the connection (proxy, HF_ENDPOINT) and re-run, or download it where the hub is reachable "
                "and copy that Hugging Face cache here (point HF_HUB_CACHE or HF_HOME at it)")
            raise HubOffline(f"{self.where!r} is not a local directory, and hub repo {self.where} {state} the "
                             f"local cache ({self.cache}) while {why}", hint=hint) from None
        except HfHubHTTPError as e:
            raise HubError(f"the hub refused {self.where}: {_one_line(e)}",
                           hint="check the id and your access (`hf auth login` or HF_TOKEN), then re-run") from None
        except Exception as e:  # transport errors: their classes depend on the hub client's HTTP library
            if self.offline:
                raise
            raise HubError(f"downloading {self.where} failed: {type(e).__name__}: {_one_line(e)}",
                           hint="check the connection and re-run: finished files are kept and partial ones "
                                "resume") from e

    def listing(self, commit: str, snap: Path) -> tuple[set[str], str]:
        """Names of the files at the repository root at `commit`, and where the listing came from.

        A client with the tree cache writes the listing whenever `snapshot_download` reached the hub, so
        when it is missing after an online step 1, the hub was not reached (the client fell back to the
        cache): the job then stays offline, rather than waiting through the client's retries again."""
        try:
            from huggingface_hub import get_cached_repo_tree
            from huggingface_hub.errors import CachedRepoTreeNotFoundError
        except ImportError:  # huggingface_hub before the tree cache: ask the hub (when allowed)
            if not self.offline:
                from huggingface_hub import HfApi, RepoFile

                try:
                    return ({f.path for f in HfApi().list_repo_tree(self.repo_id, revision=commit)
                             if isinstance(f, RepoFile)}, "the hub")
                except Exception:  # transport errors: classes depend on the client's HTTP library
                    self.offline = True
        else:
            try:
                tree = get_cached_repo_tree(self.repo_id, revision=commit, cache_dir=str(self.cache))
                return {f.path for f in tree if "/" not in f.path}, "the cached repo listing"
            except CachedRepoTreeNotFoundError:
                self.offline = True
        return {p.name for p in snap.iterdir()}, "the cached snapshot folder"


def _check_files(where: str, files: set[str], listed_from: str) -> None:
    partial = listed_from == "the cached snapshot folder"  # only what was downloaded, not the whole repo
    if "config.json" not in files:
        raise HubError(f"{where} has no config.json at its root ({listed_from}): not a transformers checkpoint")
    if any(n.endswith(".safetensors") for n in files):
        return
    pickles = sorted(n for n in files if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise PickleOnlyRepo(f"{where} holds only pickle-based weights ({', '.join(pickles[:3])}); quantkit "
                             "refuses to download or unpickle them")
    if partial:
        raise HubOffline(f"the cached snapshot of {where} holds no *.safetensors weights (only part of the repo "
                         "is cached)")
    raise HubError(f"{where} holds no *.safetensors weights at its root",
                   hint="quantkit reads transformers checkpoints in safetensors (GGUF, subfolder layouts and "
                        "adapters are not supported)")


def _shard_names(where: str, snap: Path, files: set[str]) -> list[str]:
    """The weight files to fetch: the index's shards, else the root `*.safetensors` (as Checkpoint.open
    picks them: `model.safetensors` first)."""
    if INDEX_NAME in files:
        index = read_json_file(snap / INDEX_NAME, f"{where}: {INDEX_NAME}", IndexError_, unique_keys=True)
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise IndexError_(f"{where}: {INDEX_NAME}: 'weight_map' must map tensor names to shard file names")
        names = sorted(set(wm.values()))
        absent = [n for n in names if n not in files]
        if absent:  # also refuses any name with a '/' or '..': only root files are listed
            raise IndexError_(f"{where}: {INDEX_NAME} names shard {absent[0][:120]!r}, which the repo does not hold "
                              "at its root")
        return names
    if SINGLE_NAME in files:
        return [SINGLE_NAME]
    return sorted(n for n in files if n.endswith(".safetensors"))


def _tokenizer_config(snap: Path) -> dict:
    p = snap / "tokenizer_config.json"
    if not p.is_file():
        return {}
    try:
        return read_json_file(p, "tokenizer_config.json")
    except QuantkitError:
        return {}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


__all__ = ["HubError", "HubOffline", "HubRepoNotFound", "PickleOnlyRepo", "resolve_source", "parse_hub_id",
           "hub_cache_dir", "hub_offline", "snapshot_repo_id", "METADATA_FILES"]
