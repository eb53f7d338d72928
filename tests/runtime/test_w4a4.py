"""NVFP4 W4A4 routed experts as vLLM serves them (runtime/w4a4.py): which input scale each expert's tokens get
(FlashInfer: one per layer; vLLM's CUTLASS: per expert, the smaller of gate's and up's), and the expert MLP
against a per-(token, slot) loop written from the definition."""

from __future__ import annotations

import pytest
import torch

from quantkit.quant.fp4 import choose_global_scale, rtn_nvfp4
from quantkit.quant.fp4_act import fake_quantize_act_nvfp4
from quantkit.runtime.fp4 import FP4Experts, PackedFP4, fuse_gate_up_fp4
from quantkit.runtime.w4a4 import layer_input_scales, w4a4_moe_ref

E, D, I = 4, 32, 48


def _packed(w: torch.Tensor, gs: torch.Tensor) -> PackedFP4:
    res = rtn_nvfp4(w, gs)
    return PackedFP4(res.packed, res.scale, res.global_scale, tuple(w.shape[-2:]), "nvfp4")


@pytest.fixture(scope="module")
def experts():
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(E, I, D, generator=gen) * 0.05, torch.randn(E, I, D, generator=gen) * 0.05
    down = torch.randn(E, D, I, generator=gen) * 0.05
    gs = torch.stack([choose_global_scale(gate[e], up[e]) for e in range(E)])  # [E, 1]
    w13 = fuse_gate_up_fp4(_packed(gate, gs), _packed(up, gs))
    return FP4Experts(w13, _packed(down, torch.stack([choose_global_scale(down[e]) for e in range(E)])))


def _rt(x):
    """1 / (1 / x) in float32: vLLM stores 1 / input_global_scale and hands the kernels its reciprocal."""
    return 1.0 / (1.0 / torch.as_tensor(x, dtype=torch.float32))


def test_scale_modes():
    gs13 = torch.tensor([[800.0, 800.0], [500.0, 600.0], [2000.0, 2000.0], [900.0, 900.0]])
    gs2 = torch.tensor([100.0, 50.0, 400.0, 70.0])
    a, b = layer_input_scales(gs13, gs2, "expert")
    assert torch.equal(a, _rt([800.0, 500.0, 2000.0, 900.0])) and torch.equal(b, _rt(gs2))
    a, b = layer_input_scales(gs13, gs2, "layer")
    assert torch.equal(a, _rt([500.0] * 4)) and torch.equal(b, _rt([50.0] * 4))
    for bad in (0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            layer_input_scales(gs13, torch.tensor([100.0, bad, 1.0, 1.0]))


@pytest.mark.parametrize("scales", ["layer", "expert"])
def test_moe_matches_a_per_slot_loop(experts, scales):
    gen = torch.Generator().manual_seed(1)
    t, k = 7, 2
    x = torch.randn(t, D, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=gen)
    gs13 = torch.tensor([[700.0, 700.0], [300.0, 300.0], [1200.0, 1200.0], [650.0, 650.0]])
    gs2 = torch.tensor([9000.0, 4000.0, 12000.0, 20000.0])
    got = w4a4_moe_ref(x, ids, wts, experts, gs13, gs2, scales=scales, out_dtype=torch.float32)
    s13, s2 = ((gs13[:, 0], gs2) if scales == "expert" else (gs13[:, 0].min().expand(E), gs2.min().expand(E)))
    s13, s2 = _rt(s13), _rt(s2)
    want = torch.zeros(t, D)
    for tok in range(t):
        for j in range(k):
            e = int(ids[tok, j])
            w13, w2 = experts.w13.expert(e).dequantize(), experts.w2.expert(e).dequantize()
            xq = fake_quantize_act_nvfp4(x[tok:tok + 1].float(), s13[e].reshape(1))
            h = xq @ w13.T
            a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
            want[tok] += (fake_quantize_act_nvfp4(a, s2[e].reshape(1)) @ w2.T)[0] * wts[tok, j]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_w4a4_error_is_larger_than_w4a16_and_bounded(experts):
    from quantkit.runtime.fp4 import fused_moe_fp4_ref

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, D, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(64)])
    wts = torch.rand(64, 2, generator=gen)
    w16 = fused_moe_fp4_ref(x, ids, wts, experts)
    gs13 = torch.full((E, 2), 448.0 * 6 / float(x.abs().amax()))
    a = torch.stack([torch.nn.functional.silu(x @ experts.w13.expert(e).dequantize()[:I].T).abs().amax()
                     for e in range(E)])  # a rough bound on the down inputs' amax
    gs2 = 448.0 * 6 / (a * 4)
    w4 = w4a4_moe_ref(x, ids, wts, experts, gs13, gs2)
    rel = float((w4 - w16).norm() / w16.norm())
    assert 0 < rel < 0.3  # FP4 activations: ~2^-3 relative per value, averaged down by the dot products
