"""KV-cache bytes per token: what one token caches per layer (GQA: K and V of every KV head; MLA: one
latent plus the rotated rope part; GLM-5's DSA indexer: one key), in BF16, FP8 and DeepSeek's
`fp8_ds_mla` layout, whole-model or per GPU of a tensor-parallel group."""

from __future__ import annotations

from dataclasses import dataclass

from ..arch import ModelSpec
from ..errors import ConfigError

KV_DTYPES = ("bfloat16", "float8_e4m3", "fp8_ds_mla")
# FP8 "fp8_ds_mla" (DeepSeek FlashMLA): FP8 latent with one fp32 scale per 128 values, rope part in BF16.
DS_MLA_TILE = 128


@dataclass(frozen=True)
class KVLayout:
    """What one token caches per layer. GQA: K and V of every KV head; MLA: one latent of kv_lora_rank
    values plus the rotated k_pe of qk_rope_head_dim values; DSA indexer: one K of index_head_dim."""

    kind: str  # "gqa" | "mla"
    layers: int  # layers with a KV cache (decoder layers; MTP layers are not served)
    kv_heads: int  # GQA KV heads (MLA: 1)
    head_dim: int  # GQA head_dim
    latent: int = 0  # MLA kv_lora_rank
    rope: int = 0  # MLA qk_rope_head_dim
    indexer_layers: int = 0
    indexer_dim: int = 0

    @property
    def values_per_layer(self) -> int:
        return self.latent + self.rope if self.kind == "mla" else 2 * self.kv_heads * self.head_dim

    def bytes_per_token(self, dtype: str, tp: int = 1) -> int | None:
        """Bytes one token of KV takes on one GPU of a TP group of `tp` (tp=1: the whole model).
        MLA latents and indexer keys are replicated on every rank; GQA KV heads shard over the ranks
        (ceil(kv_heads / tp) per rank: replicated once tp exceeds the head count)."""
        if dtype not in KV_DTYPES:
            raise ConfigError(f"unknown KV dtype {dtype!r}", hint=f"choose one of {', '.join(KV_DTYPES)}")
        if self.kind == "mla":
            if dtype == "bfloat16":
                per = 2 * (self.latent + self.rope)
            elif dtype == "float8_e4m3":
                per = self.latent + self.rope  # one per-tensor scale: nothing per token
            else:  # latent in FP8 + fp32 scale per 128 values, rope kept in BF16 (512 + 16 + 128 = 656)
                per = self.latent + 4 * -(-self.latent // DS_MLA_TILE) + 2 * self.rope
        else:
            if dtype == "fp8_ds_mla":
                return None
            heads = -(-self.kv_heads // max(1, tp))
            per = 2 * heads * self.head_dim * (2 if dtype == "bfloat16" else 1)
        idx = 0
        if self.indexer_layers:
            d = self.indexer_dim
            idx = {"bfloat16": 2 * d, "float8_e4m3": d, "fp8_ds_mla": d + 4 * -(-d // DS_MLA_TILE)}[dtype]
        return self.layers * per + self.indexer_layers * idx


def kv_layout(spec: ModelSpec) -> KVLayout:
    idx = sum(spec.indexer[: spec.num_layers]) if spec.indexer else 0
    if spec.attention == "mla":
        return KVLayout("mla", spec.num_layers, 1, 0, spec.kv_lora_rank, spec.qk_rope_head_dim, idx,
                        spec.index_head_dim)
    return KVLayout("gqa", spec.num_layers, spec.num_kv_heads, spec.head_dim)
