"""Several processes, one job: torch.distributed as `torchrun` sets it up, nothing home-made.

    torchrun --nproc-per-node 8 [--nnodes N --node-rank R --rdzv-endpoint HOST:PORT] -m quantkit convert SRC OUT -r R

`world()` reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and joins the
process group once: NCCL when the job runs on CUDA devices, gloo otherwise. A plain `quantkit convert` is
world size 1 and never touches torch.distributed. Every rank must see the same source and output paths (one
machine, or nodes on a shared filesystem).

Collective steps go through `World.step`: each rank runs its part, then every rank learns whether any
failed, and all of them raise the same error (the failing rank its own, the others `RankFailed` naming it),
so a job never hangs at the next collective because one rank stopped early. A rank that dies outright is
torchrun's to report: it stops the others. `agree` refuses to start when the ranks were given different
work (source, recipe, options, quantkit version).

Messages between ranks are small Python objects (identities, shard assignments, errors, results) sent
with torch.distributed's object collectives; tensors never travel this way, and no checkpoint file is
ever unpickled.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence, TypeVar

from . import timeline
from .errors import DistributedError, RankFailed, RanksDisagree

T = TypeVar("T")

# How long a rank waits at a collective for the others (a layer of a trillion-parameter model's calibration
# can take long); QUANTKIT_DIST_TIMEOUT (seconds) overrides it.
DEFAULT_TIMEOUT_S = 6 * 3600


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: a single process, torch.distributed not used

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # ---- collectives (identity operations when size == 1) ------------------------------------------------
    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def all_gather(self, obj: Any) -> list:
        """Every rank's `obj`, in rank order."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any = None, src: int = 0) -> Any:
        """`obj` of rank `src`, on every rank."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        with timeline.phase("exchange"):
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def step(self, fn: Callable[[], T], what: str, phase: str | None = None) -> T:
        """Run `fn` on this rank; if it raised here or on any other rank, raise on every rank (see the module
        docstring). `what` names the step in the error the other ranks raise. `phase` (quantkit/timeline.py)
        is what the time inside `fn` counts as; the check after it counts as "wait" (and, in the timeline's
        "wait_after", as a wait after `phase`: the step the slowest rank was still in)."""
        return self._step(fn, what, phase, False)

    def step_all(self, fn: Callable[[], T], what: str, phase: str | None = None) -> list[T]:
        """`step`, returning every rank's result of `fn` in rank order: the results travel with the check
        (one collective, not two). They must be small picklable objects."""
        return self._step(fn, what, phase, True)

    def _step(self, fn, what, phase, share):
        with timeline.phase(phase) if phase else contextlib.nullcontext():
            if self.size == 1:
                val = fn()
                return [val] if share else val
            err: BaseException | None = None
            try:
                val = fn()
            except Exception as e:  # every kind: a bug on one rank must not leave the others waiting
                err, val = e, None
        report = None if err is None else (type(err).__name__, getattr(err, "message", None) or str(err))
        with timeline.phase("wait", after=phase or "step"):
            reports = self.all_gather((report, val if share and err is None else None))
        failed = [(r, rep) for r, (rep, _) in enumerate(reports) if rep is not None]
        if failed:
            if err is not None:
                raise err
            r, (kind, msg) = failed[0]
            raise RankFailed(f"rank {r} failed while {what}: {kind}: {msg}",
                             hint="the error above from that rank says what to fix; every rank stopped with it")
        return [v for _, v in reports] if share else val

    def agree(self, work: dict) -> None:
        """Refuse to go on unless every rank was given the same `work` (a JSON-able description: source
        fingerprint, recipe, options, version). Names the first field that differs and the ranks."""
        if self.size == 1:
            return
        mine = _digest(work)
        everyone = self.all_gather((mine, work))
        lead_digest, lead = everyone[0]
        for r, (d, w) in enumerate(everyone):
            if d != lead_digest:
                key = next((k for k in sorted(set(lead) | set(w)) if lead.get(k) != w.get(k)), "?")
                raise RanksDisagree(f"rank {r} was started with different work than rank 0 ({key} differs): "
                                    "every rank must run the same command on the same files",
                                    hint="launch every node with the same arguments and quantkit version, "
                                         "on a shared filesystem")

    def split(self, items: list[T], weight: Callable[[T], int]) -> list[T]:
        """This rank's share of `items` (`balance` of their weights). Deterministic for a given world size; the
        union over ranks is `items`."""
        if self.size == 1:
            return list(items)
        owner = balance([weight(x) for x in items], self.size)
        return [x for x, r in zip(items, owner) if r == self.rank]


def balance(weights: Sequence[int], size: int) -> list[int]:
    """The rank of each item: the heaviest first, each to the least loaded rank (ties: the earlier item, the
    lower rank). Deterministic for a given world size: every rank computes the same assignment."""
    load = [0] * size
    owner = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-int(weights[i]), i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += int(weights[i])
    return owner


def launched() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as the launcher set them, read before the job is joined (`world()` checks them
    then); (0, 1) when they are absent or not a valid pair."""
    try:
        size, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    except DistributedError:
        return 0, 1
    return (rank, size) if size > 1 and 0 <= rank < size else (0, 1)


def _digest(work: dict) -> str:
    return hashlib.sha256(json.dumps(work, sort_keys=True, default=str).encode()).hexdigest()


_WORLD: World | None = None


def world(device: str | None = None) -> World:
    """This process's place in the job (joined on first use). `device`: "cuda..." (or "auto" where torch sees
    a GPU) selects NCCL, and each rank's current CUDA device becomes its LOCAL_RANK."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    size = _env_int("WORLD_SIZE", 1)
    if size <= 1:
        _WORLD = World()
        return _WORLD
    rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < size:
        raise DistributedError(f"RANK={rank} is outside WORLD_SIZE={size}", hint="launch with torchrun")
    import torch
    import torch.distributed as dist

    dev = device or ""
    on_cuda = (dev.startswith("cuda") or dev == "auto") and torch.cuda.is_available()
    backend = "nccl" if on_cuda else "gloo"
    if on_cuda:  # rank r of a node computes on its GPU LOCAL_RANK ("cuda" and "auto" resolve to it)
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        timeout = timedelta(seconds=dist_timeout_s())
        try:
            dist.init_process_group(backend=backend, timeout=timeout)
        except Exception as e:  # rendezvous failures: the launcher's environment is wrong or a peer is missing
            raise DistributedError(f"joining the job ({size} ranks, backend {backend}) failed: "
                                   f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                                   hint="launch with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)") \
                from None
    _WORLD = World(rank=rank, size=size, local_rank=local, backend=backend)
    atexit.register(shutdown)  # scripts that join the world without the CLI leave it too
    return _WORLD


MAX_TIMEOUT_S = 7 * 86400  # a collective step that waits a week is a hung job, not a slow one


def dist_timeout_s() -> float:
    """QUANTKIT_DIST_TIMEOUT (seconds, default DEFAULT_TIMEOUT_S): a finite number in (0, MAX_TIMEOUT_S]. NaN,
    infinity, 0 or a negative time would make every collective step wait forever or fail at once (and an
    infinite timedelta overflows), so they are refused by name before the job is joined."""
    v = os.environ.get("QUANTKIT_DIST_TIMEOUT", "")
    if v.strip() == "":
        return float(DEFAULT_TIMEOUT_S)
    try:
        t = float(v)
    except ValueError:
        t = math.nan
    if not (math.isfinite(t) and 0 < t <= MAX_TIMEOUT_S):
        raise DistributedError(f"QUANTKIT_DIST_TIMEOUT={v[:20]!r} is not a number of seconds in (0, {MAX_TIMEOUT_S}]",
                               hint="unset it (default: %d s) or give the seconds one collective step may wait"
                                    % DEFAULT_TIMEOUT_S)
    return t


MAX_WORLD = 1 << 20  # ranks in one job: far beyond any cluster, and small enough for every index computed from it


def _env_int(name: str, default: int) -> int:
    """A launcher variable: an integer, WORLD_SIZE in [1, MAX_WORLD], the ranks in [0, MAX_WORLD)."""
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return default
    try:
        x = int(v) if len(v) <= 20 else None
    except ValueError:
        x = None
    lo = 1 if name == "WORLD_SIZE" else 0
    hi = MAX_WORLD if name == "WORLD_SIZE" else MAX_WORLD - 1
    if x is None or not lo <= x <= hi:
        raise DistributedError(f"{name}={v[:20]!r} is not an integer in [{lo}, {hi}]", hint="launch with torchrun")
    return x


# How long a leaving rank waits for the others at the closing barrier (gloo): a peer that died is torchrun's
# to report, and must not keep the survivors from exiting. After a failure the wait is short: a rank that
# failed outside a collective step leaves the others blocked, and torchrun stops them once this one exits.
LEAVE_TIMEOUT_S = 60
LEAVE_AFTER_FAILURE_S = 5


def shutdown(ok: bool = True) -> None:
    """Leave the process group: a barrier, then `destroy_process_group`, so that no rank exits while gloo's
    threads still serve a peer. Without it a rank that reached the end while another was still closing its
    connections could die at exit with "terminate called without an active exception" (SIGABRT) after a
    finished job. The CLI calls it on every exit (`ok`: whether the command succeeded), and `world()`
    registers it at interpreter exit for scripts. gloo's barrier is bounded (LEAVE_TIMEOUT_S, LEAVE_AFTER_FAILURE_S); NCCL's has no
    timeout, so after a failure (a peer may be gone) NCCL ranks leave without it. Idempotent."""
    global _WORLD
    w, _WORLD = _WORLD, None
    if w is None or w.size <= 1:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if w.backend == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=LEAVE_TIMEOUT_S if ok else LEAVE_AFTER_FAILURE_S))
        elif ok:
            dist.barrier()
    except Exception:  # a peer already left or died: leave anyway (its own error is what the user sees)
        pass
    finally:
        dist.destroy_process_group()
