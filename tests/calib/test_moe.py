"""quantkit.calib.moe: the expert-grouped routed-experts forward against transformers' eager loop.

Tolerances (normwise, relative to the largest |output| of the reference):
- float32: 1e-6. Where the batched forward runs the same GEMMs on the same rows in the same order as eager
  (every case here but the split-expert one), the outputs are in fact bit-identical on the machines this was
  written on; the bound leaves room for a BLAS whose results depend on the output buffer or the row count
  (a different accumulation order inside a dot product of length H or I: a few float32 ulps, ~1e-7
  relative), while anything wrong (a wrong expert, weight, gate/up order or a dropped token) is off by
  1e-2 or more.
- bfloat16: 2^-8, one bfloat16 ulp at the output's scale: bfloat16 keeps 8 significant bits, so a
  different rounding at any step (a product, the activation, one accumulation) moves a value by up to half
  an ulp of that intermediate.
"""

from __future__ import annotations

import functools

import pytest
import torch

from quantkit.calib import moe
from quantkit.testing import ARCHS, quiet_transformers, tiny_config

F32_TOL = 1e-6
BF16_TOL = 2.0 ** -8


@functools.cache
def _model(arch: str, experts: int = 4):
    """A tiny `arch` CausalLM with eager experts and random weights drawn as quantkit.testing draws them."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, experts=experts), experts_implementation="eager")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1:
                p.fill_(1.0) if "norm" in name else p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def _moe_blocks(model):
    return [layer.mlp for layer in model.model.layers
            if moe.is_routed_experts(getattr(layer.mlp, "experts", torch.nn.Module()))]


def _eager(experts, *args):
    """transformers' eager experts loop, whatever forward the instance has now."""
    return type(experts).forward.__wrapped__(experts, *args)


def _assert_close(got, ref, tol):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert scale > 0
    assert err <= tol * scale, f"max |diff| {err:.3g} > {tol:.3g} x max |ref| {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_moe_block_matches_eager(arch, dtype):
    model = _model(arch)
    block = _moe_blocks(model)[0]
    block.to(dtype)
    try:
        x = torch.randn(3, 40, block.experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(1))
        x = x.to(dtype)
        with torch.no_grad():
            ref = block(x)
            assert moe.install(block) == [block.experts]
            got = block(x)
            assert moe.uninstall(block) == 1
            again = block(x)
        _assert_close(got, ref, F32_TOL if dtype == torch.float32 else BF16_TOL)
        assert torch.equal(again, ref)  # uninstall restores the eager path
        assert "forward" not in block.experts.__dict__
    finally:
        moe.uninstall(block)
        block.float()


def _routing_case(num_tokens=64, num_experts=8, k=2, hidden=128, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w = torch.rand(num_tokens, k, generator=g).to(dtype)
    return x, w, g


def test_empty_experts_and_sentinel():
    experts = _moe_blocks(_model("qwen3_moe", experts=8))[0].experts
    x, w, g = _routing_case()
    idx = torch.where(torch.rand(64, 2, generator=g) < 0.5, 1, 5)  # experts 1 and 5 only, sometimes both slots
    idx[::7, 1] = 8  # the sentinel (expert index == E): eager skips those pairs
    with torch.no_grad():
        ref = _eager(experts, x, idx, w)
        got = moe.batched_experts_forward(experts, x, idx, w)
    _assert_close(got, ref, F32_TOL)
    r = moe.route(idx, w, 8)
    assert r.counts.tolist() == [int((idx == e).sum()) for e in range(8)]
    assert r.dropped == int((idx == 8).sum()) and [e for e, _, _ in r.segments()] == [1, 5]
    for e in (1, 5):  # the eager loop's pairs, in its order
        slot, token = torch.where((idx == e).t())
        assert torch.equal(r.tokens(e), token) and torch.equal(r.weights(e), w[token, slot])
    # nothing routed at all: zeros, like eager
    none = torch.full_like(idx, 8)
    assert torch.equal(moe.batched_experts_forward(experts, x, none, w), torch.zeros_like(x))


@pytest.mark.parametrize("budget", [moe.DEFAULT_BUDGET, 20_000], ids=["default", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_token_to_one_expert(budget, dtype):
    experts = _moe_blocks(_model("qwen3_moe", experts=8))[0].experts
    experts.to(dtype)
    try:
        x, w, g = _routing_case(num_tokens=200, dtype=dtype)
        idx = torch.stack([torch.full((200,), 3), torch.randint(0, 8, (200,), generator=g)], 1)
        idx[:, 1][idx[:, 1] == 3] = 6
        with torch.no_grad():
            ref = _eager(experts, x, idx, w)
            got = moe.batched_experts_forward(experts, x, idx, w, budget=budget)
        # budget 20 kB: 19 (float32) or 37 (bfloat16) rows a block, so expert 3 runs as 6-11 separate GEMMs
        _assert_close(got, ref, F32_TOL if dtype == torch.float32 else BF16_TOL)
    finally:
        experts.float()


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_other_activations(act):
    """SiLU runs in place; any other act_fn is called as eager calls it (relu: a fresh tensor too)."""
    from transformers.activations import ACT2FN

    experts = _moe_blocks(_model("glm4_moe", experts=8))[0].experts
    saved = experts.act_fn
    experts.act_fn = ACT2FN[act]
    try:
        x, w, g = _routing_case(num_tokens=96)
        idx = torch.randint(0, 8, (96, 2), generator=g)
        with torch.no_grad():
            ref = _eager(experts, x, idx, w)
            got = moe.batched_experts_forward(experts, x, idx, w)
        _assert_close(got, ref, F32_TOL)
    finally:
        experts.act_fn = saved


def test_hooks_see_the_call_and_the_whole_model_matches():
    model = _model("deepseek_v3")
    seen = []
    blocks = _moe_blocks(model)
    handle = blocks[0].experts.register_forward_pre_hook(lambda m, args: seen.append(args))
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    try:
        with torch.no_grad():
            ref = model(ids).logits
            assert len(moe.install(model)) == len(blocks) >= 1
            assert all(moe.installed(b.experts) for b in blocks)
            got = model(ids).logits
    finally:
        moe.uninstall(model)
        handle.remove()
    _assert_close(got, ref, F32_TOL)
    assert len(seen) == 2
    for hidden, idx, w in seen:  # (hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) both times
        assert hidden.shape == (48, 128) and idx.shape == (48, 2) and w.shape == (48, 2)
        assert not idx.dtype.is_floating_point
    assert torch.equal(seen[0][1], seen[1][1])


def test_install_is_idempotent_and_falls_back_under_autograd():
    block = _moe_blocks(_model("mixtral"))[0]
    x = torch.randn(1, 16, 128, generator=torch.Generator().manual_seed(3))
    try:
        moe.install(block)
        moe.install(block, budget=1 << 20)
        with torch.no_grad():
            got = block(x)
        out = block(x.requires_grad_())  # mm(out=) has no autograd: the module's own forward runs
        out.sum().backward()
        assert x.grad is not None
        assert moe.uninstall(block) == 1 and moe.uninstall(block) == 0
        with torch.no_grad():
            _assert_close(got, block(x), F32_TOL)
    finally:
        moe.uninstall(block)
        block.zero_grad(set_to_none=True)


def test_route_rejects_bad_indices():
    w = torch.ones(4, 2)
    with pytest.raises(ValueError):
        moe.route(torch.tensor([[0, 9]] * 4), w, 8)
    with pytest.raises(ValueError):
        moe.route(torch.tensor([[0, -1]] * 4), w, 8)
    with pytest.raises(ValueError):
        moe.route(torch.zeros(4, 2), w, 8)
