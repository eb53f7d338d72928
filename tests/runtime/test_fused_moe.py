"""runtime/fused_moe.py: the sort/align step, the two-launch Triton MoE against the torch reference,
and the reference against a per-token float64 loop."""

import pytest
import torch

from quantkit.runtime.fused_moe import Int4Experts, fused_moe_int4, fused_moe_int4_ref, moe_align_block_size
from quantkit.runtime.synth import random_int4, random_int4_experts

from .helpers import DEVICE, naive_dequant_weight, needs_triton, rel_err

# bf16 intermediate activations (as vLLM stores them) and bf16 output vs an fp32 reference
MOE_TOL = 2e-2


def _routing(t, k, e, gen, used=None):
    """Random top-k routing over the experts in `used` (default all): ids [T, k] distinct per row."""
    pool = torch.tensor(used if used is not None else list(range(e)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    return ids, w


def test_align_block_size_invariants():
    gen = torch.Generator().manual_seed(0)
    for t, k, e, bm in [(1, 2, 8, 16), (9, 2, 6, 4), (40, 4, 5, 16), (3, 1, 64, 16)]:
        ids, _ = _routing(t, k, e, gen, used=list(range(0, e, 2)))  # odd experts get no tokens
        slots, block_expert, n_pad = moe_align_block_size(ids, e, bm)
        n_pad = int(n_pad)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=e)
        assert n_pad == int(((counts + bm - 1) // bm * bm).sum())
        n_blocks = n_pad // bm
        # every routed slot appears exactly once, in a block of its own expert
        valid = slots[:n_pad][slots[:n_pad] < flat.numel()].long()
        assert sorted(valid.tolist()) == list(range(flat.numel()))
        for b in range(n_blocks):
            blk = slots[b * bm:(b + 1) * bm]
            real = blk[blk < flat.numel()].long()
            assert real.numel() > 0 and (flat[real] == block_expert[b]).all()
        assert (block_expert[n_blocks:] == -1).all()
        # experts with no tokens own no block, hence launch no work
        empty = set(torch.nonzero(counts == 0).flatten().tolist())
        assert not empty & set(block_expert[:n_blocks].tolist())


def _naive_moe(x, ids, w, experts: Int4Experts):
    """Per token, per slot, float64, weights decoded bit by bit."""
    i = experts.intermediate_size
    if experts.gate_up is not None:
        gu = naive_dequant_weight(experts.gate_up)
        wg, wu = gu[:, :i], gu[:, i:]
    else:
        wg, wu = naive_dequant_weight(experts.gate), naive_dequant_weight(experts.up)
    wd = naive_dequant_weight(experts.down)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = torch.nn.functional.silu(wg[e] @ xt) * (wu[e] @ xt)
            out[t] += float(w[t, j]) * (wd[e] @ h)
    return out


@pytest.mark.parametrize("fused,symmetric", [(True, True), (False, False)])
def test_reference_matches_naive(fused, symmetric):
    gen = torch.Generator().manual_seed(1)
    ex = random_int4_experts(4, 64, 32, 32, symmetric=symmetric, fused_gate_up=fused, generator=gen)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    ids, w = _routing(5, 2, 4, gen)
    assert rel_err(fused_moe_int4_ref(x, ids, w, ex), _naive_moe(x, ids, w, ex)) < 8e-3


MOE_CASES = [
    # T, k, E, D, I, group, symmetric, fused, used experts (None = all)
    (1, 2, 8, 64, 32, 32, True, True, None),          # single decode token: 2 experts of 8 do work
    (9, 2, 6, 128, 64, 64, False, True, [0, 2, 3]),   # experts 1, 4, 5 empty
    (20, 3, 4, 128, 64, 128, True, False, None),      # separate gate/up, several blocks per expert
    (6, 2, 4, 96, 48, 32, False, False, [1, 3]),      # D, I not multiples of BLOCK_K / BLOCK_N
    (5, 2, 4, 64, 40, None, True, True, None),        # channel-wise scales
]


@needs_triton
@pytest.mark.parametrize("t,k,e,d,i,group,symmetric,fused,used", MOE_CASES)
def test_kernel_matches_reference(t, k, e, d, i, group, symmetric, fused, used):
    gen = torch.Generator().manual_seed(t * 100 + e)
    ex = random_int4_experts(e, d, i, group, symmetric=symmetric, fused_gate_up=fused, generator=gen)
    x = torch.randn(t, d, generator=gen).to(torch.bfloat16)
    ids, w = _routing(t, k, e, gen, used)
    want = fused_moe_int4_ref(x, ids, w, ex)
    ex_d = Int4Experts(**{f: getattr(ex, f).to(DEVICE) for f in ("down", "gate_up", "gate", "up")
                          if getattr(ex, f) is not None})
    got = fused_moe_int4(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), ex_d, backend="triton")
    assert got.shape == (t, d) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < MOE_TOL


@needs_triton
def test_kernel_small_block_m_and_fp16():
    gen = torch.Generator().manual_seed(7)
    ex = random_int4_experts(3, 64, 32, 32, generator=gen)
    x = torch.randn(11, 64, generator=gen).to(torch.float16)
    ids, w = _routing(11, 2, 3, gen)
    got = fused_moe_int4(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE),
                         Int4Experts(down=ex.down.to(DEVICE), gate_up=ex.gate_up.to(DEVICE)),
                         backend="triton", block_m=16)
    assert rel_err(got, fused_moe_int4_ref(x, ids, w, ex)) < MOE_TOL


def test_experts_validation():
    down = random_int4(64, 32, 32, num_experts=2)
    with pytest.raises(ValueError, match="either gate_up"):
        Int4Experts(down=down)
    with pytest.raises(ValueError, match="shapes"):
        Int4Experts(down=down, gate_up=random_int4(32, 64, 32, num_experts=2))
    with pytest.raises(ValueError, match="3-D"):
        Int4Experts(down=random_int4(64, 32, 32), gate_up=random_int4(64, 64, 32))
