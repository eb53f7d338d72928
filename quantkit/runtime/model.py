"""The runner's model math, pure functions with the semantics of transformers' modeling files: RMSNorm,
rotary embeddings (halves or DeepSeek's interleaved pairs), routing (softmax top-k; sigmoid + correction
bias with group-limited top-k), dense and MoE MLPs (experts packed, through fused_moe_int4), and causal
attention over one request's own tokens (prefill)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp4 import FP4Experts, fused_moe_fp4
from .fp8 import DenseExperts, W4AFP8Experts, dense_moe
from .fused_moe import fused_moe_int4
from .loader import DenseMLP, MoEBlock
from .spec import MoESpec, RopeSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' *RMSNorm: normalize in fp32, cast back, then scale (in the weight's dtype)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_cos_sin(rope: RopeSpec, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [N, rope.dim] for int positions [N] (cat(freqs, freqs) layout, cast to `dtype`)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [N, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rope.attention_factor).to(dtype), (emb.sin() * rope.attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the first cos.shape[-1] features of x [N, heads, Dh]; cos/sin [N, dim]."""
    dim = cos.shape[-1]
    xr, xp = x[..., :dim], x[..., dim:]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleave:  # DeepSeek: pairs (x0, x1), ...; output de-interleaved like transformers'
        c, s = c[..., : dim // 2], s[..., : dim // 2]
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        rot = torch.cat((-xr[..., dim // 2:], xr[..., : dim // 2]), dim=-1)  # rotate_half
        out = xr * c + rot * s
    return out if xp.shape[-1] == 0 else torch.cat([out, xp], dim=-1)


def route(moe: MoESpec, block: MoEBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router of one MoE layer, as transformers computes it. x [T, D] -> (topk_ids [T, k], weights [T, k])."""
    if moe.scoring == "softmax":  # Qwen3-MoE / Mixtral
        logits = F.linear(x, block.router)  # [T, E] in the activation dtype
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        w, ids = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        if moe.weights_in_act_dtype:
            w = w.to(logits.dtype)
        return ids, w
    # DeepSeek-V3 / GLM-4.5 noaux_tc: sigmoid scores; the bias steers the choice only, weights use scores
    scores = F.linear(x.to(torch.float32), block.router).sigmoid()  # [T, E]
    choice = scores + block.bias
    t, e, g = x.shape[0], moe.num_experts, moe.n_group
    group_scores = choice.view(t, g, e // g).topk(2, dim=-1)[0].sum(-1)  # [T, G] sum of each group's top 2
    group_idx = torch.topk(group_scores, moe.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(t, g, e // g).reshape(t, e)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if moe.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * moe.routed_scaling_factor


def mlp_forward(m: DenseMLP, x: torch.Tensor, backend: str) -> torch.Tensor:
    return m.down(F.silu(m.gate(x, backend)) * m.up(x, backend), backend)


def moe_forward(moe: MoESpec, block: MoEBlock, x: torch.Tensor, backend: str) -> torch.Tensor:
    """x [T, D] -> [T, D]: every routed expert runs packed, through fused_moe_int4 (or fused_moe_fp4)."""
    ids, w = route(moe, block, x)
    if isinstance(block.experts, FP4Experts):
        y = fused_moe_fp4(x, ids, w, block.experts, backend=backend)
    elif isinstance(block.experts, (DenseExperts, W4AFP8Experts)):  # FP8, unquantized or W4AFP8 (torch)
        y = dense_moe(x, ids, w, block.experts)
    else:
        y = fused_moe_int4(x, ids, w, block.experts, backend=backend)
    if block.shared is not None:
        y = y + mlp_forward(block.shared, x, backend)
    return y


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Prefill attention over one request's own tokens. q [T, H, Dq], k [T, Hkv, Dq], v [T, Hkv, Dv]
    -> [T, H, Dv]. Query head h reads KV head h // (H / Hkv), as transformers' repeat_kv and the
    paged kernels do."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=sm_scale)  # [H, T, Dv]
    return out.transpose(0, 1)
