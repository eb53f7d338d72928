"""NVFP4 W4A4 as engines run it on Blackwell: NVFP4 weights and NVFP4 activations, the activations quantized when
the layer runs (quant/fp4_act.py: an FP8 e4m3 scale per 16 values computed from the data, under the module's
static `input_global_scale`, E2M1 rounding to nearest even, saturation at 448 / 6), fp32 accumulation of the
products. A torch reference (the error users see, for `verify`); no kernel: FP4 tensor cores are Blackwell's.

Which input scale an expert's tokens are quantized with depends on vLLM 0.33.0's backend (docs/engine.md A4):

    scales="layer"   FlashInfer (TRT-LLM, CuTe-DSL, CUTLASS; tried first): one scale per layer and projection,
                     1 / max over experts of 1 / input_global_scale = the smallest scale (the largest amax)
    scales="expert"  vLLM's CUTLASS: each expert its own; w13's = the smaller of gate's and up's

Numerics, per routed expert e with tokens x_e [n, D] (float32 throughout, as the tensor cores accumulate):
    x13   = fq(x_e, gs13)                    fq = quant/fp4_act.fake_quantize_act_nvfp4 in float32
    a     = silu(x13 @ gate_e^T) * (x13 @ up_e^T)      weights: their float32 dequantization (pack/fp4.py)
    y_e   = fq(a, gs2) @ down_e^T * router weight
summed per token in float32, rounded once to the output dtype. The engines' intermediate `a` may be rounded to
bf16 before its quantization; that rounding (2^-9 relative) is below the FP4 step (2^-2) and left out.

Legend: T = tokens, D = hidden, I = moe intermediate, E = experts, k = experts per token.
"""

from __future__ import annotations

import torch

from ..quant.fp4_act import fake_quantize_act_nvfp4
from .fp4 import FP4Experts

__all__ = ["SCALE_MODES", "layer_input_scales", "w4a4_gemm_ref", "w4a4_moe_ref"]

SCALE_MODES = ("layer", "expert")


def layer_input_scales(gs13: torch.Tensor, gs2: torch.Tensor, scales: str = "layer") -> tuple[torch.Tensor, torch.Tensor]:
    """The input global scale each expert's tokens are quantized with: gs13 [E, 2] (gate, up) and gs2 [E] as
    stored -> ([E], [E]) float32, per `scales` (module docstring)."""
    if scales not in SCALE_MODES:
        raise ValueError(f"scales must be one of {SCALE_MODES}, got {scales!r}")
    g13 = gs13.float().reshape(gs13.shape[0], -1)
    if not (bool(torch.isfinite(g13).all()) and bool(torch.isfinite(gs2).all()) and bool((g13 > 0).all())
            and bool((gs2 > 0).all())):
        raise ValueError("an input_global_scale is NaN, Inf, zero or negative")
    a13 = (1.0 / g13).amax(dim=1)  # [E] vLLM: a13_scale.max(dim=1) of the reciprocals
    a2 = 1.0 / gs2.float().reshape(-1)
    if scales == "layer":  # FlashInfer: amax_for_moe_activation_quant, repeated over the experts
        a13 = a13.amax().expand_as(a13)
        a2 = a2.amax().expand_as(a2)
    return 1.0 / a13, 1.0 / a2


def w4a4_gemm_ref(x: torch.Tensor, w: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """y = fq(x) @ w^T in float32: x [..., K], w [N, K] (the float32 dequantized FP4 weight), scale float32 [1]
    -> [..., N] float32."""
    return fake_quantize_act_nvfp4(x.float(), input_global_scale.float().reshape(1)) @ w.float().T


def w4a4_moe_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: FP4Experts,
                 gs13: torch.Tensor, gs2: torch.Tensor, *, scales: str = "layer",
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """SiLU-gated routed experts in NVFP4 W4A4 (module docstring). hidden [T, D], topk_ids / topk_weights [T, k],
    `experts` NVFP4 (w13 [E, 2I, D], w2 [E, D, I]), gs13 [E, 2] / gs2 [E] the stored input global scales ->
    [T, D] in `out_dtype` (default hidden.dtype)."""
    if experts.kind != "nvfp4":
        raise ValueError(f"W4A4 takes NVFP4 experts, got {experts.kind}")
    t, d = hidden.shape
    i = experts.intermediate_size
    s13, s2 = layer_input_scales(gs13, gs2, scales)
    x = hidden.float()
    out = torch.zeros((t, d), dtype=torch.float32, device=hidden.device)  # [T, D]
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)  # [n_e] each
        w13 = experts.w13.expert(e).dequantize()  # [2I, D] float32
        wd = experts.w2.expert(e).dequantize()  # [D, I]
        h = w4a4_gemm_ref(x[tok], w13, s13[e])  # [n_e, 2I]
        a = torch.nn.functional.silu(h[:, :i]) * h[:, i:]  # [n_e, I]
        y = w4a4_gemm_ref(a, wd, s2[e]) * topk_weights[tok, slot].float()[:, None]  # [n_e, D]
        out.index_add_(0, tok, y)
    return out.to(out_dtype or hidden.dtype)
