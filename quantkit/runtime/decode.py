"""One decode step of one attention layer over a PagedKVPool, with the KV-cache integrity check
always on: append the new token's K/V (checked write), attend over the request's pages (checked
read), and abort every request whose block table pointed outside its own pages.

An aborted request raises nothing: its output row is zeroed, its pages go back to the pool, and its
id is returned so the scheduler can cancel it before a wrong answer leaves the server. The other
requests of the batch are computed exactly as in a clean batch (each request's work is independent).

Not here: the model (projections, RoPE, MLA absorption) and the scheduler; multi-layer callers call
decode_step once per layer with advance=False except on the last layer, and drop aborted ids from
the batch of later layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kv_pool import PagedKVPool
from .paged_attention import paged_decode_attention, paged_mla_decode_attention, write_kv_cache

__all__ = ["DecodeInputs", "DecodeResult", "decode_step"]


@dataclass(frozen=True)
class DecodeInputs:
    """One new token per request, projected for one attention layer.

    GQA pool: q [B, Hq, D], k_new / v_new [B, Hkv, D].
    MLA latent pool: q = q_nope absorbed [B, H, L], q_pe [B, H, R] (rotated), k_new = new latent
    [B, L+R] (or [B, 1, L+R]), v_new None."""

    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor | None = None
    q_pe: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeResult:
    """output   [B, Hq, D] (MLA: [B, H, L] latent-space); rows of aborted requests are zeros
    violated bool [B], in batch order
    aborted  request ids aborted (and freed from the pool) by this step"""

    output: torch.Tensor
    violated: torch.Tensor
    aborted: list[int]


def decode_step(pool: PagedKVPool, request_ids: list[int], inputs: DecodeInputs, *, layer: int = 0,
                sm_scale: float | None = None, advance: bool = True, backend: str = "auto") -> DecodeResult:
    """Attention for one new token per request (inputs: see DecodeInputs; an MLA pool needs q_pe and
    sm_scale).

    The step reserves room for the token, writes it, attends over length + 1 tokens, and (with
    advance) counts the token as stored for the requests that were not aborted."""
    request_ids = list(request_ids)
    positions = pool.reserve(request_ids, 1)  # [B] int32, slot of the new token
    kv = pool.paged(request_ids, layer)  # tables [B, max_pages], owner table: integrity always on
    wrote_bad = write_kv_cache(inputs.k_new, inputs.v_new, kv, positions, check=True, backend=backend)
    ctx = positions + 1
    if pool.latent:
        if inputs.q_pe is None or sm_scale is None:
            raise ValueError("an MLA pool needs q_pe and sm_scale")
        out, read_bad = paged_mla_decode_attention(inputs.q, inputs.q_pe, kv, ctx, sm_scale=sm_scale, check=True,
                                                   backend=backend)
    else:
        sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(inputs.q.shape[-1])
        out, read_bad = paged_decode_attention(inputs.q, kv, ctx, sm_scale=sm, check=True, backend=backend)
    violated = wrote_bad | read_bad  # [B]
    out = out.masked_fill(violated.view(-1, *([1] * (out.ndim - 1))), 0)
    flagged = violated.nonzero().flatten().tolist()
    aborted = [request_ids[i] for i in flagged]
    for r in aborted:
        pool.free(r)
    if advance:
        gone = set(aborted)
        pool.advance([r for r in request_ids if r not in gone])
    return DecodeResult(out, violated, aborted)
