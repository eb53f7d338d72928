"""Hub ids as sources (quantkit/hub.py), offline against a Hugging Face cache built here in the hub client's
own layout (`models--ORG--NAME/{blobs,refs,snapshots,trees}`), which huggingface_hub's `scan_cache_dir`,
`snapshot_download(local_files_only=True)` and `get_cached_repo_tree` are asked to read back first."""

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from quantkit.errors import CheckpointNotFound, QuantkitError, UnsafeCheckpoint
from quantkit.hub import (HubError, HubOffline, PickleOnlyRepo, parse_hub_id, resolve_source,
                          snapshot_repo_id)
from harness import run_bounded

QK = Path(sys.executable).parent / "quantkit"


def _commit(label: str) -> str:
    return hashlib.sha1(label.encode()).hexdigest()


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def put_repo(cache: Path, repo_id: str, files: dict[str, bytes], commit: str, *, refs=("main",),
             listed: dict[str, int] | None = None) -> Path:
    """Store `files` as revision `commit` of model repo `repo_id`, as huggingface_hub does: each file a blob
    named by its etag (sha256 for LFS files, the git blob sha1 otherwise), the snapshot a tree of relative
    symlinks into blobs/, refs/<name> holding the commit hash. `listed` (name -> size): extra files of the
    repo that are not downloaded, written with the cached ones to trees/<commit>.json (the tree listing
    snapshot_download caches)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    tree = {}
    for name, data in files.items():
        lfs = name.endswith((".safetensors", ".bin"))
        etag = hashlib.sha256(data).hexdigest() if lfs else _git_blob_id(data)
        blob = repo / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        tree[name] = {"size": len(data), "blob_id": _git_blob_id(data)}
        if lfs:
            tree[name].update(lfs_sha256=etag, lfs_size=len(data))
    for r in refs:
        (repo / "refs" / r).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / r).write_text(commit)
    if listed is not None:
        for name, size in listed.items():
            tree[name] = {"size": size, "blob_id": _commit(name)}
        (repo / "trees").mkdir(exist_ok=True)
        (repo / "trees" / f"{commit}.json").write_text(
            json.dumps({"format_version": 1, "files": dict(sorted(tree.items()))}, indent=1))
    return repo / "snapshots" / commit


MAIN, OLD = _commit("tiny-main"), _commit("tiny-old")
NOT_FETCHED = {"README.md": 10, "modeling_tiny.py": 20, "consolidated.safetensors": 1 << 20,
               "original/model.safetensors": 1 << 20, "pytorch_model.bin": 1 << 20}


@pytest.fixture(scope="module")
def hub(tiny_models, tmp_path_factory):
    src = tiny_models("qwen3_moe")
    cache = tmp_path_factory.mktemp("hf") / "hub"
    files = {p.name: p.read_bytes() for p in sorted(src.iterdir()) if p.is_file()}
    old = {**files, "config.json": files["config.json"].replace(b"{", b'{"quantkit_test": "old",', 1)}
    snaps = {"old": put_repo(cache, "org/tiny", old, OLD, refs=()),
             "main": put_repo(cache, "org/tiny", files, MAIN, listed=NOT_FETCHED)}
    put_repo(cache, "org/pickled", {"config.json": b"{}", "pytorch_model.bin": b"\x80\x04N."}, _commit("p"))
    put_repo(cache, "org/pickled-listed", {"config.json": b"{}"}, _commit("pl"),
             listed={"pytorch_model.bin": 100, "model.pt": 100})
    put_repo(cache, "org/partial", {"config.json": files["config.json"]}, _commit("partial"),
             listed={"model.safetensors": 100})
    return {"src": src, "cache": cache, "snaps": snaps, "files": files}


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_cache_layout_is_the_hubs_own(hub):
    """huggingface_hub itself reads the cache built above: no warnings, refs, files, listing."""
    from huggingface_hub import get_cached_repo_tree, scan_cache_dir, snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError

    info = scan_cache_dir(hub["cache"])
    assert not info.warnings, info.warnings
    repo = {r.repo_id: r for r in info.repos}["org/tiny"]
    revs = {r.commit_hash: r for r in repo.revisions}
    assert set(revs) == {MAIN, OLD} and revs[MAIN].refs == {"main"} and revs[OLD].refs == frozenset()
    assert {f.file_name for f in revs[MAIN].files} == set(hub["files"])
    got = snapshot_download("org/tiny", cache_dir=hub["cache"], local_files_only=True,
                            allow_patterns=sorted(hub["files"]))
    assert Path(got) == hub["snaps"]["main"]
    with pytest.raises(IncompleteSnapshotError):  # the listing says README.md etc. exist but are not cached
        snapshot_download("org/tiny", cache_dir=hub["cache"], local_files_only=True)
    listed = {f.path for f in get_cached_repo_tree("org/tiny", cache_dir=hub["cache"])}
    assert listed == set(hub["files"]) | set(NOT_FETCHED)


def test_hub_id_resolves_to_the_snapshot_offline(offline):
    notes = []
    snap = resolve_source("org/tiny", log=notes.append)
    assert snap == offline["snaps"]["main"] and snap.is_dir()
    assert {p.name for p in snap.iterdir()} == set(offline["files"])  # nothing else was asked for
    assert any(MAIN[:12] in n for n in notes)
    assert snapshot_repo_id(snap) == "org/tiny"
    assert resolve_source("org/tiny", "main") == snap
    # the repo also lists README.md, *.py, consolidated.safetensors, original/..., a .bin: none is needed,
    # so their absence from the cache does not matter


def test_revision_commit_hash(offline):
    snap = resolve_source("org/tiny", OLD)
    assert snap == offline["snaps"]["old"]
    assert json.loads((snap / "config.json").read_text())["quantkit_test"] == "old"
    with pytest.raises(HubOffline):  # a commit that is not cached
        resolve_source("org/tiny", _commit("nope"))


def test_downloads_off_without_the_env_variable(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert resolve_source("org/tiny", allow_download=False) == hub["snaps"]["main"]


@pytest.mark.parametrize("repo", ["org/pickled", "org/pickled-listed"])
def test_pickle_only_repo_is_refused(offline, repo):
    with pytest.raises(PickleOnlyRepo) as e:
        resolve_source(repo)
    assert isinstance(e.value, (HubError, UnsafeCheckpoint, QuantkitError))
    assert "pickle" in e.value.message and "\n" not in e.value.message and e.value.hint


def test_unknown_id_offline_says_so(offline):
    with pytest.raises(HubOffline) as e:
        resolve_source("org/never-downloaded")
    msg = e.value.message
    assert "org/never-downloaded" in msg and "HF_HUB_OFFLINE" in msg and "not in the local cache" in msg
    assert "\n" not in msg and "HF_HUB_OFFLINE" in e.value.hint and "download" in e.value.hint


def test_incomplete_cached_snapshot(offline):
    with pytest.raises(HubOffline, match="only partly in the local cache"):
        resolve_source("org/partial")


def test_local_paths_win_and_are_returned_unchanged(offline, tmp_path, monkeypatch):
    src = offline["src"]
    assert resolve_source(str(src)) == src and resolve_source(src) == src
    (tmp_path / "org" / "tiny").mkdir(parents=True)  # a local directory spelled like the hub id
    monkeypatch.chdir(tmp_path)
    assert resolve_source("org/tiny") == Path("org/tiny")
    with pytest.raises(HubError, match="--revision"):
        resolve_source(str(src), "main")


@pytest.mark.parametrize("s", ["/no/such/dir", "./nope", "nope", "a/b/c", "org/na--me", "org/-x", "org/x.git",
                               "org/", "~/models/x", "org/na me", ""])
def test_not_a_path_nor_an_id(offline, s):
    assert parse_hub_id(s) is None
    with pytest.raises(CheckpointNotFound):
        resolve_source(s)


def test_bad_revision(offline):
    for rev in ("../../etc", "/abs", "a//b", "x y"):
        with pytest.raises(HubError, match="revision"):
            resolve_source("org/tiny", rev)


def test_convert_a_resolved_hub_id(offline, tmp_path):
    """End to end: the resolved snapshot (symlinks into blobs/) converts like a local directory."""
    snap = resolve_source("org/tiny")
    out = tmp_path / "q"
    env = {**os.environ, "QUANTKIT_DEBUG": "0"}
    p = run_bounded([str(QK), "convert", str(snap), str(out), "--recipe", "int4-experts-rtn", "--json"],
                    env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["tensors_quantized"] == 24
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    assert manifest["status"] == "complete"
    gen = out / "generation_config.json"  # copied from a symlink in the snapshot: a regular file in OUT
    assert gen.is_file() and not gen.is_symlink() and gen.read_bytes() == offline["files"]["generation_config.json"]


@pytest.mark.parametrize("ref", ["../../..", "../../../etc", "not-a-commit", "", "\x00" * 10])
def test_a_hostile_ref_in_the_cache_is_refused_before_it_is_followed(hub, tmp_path, monkeypatch, ref):
    """refs/main holding `../../..`: the hub client would join it onto snapshots/ and read a folder outside
    the cache (here: one laid out as a checkpoint, to make the read visible); refused before that."""
    import shutil

    cache = tmp_path / "cache" / "hub"
    shutil.copytree(hub["cache"] / "models--org--tiny", cache / "models--org--tiny", symlinks=True)
    (cache / "models--org--tiny" / "refs" / "main").write_text(ref)
    for name in ("config.json", "model.safetensors"):  # what `../../..` points at, if followed
        if (hub["src"] / name).exists():
            shutil.copy(hub["src"] / name, tmp_path / name)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="refs/main .* does not hold a commit hash") as e:
        resolve_source("org/tiny")
    assert "\n" not in e.value.message and "refs" in e.value.hint
    # a good ref next to it still works; a commit hash is not looked up under refs/
    (cache / "models--org--tiny" / "refs" / "main").write_text(MAIN)
    assert resolve_source("org/tiny") == cache / "models--org--tiny" / "snapshots" / MAIN


def test_a_long_argument_is_not_echoed_whole(offline):
    for bad in ("x" * 10_000, "org/" + "y" * 10_000):
        with pytest.raises(CheckpointNotFound) as e:
            resolve_source(bad)
        assert len(e.value.message) < 300 and "10" in e.value.message
    with pytest.raises(HubError) as e:
        resolve_source("org/tiny", "r" * 10_000)
    assert len(e.value.message) < 300
