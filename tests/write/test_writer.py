"""Memory safety and error handling of the streamed I/O: zero-copy views outlive their file, the
background writer keeps order, bounds what it holds, and hands its failures to the caller."""

import errno
import hashlib
from pathlib import Path

import pytest
import torch

from quantkit.errors import DiskFull
from quantkit.read import prehash
from quantkit.write import writer as W
from quantkit.read.safetensors import SafetensorsFile
from quantkit.write.writer import write_safetensors


def test_view_outlives_closed_file(tmp_path):
    p = tmp_path / "a.safetensors"
    write_safetensors(p, {"x": torch.arange(4096, dtype=torch.float32)})
    f = SafetensorsFile(p)
    v = f.get("x", copy=False)[100:200]
    f.close()  # must not unmap memory that v still points into
    assert torch.equal(v, torch.arange(100, 200, dtype=torch.float32))


def test_readinto_reads_a_slice(tmp_path):
    p = tmp_path / "a.safetensors"
    t = torch.randn(3, 5, 8).to(torch.bfloat16)
    write_safetensors(p, {"pad": torch.ones(3), "t": t})
    with SafetensorsFile(p) as f:
        out = torch.empty(2, 8, dtype=torch.bfloat16)
        f.readinto("t", out, offset=(1 * 5 + 2) * 8 * 2)  # expert 1, rows 2:4
        assert torch.equal(out, t[1, 2:4])
        with pytest.raises(ValueError):
            f.readinto("t", torch.empty(4, 8, dtype=torch.bfloat16), offset=(2 * 5 + 2) * 8 * 2)


def test_background_writer_order_and_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "QUEUE_BYTES", 1000)
    held = []
    real = W.ShardWriter._emit

    def emit(self, data):
        held.append(self._queued)
        real(self, data)

    monkeypatch.setattr(W.ShardWriter, "_emit", emit)
    ts = {f"t{i}": torch.full((100 + i,), float(i)) for i in range(20)}  # ~400 B each
    w = W.ShardWriter(tmp_path / "o.safetensors", [(n, t.dtype, tuple(t.shape)) for n, t in ts.items()])
    for n, t in ts.items():
        w.write(n, t)
    sha, size = w.finish()
    W.wait_durable()
    data = (tmp_path / "o.safetensors").read_bytes()
    assert hashlib.sha256(data).hexdigest() == sha and len(data) == size
    with SafetensorsFile(tmp_path / "o.safetensors") as f:
        for n, t in ts.items():
            assert torch.equal(f.get(n), t)
    assert max(held) <= 1000 + 4 * 119  # at most the bound plus the one tensor let in when it was empty


def test_background_write_failure_reaches_caller(tmp_path, monkeypatch):
    calls = [0]
    real = W.ShardWriter._emit

    def emit(self, data):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    monkeypatch.setattr(W.ShardWriter, "_emit", emit)
    ts = {f"t{i}": torch.zeros(1000) for i in range(10)}
    path = tmp_path / "o.safetensors"
    w = W.ShardWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in ts.items()])
    with pytest.raises(DiskFull):
        for n, t in ts.items():
            w.write(n, t)
        w.finish()
    assert not path.exists() and not W.tmp_name(path).exists()  # nothing half-written left behind


def test_abort_while_a_tensor_is_being_written_returns(tmp_path, monkeypatch):
    """abort() empties the queue and queues the writer's end marker while the writer thread is inside a
    write: when that write returns, the thread must not take the end marker for the tensor it wrote (it
    then waited forever on an empty queue, and abort() with it: a convert that failed mid-shard hung)."""
    import threading

    entered, go = threading.Event(), threading.Event()
    real = W.ShardWriter._emit

    def emit(self, data):
        if threading.current_thread().name.startswith("quantkit-write"):  # the writer thread, not the caller
            entered.set()
            assert go.wait(30)
        real(self, data)

    monkeypatch.setattr(W.ShardWriter, "_emit", emit)
    ts = {f"t{i}": torch.zeros(1000) for i in range(3)}
    path = tmp_path / "o.safetensors"
    w = W.ShardWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in ts.items()])
    w.write("t0", ts["t0"])  # the writer thread blocks inside its first write
    assert entered.wait(30)
    aborter = threading.Thread(target=w.abort, daemon=True)
    aborter.start()
    for _ in range(3000):  # until abort() has emptied the queue and queued the end marker
        with w._cv:
            if w._queue == [None]:
                break
        aborter.join(0.01)
    with w._cv:
        assert w._queue == [None]
    go.set()
    aborter.join(30)
    assert not aborter.is_alive()  # abort() returned
    assert not path.exists() and not W.tmp_name(path).exists()

def test_prehash_matches_and_notices_changes(tmp_path):
    p = tmp_path / "m.safetensors"
    p.write_bytes(b"a" * 100_000)
    prehash.start(tmp_path)
    assert prehash.sha256(p) == hashlib.sha256(b"a" * 100_000).hexdigest()
    prehash.start(tmp_path)
    import time
    time.sleep(0.05)
    p.write_bytes(b"b" * 100_001)  # changed after hashing began: hashed again
    assert prehash.sha256(p) == hashlib.sha256(b"b" * 100_001).hexdigest()


def test_prehash_on_a_rank_hashes_its_own_shards_only(tmp_path, monkeypatch):
    """Under torchrun each rank hashes in the background exactly the source shards convert will give it
    (World.split by shard size), so no shard is hashed by two ranks; the digests are the files'."""
    from quantkit import dist
    from quantkit.read.checkpoint import Checkpoint
    from quantkit.testing import make_tiny_model

    src = make_tiny_model("qwen3_moe", tmp_path / "src", max_shard_size="100KB")
    shards = list(Checkpoint.open(src).shards)
    assert len(shards) >= 6 and len({s.size for s in shards}) > 1  # unequal sizes: the split is not trivial
    seen: list[set[str]] = []
    for rank in range(3):
        monkeypatch.setattr(prehash, "_jobs", {})
        prehash.start(src, rank, 3)
        jobs = dict(prehash._jobs)
        mine = {Path(p).name for p in jobs}
        assert mine == {s.name for s in dist.World(rank=rank, size=3).split(shards, lambda s: s.size)}
        for p, (_, fut) in jobs.items():
            assert fut.result(timeout=60) == hashlib.sha256(Path(p).read_bytes()).hexdigest()
        seen.append(mine)
    assert set().union(*seen) == {s.name for s in shards} and sum(map(len, seen)) == len(shards)
    monkeypatch.setattr(prehash, "_jobs", {})
    prehash.start(src)  # one process: every shard
    assert {Path(p).name for p in prehash._jobs} == {s.name for s in shards}


@pytest.mark.parametrize("env, want", [({"RANK": "1", "WORLD_SIZE": "3"}, (1, 3)), ({}, (0, 1)),
                                       ({"RANK": "0", "WORLD_SIZE": "1"}, (0, 1)),
                                       ({"RANK": "5", "WORLD_SIZE": "2"}, (0, 1)),
                                       ({"RANK": "x", "WORLD_SIZE": "2"}, (0, 1))])
def test_launched_reads_the_launchers_rank(monkeypatch, env, want):
    from quantkit import dist

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert dist.launched() == want


def test_shards_fsynced_before_index_and_manifest(tmp_path, monkeypatch):
    import quantkit.convert as C
    from quantkit.testing import make_tiny_model

    src = make_tiny_model("mixtral", tmp_path / "src")
    synced: list[str] = []
    real_fsync = W.fsync_path

    def fsync_path(path):
        real_fsync(path)
        synced.append(path.name)

    checked = []
    real_json = C.write_json_atomic

    def write_json(path, doc, *a, **kw):
        if path.name in (C.INDEX_NAME, C.MANIFEST_NAME) and (path.name == C.INDEX_NAME or doc.get("status") == "complete"):
            shards = sorted(p.name for p in path.parent.glob("*.safetensors"))
            assert shards and set(shards) <= set(synced), (path.name, shards, synced)
            checked.append(path.name)
        real_json(path, doc, *a, **kw)

    monkeypatch.setattr(W, "fsync_path", fsync_path)
    monkeypatch.setattr(C, "write_json_atomic", write_json)
    C.convert(src, tmp_path / "out", C.ConvertOptions())
    assert checked == [C.INDEX_NAME, C.MANIFEST_NAME]
