"""Observers: small stateful objects that hook a materialized decoder layer and record statistics.

- `KVCacheObserver`: the running amax of exactly what a serving engine writes to its KV cache
  (docs/format.md, "KV-cache FP8 scales"), recomputed from the attention module's inputs with the
  module's own projections/norms and the model's own `apply_rotary_pos_emb`:
  * GQA (llama, qwen3, qwen3_moe, mixtral, glm4_moe): K = rope(k_norm(k_proj(x))) (k_norm only where the
    model has one and uses it), V = v_proj(x); per KV head, shape [B, H_kv, T, head_dim].
  * MLA (deepseek_v3 / Kimi K2 / K2.5, glm_moe_dsa / GLM-5): the cached latent = cat(kv_a_layernorm(c_kv),
    rope(k_pe)), where kv_a_proj_with_mqa(x) = [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]; one "head"
    of 576 values on Kimi K2 and GLM-5. vLLM quantizes that latent with one scale for K and V, so
    k_amax == v_amax. GLM-5's RoPE is always the interleaved one (its modeling file has no other).
  * DSA indexer keys (glm_moe_dsa layers with their own indexer): the indexer caches one more key per token,
    cat(rope(k_rot), k_pass) of k_norm(wk(x)) (index_head_dim = 128 on GLM-5). Its amax is recorded
    (`indexer_k_amax`) for the report, but no scale is written: vLLM stores those keys in FP8 with a scale
    per 128 values computed when they are cached (docs/calibration.md, "GLM-5").
  The recomputation costs one extra K/V projection per layer; it never touches the attention itself, so
  it does not depend on which attention kernel runs.
- `ExpertTokenCounter`: how many calibration tokens the router sent to each routed expert (the top-k
  indices the routed experts are called with, counted from the call's sorted routing, `moe.routing_for`,
  which the batched expert forward and the GPTQ/AWQ statistics share).

Both follow one protocol: `attach(layer_idx, layer) -> [hook handles]` (the executor removes them).
"""

from __future__ import annotations

import torch
from torch import nn

from ..arch import traits
from ..arch.layout import EXPERTS, FUSED_GATE_UP, HF_BLOCK, KV_A, ROUTER
from ..errors import CalibrationError
from ..quant.fp8 import FP8_MAX
from .executor import modeling_module
from .moe import routing_for

FP8_E4M3_MAX = FP8_MAX  # largest finite float8_e4m3fn; scale = amax / 448 (vLLM, compressed-tensors)
MIN_SCALE = torch.finfo(torch.float32).tiny  # never write a zero scale (0/0 at serving time)


def is_mla(attn: nn.Module) -> bool:
    return hasattr(attn, KV_A)


def cached_kv(attn: nn.Module, hidden_states: torch.Tensor,
              position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the engine caches for these tokens: (K, V) as [B, H_kv, T, head_dim]; for MLA the latent
    [B, 1, T, kv_lora_rank + qk_rope_head_dim] twice. `hidden_states` is the attention module's input
    (after input_layernorm) [B, T, D]; `position_embeddings` the (cos, sin) the model passes it."""
    mod = modeling_module(attn)
    cos, sin = position_embeddings
    b, t, _ = hidden_states.shape
    if is_mla(attn):
        ckv = attn.kv_a_proj_with_mqa(hidden_states)  # [B, T, R + P]
        c_kv, k_pe = torch.split(ckv, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        c_kv = attn.kv_a_layernorm(c_kv).view(b, 1, t, attn.kv_lora_rank)
        k_pe = k_pe.view(b, 1, t, attn.qk_rope_head_dim)
        _, k_pe = _mla_rope(mod, attn)(k_pe, k_pe, cos, sin)
        latent = torch.cat([c_kv, k_pe], dim=-1)  # [B, 1, T, R + P]
        return latent, latent
    head_dim = attn.head_dim
    k = attn.k_proj(hidden_states)  # [B, T, H_kv * hd]
    k_norm = getattr(attn, "k_norm", None)
    if k_norm is None or not getattr(attn, "use_qk_norm", True):
        k = k.view(b, t, -1, head_dim)
    elif getattr(traits(attn.config.model_type), "qk_norm_whole", False):
        k = k_norm(k).view(b, t, -1, head_dim)
    else:
        k = k_norm(k.view(b, t, -1, head_dim))  # [B, T, H_kv, hd]
    k = k.transpose(1, 2)  # [B, H_kv, T, hd]
    v = attn.v_proj(hidden_states).view(b, t, -1, head_dim).transpose(1, 2)
    _, k = mod.apply_rotary_pos_emb(k, k, cos, sin)
    return k, v


def _mla_rope(mod, attn: nn.Module):
    """The RoPE an MLA attention applies to k_pe: interleaved when the config says `rope_interleave`
    (DeepSeek-V3 / Kimi) or when the modeling file has no other (glm_moe_dsa)."""
    if getattr(attn.config, "rope_interleave", False) or not hasattr(mod, "apply_rotary_pos_emb"):
        return mod.apply_rotary_pos_emb_interleave
    return mod.apply_rotary_pos_emb


def indexer_keys(attn: nn.Module, hidden_states: torch.Tensor,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
    """The keys a DSA indexer caches for these tokens, [B, T, index_head_dim] (None: no indexer here):
    k_norm(wk(x)), its first qk_rope_head_dim values rotated (interleaved), as GlmMoeDsaIndexer computes them."""
    ix = getattr(attn, "indexer", None)
    if ix is None:
        return None
    mod = modeling_module(attn)
    cos, sin = position_embeddings
    k = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)  # [B, T, 1, D]
    k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    _, k_rot = mod.apply_rotary_pos_emb_interleave(k_rot, k_rot, cos, sin, unsqueeze_dim=2)
    return torch.cat([k_rot, k_pass], dim=-1).squeeze(2)


def _attn_inputs(args, kwargs):
    h = kwargs.get("hidden_states", args[0] if args else None)
    pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
    if h is None or pe is None:
        raise CalibrationError("the attention module was called without hidden_states/position_embeddings",
                               hint="this transformers version calls attention differently; please report it")
    return h, pe


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() / FP8_E4M3_MAX).clamp_min(MIN_SCALE)


class KVCacheObserver:
    """Per layer and KV head, the running max |K| and |V| of what is cached (float32); for DSA layers also
    the running max |K| of the indexer's keys (`indexer_k_amax`, a float per layer with an indexer)."""

    def __init__(self):
        self.k_amax: dict[int, torch.Tensor] = {}  # layer -> [H_kv] (MLA: [1])
        self.v_amax: dict[int, torch.Tensor] = {}
        self.mla: dict[int, bool] = {}
        self.tokens: dict[int, int] = {}
        self.indexer_k_amax: dict[int, float] = {}

    def attach(self, layer_idx: int, layer: nn.Module) -> list:
        attn = layer.self_attn

        def pre_hook(module, args, kwargs):
            h, pe = _attn_inputs(args, kwargs)
            k, v = cached_kv(module, h, pe)
            self.update(layer_idx, k, v, mla=is_mla(module))
            ik = indexer_keys(module, h, pe)
            if ik is not None:
                a = float(ik.detach().abs().amax())
                if a != a or a == float("inf"):
                    raise CalibrationError(f"layer {layer_idx}: the DSA indexer keys hold NaN or Inf")
                self.indexer_k_amax[layer_idx] = max(a, self.indexer_k_amax.get(layer_idx, 0.0))

        return [attn.register_forward_pre_hook(pre_hook, with_kwargs=True)]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, *, mla: bool = False) -> None:
        ka = k.detach().abs().amax(dim=(0, 2, 3)).float().cpu()  # [H_kv]
        va = v.detach().abs().amax(dim=(0, 2, 3)).float().cpu()
        if layer_idx in self.k_amax:
            ka = torch.maximum(ka, self.k_amax[layer_idx])
            va = torch.maximum(va, self.v_amax[layer_idx])
        self.k_amax[layer_idx], self.v_amax[layer_idx] = ka, va
        self.mla[layer_idx] = mla
        self.tokens[layer_idx] = self.tokens.get(layer_idx, 0) + k.shape[0] * k.shape[2]

    def amax(self, layer_idx: int, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_amax, v_amax): shape [1] for strategy "tensor", [H_kv, 1, 1] for "attn_head"."""
        if layer_idx not in self.k_amax:
            raise CalibrationError(f"no attention input was observed in layer {layer_idx}")
        ka, va = self.k_amax[layer_idx], self.v_amax[layer_idx]
        if not (torch.isfinite(ka).all() and torch.isfinite(va).all()):
            raise CalibrationError(f"layer {layer_idx}: the cached K/V hold NaN or Inf")
        if strategy == "tensor":
            return ka.amax().reshape(1), va.amax().reshape(1)
        if strategy == "attn_head":
            return ka.reshape(-1, 1, 1), va.reshape(-1, 1, 1)
        raise ValueError(f"strategy must be 'tensor' or 'attn_head', got {strategy!r}")


class ExpertTokenCounter:
    """Tokens routed to each expert per MoE layer: the per-expert pair counts of the routing the experts are
    called with (the router's top-k indices; the sentinel index E, "no local expert", is not counted)."""

    def __init__(self):
        self.counts: dict[int, torch.Tensor] = {}  # layer -> [E] int64
        self.top_k: dict[int, int] = {}

    def attach(self, layer_idx: int, layer: nn.Module) -> list:
        moe = getattr(layer, HF_BLOCK, None)
        gate, experts = getattr(moe, ROUTER, None), getattr(moe, EXPERTS, None)
        if not isinstance(gate, nn.Module) or experts is None or not hasattr(experts, "num_experts"):
            return []  # a dense layer
        n_exp = int(experts.num_experts)
        self.counts[layer_idx] = torch.zeros(n_exp, dtype=torch.int64)
        self.top_k[layer_idx] = int(getattr(gate, "top_k", 0))

        def hook(module, args):
            idx = args[1] if len(args) > 1 else None  # experts(hidden [T, H], top_k_index [T, k], top_k_weights)
            if not isinstance(idx, torch.Tensor) or idx.dtype.is_floating_point or idx.dtype == torch.bool:
                raise CalibrationError(f"layer {layer_idx}: the routed experts were not called with top-k expert "
                                       "indices")
            wts = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
            if idx.dim() == 2 and (wts is None or wts.shape == idx.shape) and hasattr(module, FUSED_GATE_UP):
                counts = routing_for(module, idx, wts).counts  # shared with the forward of this call
            else:
                counts = torch.bincount(idx.reshape(-1), minlength=n_exp + 1)[:n_exp]
            self.counts[layer_idx] += counts.cpu()

        return [experts.register_forward_pre_hook(hook)]


class ExpertInputAmax:
    """NVFP4 W4A4 input scales: per routed expert of one MoE layer, the largest |input| of its gate/up (the
    tokens the router sends it) and of its down projection (act(x gate^T) * (x up^T) of those tokens, from the
    experts' weights as they are when the layer is observed), and how many tokens it received. Hooks
    `experts.forward(hidden [T, H], top_k_index [T, k], top_k_weights)` with the call's own routing
    (`moe.routing_for`). amax is a maximum, so data-parallel ranks combine exactly in any order (`reduce`)."""

    def __init__(self, experts: nn.Module):
        self.experts = experts
        e = int(experts.gate_up_proj.shape[0])
        self.E = e
        self.gate_up = torch.zeros(e, dtype=torch.float32)  # [E] amax of the gate/up input
        self.down = torch.zeros(e, dtype=torch.float32)  # [E] amax of the down input
        self.tokens = torch.zeros(e, dtype=torch.int64)  # [E] routed (token, slot) pairs
        self.handle = experts.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        x, idx = args[0], args[1] if len(args) > 1 else None
        if not isinstance(idx, torch.Tensor) or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise CalibrationError("the routed experts were not called with top-k expert indices")
        x = x.detach().reshape(-1, module.gate_up_proj.shape[-1])
        wts = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
        idx2 = idx.reshape(x.shape[0], -1)
        routing = (routing_for(module, idx, wts) if idx.dim() == 2 and (wts is None or wts.shape == idx.shape)
                   else routing_for(module, idx2, None))
        gu_w = module.gate_up_proj.detach()
        ga = torch.zeros(self.E, dtype=torch.float32, device=x.device)  # this call's maxima, on the device
        da = torch.zeros(self.E, dtype=torch.float32, device=x.device)
        with torch.no_grad():
            for e, tok, _ in routing.per_expert():
                xe = x.index_select(0, tok).float()  # [n, H]
                g, u = (xe @ gu_w[e].float().T).chunk(2, dim=-1)  # [n, I] each
                ga[e] = xe.abs().amax()
                da[e] = (module.act_fn(g) * u).abs().amax()
        self.gate_up = torch.maximum(self.gate_up, ga.cpu())  # NaN propagates: checked when the scales are made
        self.down = torch.maximum(self.down, da.cpu())
        self.tokens += routing.counts.cpu()

    def reduce(self, par) -> None:
        """Data parallel (calib/parallel.py): every rank ends with the maxima and token sums over all ranks."""
        if par is None or not getattr(par, "distributed", False):
            return
        parts = par.world.all_gather((self.gate_up, self.down, self.tokens))
        self.gate_up = torch.stack([p[0] for p in parts]).amax(0)
        self.down = torch.stack([p[1] for p in parts]).amax(0)
        self.tokens = torch.stack([p[2] for p in parts]).sum(0)

    def remove(self):
        self.handle.remove()


class LinearInputAmax:
    """NVFP4 W4A4 input scale of a dense Linear: the largest |input| over every calibration token."""

    def __init__(self, module: nn.Module):
        self.amax = torch.zeros((), dtype=torch.float32)
        self.tokens = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        x = args[0].detach()
        self.amax = torch.maximum(self.amax, x.abs().amax().float().cpu())
        self.tokens += x.numel() // x.shape[-1]

    def reduce(self, par) -> None:
        if par is None or not getattr(par, "distributed", False):
            return
        parts = par.world.all_gather((self.amax, self.tokens))
        self.amax = torch.stack([p[0] for p in parts]).amax()
        self.tokens = sum(p[1] for p in parts)

    def remove(self):
        self.handle.remove()
