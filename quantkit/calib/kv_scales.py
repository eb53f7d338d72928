"""The result of a KV-cache calibration pass: the FP8 scales (amax / 448 per layer) and everything measured,
built from the observers of a finished pass (`kv_result`: one process in `quantkit.calibrate`, or the
statistics every rank contributed in calib/kv_dist.py), and what the KV observer holds while it runs
(`observer_bytes`, for the memory plans of `calibrate`, `convert` and `plan`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..pack import kv as kvrules
from .executor import LayerExecutor
from .observers import FP8_E4M3_MAX, ExpertTokenCounter, KVCacheObserver, fp8_scale


@dataclass(frozen=True)
class LayerKV:
    """KV statistics of one decoder layer: floats for strategy "tensor", per-head lists for "attn_head"."""

    layer: int
    k_amax: float | list[float]
    v_amax: float | list[float]
    k_scale: float | list[float]
    v_scale: float | list[float]

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "k_amax": self.k_amax, "v_amax": self.v_amax, "k_scale": self.k_scale,
                "v_scale": self.v_scale}


@dataclass
class CalibrationResult:
    model: str
    model_type: str
    attention: str  # "gqa" | "mla"
    strategy: str
    layers: list[LayerKV]  # index = layer
    expert_tokens: dict[int, list[int]]  # MoE layer -> tokens routed to each expert
    scales: dict[str, torch.Tensor]  # tensor name -> float32 [1] or [H_kv, 1, 1]
    data: dict[str, Any]  # source, sha256, num_samples, seq_len, num_tokens, tokenizer, ...
    seconds: float
    peak_rss_bytes: int
    top_k: dict[int, int] = field(default_factory=dict)
    output: str | None = None  # set by write_scales
    # DSA models (glm_moe_dsa): amax of the keys each indexer caches, per layer with an indexer. Reported,
    # never written as a scale: vLLM quantizes those keys with scales it computes per 128 values.
    indexer_k_amax: dict[int, float] = field(default_factory=dict)
    # The text model's tensor prefix in the checkpoint ("language_model." for Kimi K2.5's kimi_k25 wrapper).
    # `scales` (and the scales file) are named relative to the text model, as pack/kv.py defines them;
    # `checkpoint_scales()` gives the names a serving engine loads from a checkpoint of this model.
    prefix: str = ""
    # where the layers ran ("cpu", "cuda:0") and the memory plan (calib/device.py: estimated peak bytes per
    # layer, available bytes, where the activations lived, the measured peak on a GPU)
    device: str | None = None
    memory: dict | None = None

    @property
    def kv_cache_scheme(self) -> dict[str, Any]:
        return kvrules.kv_cache_scheme(self.strategy)

    def checkpoint_scales(self) -> dict[str, torch.Tensor]:
        """`scales` under the names a checkpoint of this model carries them (the wrapper's prefix added:
        vLLM's KimiK25ForConditionalGeneration routes only `language_model.*` to its text model)."""
        return {self.prefix + n: t for n, t in self.scales.items()}

    def to_json(self) -> dict[str, Any]:
        """The `--json` object: contract keys `output`, `layers`, `expert_tokens`, plus extras
        (`indexer_k_amax` for DSA models, `prefix` for wrapped text models)."""
        out = {
            "output": self.output,
            "layers": [lk.to_json() for lk in self.layers],
            "expert_tokens": {str(k): v for k, v in sorted(self.expert_tokens.items())},
            "model": self.model, "model_type": self.model_type, "attention": self.attention,
            "strategy": self.strategy, "kv_cache_scheme": self.kv_cache_scheme, "fp8_max": FP8_E4M3_MAX,
            "top_k": {str(k): v for k, v in sorted(self.top_k.items())},
            "data": self.data, "seconds": round(self.seconds, 3), "peak_rss_bytes": self.peak_rss_bytes,
        }
        if self.indexer_k_amax:
            out["indexer_k_amax"] = {str(k): v for k, v in sorted(self.indexer_k_amax.items())}
        if self.prefix:
            out["prefix"] = self.prefix
        if self.device is not None:
            out["device"] = self.device
            out["device_memory"] = self.memory
        return out


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _floats(t: torch.Tensor, strategy: str) -> float | list[float]:
    return float(t.reshape(-1)[0]) if strategy == "tensor" else [float(x) for x in t.reshape(-1)]


def kv_result(model_dir, ex: LayerExecutor, kv: KVCacheObserver, experts: ExpertTokenCounter, strategy: str, data,
            t0: float, plan) -> CalibrationResult:
    """The scales (amax / 448 per layer) and everything measured, from the observers of a finished pass (one
    process, or the statistics every rank contributed: calib/kv_dist.py)."""
    layers, scales = [], {}
    for i in range(ex.num_layers):
        ka, va = kv.amax(i, strategy)  # [1] or [H_kv, 1, 1]
        ks, vs = fp8_scale(ka), fp8_scale(va)
        layers.append(LayerKV(i, _floats(ka, strategy), _floats(va, strategy), _floats(ks, strategy),
                              _floats(vs, strategy)))
        scales[kvrules.kv_scale_name(i, "k")] = ks
        scales[kvrules.kv_scale_name(i, "v")] = vs
    return CalibrationResult(
        model=str(model_dir), model_type=str(ex.ckpt.config.get("model_type")), attention=ex.spec.attention,
        strategy=strategy, layers=layers, expert_tokens={i: c.tolist() for i, c in sorted(experts.counts.items())},
        scales=scales, data=data.describe(), seconds=time.perf_counter() - t0, peak_rss_bytes=peak_rss_bytes(),
        top_k=dict(experts.top_k), indexer_k_amax=dict(sorted(kv.indexer_k_amax.items())), prefix=ex.prefix,
        device=str(ex.device), memory=plan.to_json())


def observer_bytes(ex: LayerExecutor, tokens: int) -> dict[str, int]:
    """What the KV observer holds during one forward call: the recomputed K and V (or the MLA latent) of a
    batch and their rotated copies, in the compute dtype."""
    cfg = ex.config
    item = torch.empty((), dtype=ex.dtype).element_size()
    if getattr(cfg, "kv_lora_rank", None):
        width = int(cfg.kv_lora_rank) + int(getattr(cfg, "qk_rope_head_dim", 0) or 0)
    else:
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        width = 2 * heads * int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return {"kv_observer": 3 * tokens * width * item}
