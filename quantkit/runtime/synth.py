"""Random INT4 weights and expert stacks in the pack-quantized layout, for the runtime's tests and
benchmarks. Values are drawn directly (q uniform in [-8, 7], positive scales, random zero points), so
every nibble pattern occurs; this is not a quantizer and says nothing about accuracy on real weights.
"""

from __future__ import annotations

import math

import torch

from .fused_moe import Int4Experts
from .int4 import PackedInt4, pack_int4

__all__ = ["random_int4", "random_int4_experts"]


def random_int4(out_features: int, in_features: int, group_size: int | None = 128, *, symmetric: bool = True,
                num_experts: int | None = None, scale_dtype: torch.dtype = torch.bfloat16,
                scale_mag: float | None = None, generator: torch.Generator | None = None,
                device="cpu") -> PackedInt4:
    """A random PackedInt4 of shape (out, in), optionally with a leading expert dim.
    group_size None = channel. Scales default to ~1/(8*sqrt(in)) so x @ W^T stays O(|x|)."""
    g = in_features if group_size is None else group_size
    lead = () if num_experts is None else (num_experts,)
    ng = math.ceil(in_features / g)
    mag = scale_mag if scale_mag is not None else 1.0 / (8.0 * math.sqrt(in_features))
    # draw on the generator's device (CPU by default, reproducible), or directly on `device` without one
    gdev = generator.device if generator is not None else torch.device(device)
    q = torch.randint(-8, 8, (*lead, out_features, in_features), generator=generator, device=gdev,
                      dtype=torch.int8)  # [E?, N, K]
    scale = (torch.rand((*lead, out_features, ng), generator=generator, device=gdev) + 0.5) * mag  # [E?, N, G]
    zp = None
    if not symmetric:
        z = torch.randint(-8, 8, (*lead, out_features, ng), generator=generator, device=gdev)  # [E?, N, G]
        zp = pack_int4(z.transpose(-1, -2)).transpose(-1, -2).contiguous().to(device)  # [E?, N/8, G]
    return PackedInt4(pack_int4(q).to(device), scale.to(scale_dtype).to(device), zp,
                      (out_features, in_features), g)


def random_int4_experts(num_experts: int, hidden: int, intermediate: int, group_size: int | None = 128, *,
                        symmetric: bool = True, fused_gate_up: bool = True,
                        generator: torch.Generator | None = None, device="cpu") -> Int4Experts:
    """Random routed experts: down [E, D, I] and gate_up [E, 2I, D] (or gate, up [E, I, D])."""
    kw = dict(symmetric=symmetric, num_experts=num_experts, generator=generator, device=device)
    down = random_int4(hidden, intermediate, group_size, **kw)
    if fused_gate_up:
        return Int4Experts(down=down, gate_up=random_int4(2 * intermediate, hidden, group_size, **kw))
    return Int4Experts(down=down, gate=random_int4(intermediate, hidden, group_size, **kw),
                       up=random_int4(intermediate, hidden, group_size, **kw))
