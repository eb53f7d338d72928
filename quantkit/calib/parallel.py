"""The calibrated pass over the ranks of a torchrun job (quantkit/dist.py's World): data parallel over
fixed forward batches, expert parallel over fixed groups of experts, and the same floating-point sums
whatever the number of ranks.

- **Batches.** The calibration samples are cut into forward batches exactly as one process cuts them
  (`activations.batch_plan`: same `batch_tokens`, same composition, whatever the world size). Batch b is
  forwarded by one rank (`owner[b]`: the batches by tokens, the heaviest first, each to the least loaded
  rank), and every rank holds the whole current layer. A rank's activation stores hold every sample's
  slot, but only its own batches' samples are ever written or read.
- **Statistics.** What a batch contributes (a routed expert's Gram of that batch's rows, a dense Linear's
  partial Hessian) is computed by one rank from exactly that batch's rows and added to its owner's
  running sum in batch order: the same operands, the same shapes, the same order as in one process.
  Routed experts: the forwarding rank broadcasts each batch's MoE inputs and routing (one tensor each, in
  batch order) and the owner of each expert computes its Gram from them; dense Linears: the forwarding
  rank's partial Hessians go to the module's owner, which sums them in batch order.
- **Ownership.** Experts are solved in fixed groups (`gptq_pass.expert_group_size`: depends on the layer's
  shapes, never on the world size); group g belongs to rank g % world. Dense targets: the i-th belongs to
  rank i % world. Each owner solves its own, then broadcasts the dequantized weights (every rank needs the
  quantized layer for the next forward) and writes its packed results to the spool itself (calib/spool.py).

Tensors travel as raw bytes with torch.distributed's tensor collectives (broadcast, send/recv) on the
backend's device (`Parallel.device`: the rank's GPU under NCCL, the host under gloo; a tensor elsewhere is
staged through it); only small metadata (tensor names, shapes, dtypes, per-module metadata) goes through the
object collectives. With a
world of one process every method is a no-op or a plain call, and the pass runs the same code.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import torch

from .. import timeline
from ..dist import World, balance
from .activations import batch_plan

T = TypeVar("T")


def assign_batches(tokens: Sequence[int], size: int) -> list[int]:
    """The rank that forwards each batch: the heaviest first, each to the least loaded rank (ties: the lower
    batch, the lower rank; dist.balance). Deterministic for a given world size."""
    return balance(tokens, size)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's storage (any dtype travels the same way)."""
    return t.reshape(-1).view(torch.uint8)


class Parallel:
    """One calibrated pass's place in the job: the batch plan, who forwards which batch, and the tensor
    collectives the pass uses. `world` None or of size 1: a single process (every collective is a no-op)."""

    def __init__(self, world: World | None, lengths: Sequence[int], batch_tokens: int):
        self.world = world if world is not None else World()
        self.rank, self.size = self.world.rank, self.world.size
        self.lengths = [int(t) for t in lengths]
        self.plan = batch_plan(self.lengths, batch_tokens)
        self.tokens = [sum(self.lengths[i] for i in c) for c in self.plan]
        self.owner = assign_batches(self.tokens, self.size)
        self.mine = [b for b, r in enumerate(self.owner) if r == self.rank]
        # where tensors travel: NCCL moves CUDA tensors of the rank's current device, gloo host tensors
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.world.backend == "nccl"
                       else torch.device("cpu"))

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def samples(self, rank: int | None = None) -> list[int]:
        """The samples whose activations `rank` (default: this one) holds, ascending."""
        r = self.rank if rank is None else rank
        return sorted(i for b, c in enumerate(self.plan) if self.owner[b] == r for i in c)

    def step(self, fn: Callable[[], T], what: str, phase: str | None = None) -> T:
        """World.step: run `fn` here (its time counted as `phase`, quantkit/timeline.py); a failure on any
        rank is raised on every rank."""
        return self.world.step(fn, what, phase)

    def step_all(self, fn: Callable[[], T], what: str, phase: str | None = None) -> list[T]:
        """World.step_all: `step`, returning every rank's result in rank order (sent with the check)."""
        return self.world.step_all(fn, what, phase)

    # ---- ownership ---------------------------------------------------------------------------------------
    def group_owner(self, group: int) -> int:
        return group % self.size

    def dense_owner(self, i: int) -> int:
        return i % self.size

    # ---- tensor collectives (raw bytes) -------------------------------------------------------------------
    def broadcast_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Make `t` (every rank's tensor of the same shape and dtype) equal to rank `src`'s, in place."""
        return self.broadcast_async(t, src)()

    def broadcast_async(self, t: torch.Tensor, src: int) -> Callable[[], torch.Tensor]:
        """A broadcast (`broadcast_`) posted without waiting: the transfer runs on the backend's threads while this rank
        computes. Returns `wait()`, which completes it (its blocking time counted as "exchange") and gives `t`.
        Every rank posts the same broadcasts in the same order; `t` must not be read (receivers) or written
        (the source) before `wait()` returns."""
        if not self.distributed or t.numel() == 0:
            return lambda: t
        import torch.distributed as dist

        buf = t if t.is_contiguous() and t.device == self.device else t.to(self.device).contiguous()
        with timeline.phase("exchange"):
            work = dist.broadcast(_bytes(buf), src=src, async_op=True)

        def wait() -> torch.Tensor:
            with timeline.phase("exchange"):
                work.wait()
            if buf is not t:
                t.copy_(buf)
            return t

        return wait

    def sum_in_batch_order(self, keys: Sequence[tuple[object, int, tuple[int, ...]]],
                           parts: dict[tuple[object, int], torch.Tensor]) -> dict[object, torch.Tensor]:
        """For each (key, owner rank, shape): on the owner, the float32 sum of every batch's partial
        parts[(key, b)] (held by the rank that forwarded batch b), added in batch order to zeros. Other
        ranks get nothing for that key (the sums are on `self.device`). Sends are posted without waiting and
        receives follow one global order, so no rank waits on one that waits on it."""
        with timeline.phase("exchange"):
            return self._sum_in_batch_order(keys, parts)

    def _sum_in_batch_order(self, keys, parts):
        import torch.distributed as dist

        dev = self.device
        out: dict[object, torch.Tensor] = {}
        pending = []
        for key, dst, shape in keys:
            acc = torch.zeros(shape, dtype=torch.float32, device=dev) if self.rank == dst else None
            for b in range(len(self.plan)):
                src = self.owner[b]
                if self.rank == src and self.rank == dst:
                    acc += parts[(key, b)].to(dev)
                elif self.rank == src:
                    t = parts[(key, b)].to(dev).contiguous()
                    pending.append((dist.isend(_bytes(t), dst), t))
                elif self.rank == dst:
                    buf = torch.empty(shape, dtype=torch.float32, device=dev)
                    dist.recv(_bytes(buf), src)
                    acc += buf
            if acc is not None:
                out[key] = acc
        for h, _ in pending:
            h.wait()
        return out
