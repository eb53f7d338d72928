"""Tiny Mixture-of-Experts checkpoints built locally from transformers configs (no downloads).

Used by the test suite, the benchmarks and `quantkit demo`. Every model here is random-weight and
deterministic for a given seed; shapes are chosen so that every group size the tests use (32/64/128)
divides the expert input dimensions unless a caller asks otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# One small config per supported architecture. hidden=128 and moe_intermediate=64 keep every routed
# expert Linear group-32 and group-64 divisible; `hidden` 128 makes group 128 divisible for gate/up.
ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "glm_moe_dsa")


def tiny_config(arch: str, *, layers: int = 2, hidden: int = 128, experts: int = 4, moe_intermediate: int = 64,
                vocab: int = 512, **overrides):
    """A transformers config object for a tiny model of `arch`."""
    import transformers

    base = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    mla = dict(q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
               num_key_value_heads=4)
    routed = dict(moe_intermediate_size=moe_intermediate, n_routed_experts=experts, num_experts_per_tok=2,
                  n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
    extra = {
        "qwen3_moe": dict(moe_intermediate_size=moe_intermediate, num_experts=experts, num_experts_per_tok=2,
                          head_dim=32, decoder_sparse_step=1, mlp_only_layers=[]),
        "mixtral": dict(num_local_experts=experts, num_experts_per_tok=2, intermediate_size=moe_intermediate),
        "deepseek_v3": dict(**routed, **mla),
        "glm4_moe": dict(**routed, head_dim=32),
        "glm_moe_dsa": dict(**routed, **mla, index_n_heads=2, index_head_dim=32, index_topk=16),
        "qwen3": dict(head_dim=32),
        "llama": dict(),
    }
    if arch not in extra:
        raise ValueError(f"no tiny config for {arch!r}; known: {sorted(extra)}")
    kw = {**base, **extra[arch], **overrides}
    return transformers.CONFIG_MAPPING[arch](**kw)


def make_tiny_model(arch: str, out_dir: str | os.PathLike, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                    max_shard_size: str = "300KB", layers: int = 2, **overrides) -> Path:
    """Build a random tiny `arch` model, save it sharded as safetensors to `out_dir`, return the path.

    The weights are re-drawn with a fixed generator (std 0.02, norms 1) so results do not depend on
    transformers' init code, then saved with `save_pretrained` exactly as a hub checkpoint would be.
    """
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    cfg = tiny_config(arch, layers=layers, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1:
                p.fill_(1.0) if "norm" in name else p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model = model.to(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def quiet_transformers() -> None:
    """Silence transformers' info logs and progress bars (they go to stderr and drown our output)."""
    import transformers

    os.environ.setdefault("TQDM_DISABLE", "1")  # compressed-tensors' per-module progress bars
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        from compressed_tensors.logger import logger as ct_logger

        ct_logger.remove()
    except Exception:  # compressed-tensors is optional at run time
        pass


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """Load a (possibly quantized) checkpoint with transformers on CPU."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def read_json(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
