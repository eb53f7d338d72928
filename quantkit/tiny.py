"""Tiny Mixture-of-Experts checkpoints built locally from transformers configs (no downloads): what
`quantkit demo` converts, and the fixtures the tests and benchmarks build on (quantkit/testing.py).

Every model here is random-weight and deterministic for a given seed; shapes are chosen so that every
group size the tests use (32/64/128) divides the expert input dimensions unless a caller asks otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .hf import quiet_transformers
from .pack.names import Tensor

# One small config per supported architecture. hidden=128 and moe_intermediate=64 keep every routed
# expert Linear group-32 and group-64 divisible; `hidden` 128 makes group 128 divisible for gate/up.
ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "glm_moe_dsa", "olmoe")


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
        "olmoe": dict(num_experts=experts, num_experts_per_tok=2, intermediate_size=moe_intermediate),
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
    `arch` "kimi_k25" builds the Kimi K2.5 wrapper (`make_tiny_kimi_k25`; overrides go to it).

    The weights are re-drawn with a fixed generator (std 0.02, norms 1) so results do not depend on
    transformers' init code, then saved with `save_pretrained` exactly as a hub checkpoint would be.
    """
    if arch == "kimi_k25":  # a multimodal wrapper around a deepseek_v3-shaped text model
        return make_tiny_kimi_k25(out_dir, seed=seed, dtype=dtype, max_shard_size=max_shard_size, layers=layers,
                                  **overrides)
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


# ---- Kimi K2.5 / K2.6: a multimodal wrapper around a DeepSeek-V3-shaped text model -----------------------
KIMI_K25_PREFIX = "language_model."


def make_tiny_kimi_k25(out_dir: str | os.PathLike, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                       max_shard_size: str = "300KB", layers: int = 2, int4_experts: bool | str = False,
                       **overrides) -> Path:
    """A tiny Kimi K2.5 checkpoint (model_type `kimi_k25`): a random deepseek_v3-shaped text model with
    `topk_method: noaux_tc` (as the real configs have; `overrides` go to its config), optionally with its
    routed experts INT4 pack-quantized group 32 symmetric as the releases ship them (`int4_experts`: True
    converts them with quantkit's own int4-experts-rtn recipe, 16 levels q in [-8, 7]; "qat" then puts
    them on Kimi's own 15-level grid, `kimi_int4_grid`), wrapped by `wrap_kimi_k25`."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="quantkit-k25-") as tmp:
        text = make_tiny_model("deepseek_v3", Path(tmp) / "text", seed=seed, dtype=dtype,
                               max_shard_size=max_shard_size, layers=layers,
                               **{"topk_method": "noaux_tc", **overrides})
        if int4_experts:
            from .convert import ConvertOptions, convert

            convert(text, Path(tmp) / "int4", ConvertOptions(recipe="int4-experts-rtn", model_card=False))
            text = Path(tmp) / "int4"
            if int4_experts == "qat":
                kimi_int4_grid(text)
        return wrap_kimi_k25(text, out_dir, seed=seed)


def kimi_int4_grid(ckpt_dir: str | os.PathLike) -> int:
    """Rewrite, in place, every symmetric INT4 module of a quantkit INT4 checkpoint onto the grid Kimi's
    QAT releases use: per group of 32, scale = amax / 7 (bf16), q = round(w / scale) in [-7, 7] (15
    levels), w being the module's current decoded weight. Same tensors, dtypes and shapes, so the index
    and config stay valid. Returns the number of modules rewritten."""
    from .pack.int4 import dequantize_module, pack_int4
    from .read.checkpoint import Checkpoint
    from .read.safetensors import SafetensorsFile
    from .write.writer import write_safetensors

    n = 0
    for shard in Checkpoint.open(ckpt_dir).shards:
        with SafetensorsFile(shard.header) as f:
            tensors = {name: f.get(name).clone() for name in shard.tensors}
        for name in [t for t in tensors if t.endswith(Tensor.PACKED.dotted) and tensors[t].dtype == torch.int32]:
            m = name[: -len(Tensor.PACKED.dotted)]
            w = dequantize_module({s: tensors[f"{m}.{s}"] for s in (Tensor.PACKED, Tensor.SCALE, Tensor.SHAPE)})
            g = w.unflatten(-1, (-1, 32))  # [N, G, 32]
            scale = (g.abs().amax(-1) / 7).to(torch.bfloat16)
            sf = scale.float().clamp(min=torch.finfo(torch.float32).tiny)
            q = torch.round(g / sf.unsqueeze(-1)).clamp_(-7, 7).flatten(-2)
            tensors[name], tensors[Tensor.SCALE.of(m)] = pack_int4(q.to(torch.int8)), scale.to(tensors[Tensor.SCALE.of(m)].dtype)
            n += 1
        write_safetensors(Path(ckpt_dir) / shard.name, tensors, metadata={"format": "pt"})
    return n


def wrap_kimi_k25(text_dir: str | os.PathLike, out_dir: str | os.PathLike, *, seed: int = 0,
                  text_model_type: str = "kimi_k2") -> Path:
    """Write the checkpoint in `text_dir` (a deepseek_v3 model, dense or quantized) as Kimi K2.5 lays it
    out: every tensor under `language_model.` (`language_model.model.layers.*`, `language_model.lm_head`),
    a few small random `vision_tower.*` / `mm_projector.*` tensors in a shard of their own, and config.json
    `{"model_type": "kimi_k25", "text_config": {..., "model_type": text_model_type}, "vision_config": ...}`
    with the text model's `quantization_config` moved to the top level (its ignore list the release's
    prefix-free patterns, the vision modules ignored). Shards keep the text model's names and split."""
    import json

    from .read.checkpoint import INDEX_NAME, Checkpoint
    from .read.safetensors import SafetensorsFile
    from .write.writer import write_safetensors

    src, out = Checkpoint.open(text_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p = KIMI_K25_PREFIX
    weight_map, total = {}, 0
    for shard in src.shards:
        with SafetensorsFile(shard.header) as f:
            tensors = {p + n: f.get(n) for n in shard.tensors}
        total += write_safetensors(out / shard.name, tensors, metadata={"format": "pt"})
        weight_map.update({n: shard.name for n in tensors})
    text = {k: v for k, v in src.config.items() if k not in ("quantization_config", "transformers_version")}
    hidden, g = text["hidden_size"], torch.Generator().manual_seed(seed + 1)
    vision = {  # stand-ins: nothing in quantkit reads the vision tower, it is only carried along
        "vision_tower.patch_embed.proj.weight": torch.randn(16, 3, 2, 2, generator=g) * 0.02,
        "vision_tower.patch_embed.proj.bias": torch.zeros(16),
        "vision_tower.encoder.final_layernorm.weight": torch.ones(16),
        "mm_projector.pre_norm.weight": torch.ones(16),
        "mm_projector.proj.0.weight": torch.randn(64, 64, generator=g) * 0.02,
        "mm_projector.proj.2.weight": torch.randn(hidden, 64, generator=g) * 0.02,
    }
    vision = {n: t.to(torch.bfloat16) for n, t in vision.items()}
    total += write_safetensors(out / "model-vision.safetensors", vision, metadata={"format": "pt"})
    weight_map.update({n: "model-vision.safetensors" for n in vision})
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "model_type": "kimi_k25",
        "dtype": text.get("dtype") or text.get("torch_dtype") or "bfloat16",
        "tie_word_embeddings": False,
        "media_placeholder_token_id": text["vocab_size"] - 1,
        "text_config": {**text, "model_type": text_model_type, "architectures": ["DeepseekV3ForCausalLM"]},
        # transformers' own Kimi_K25VisionConfig fields (tiny): the stand-in tensors above have its shapes
        "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 2, "hidden_size": 16,
                          "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
                          "merge_kernel_size": [2, 2], "pos_emb_height": 4, "pos_emb_width": 4, "pos_emb_time": 2},
        "projection_hidden_size": 16,
    }
    qc = src.config.get("quantization_config")
    if qc is not None:
        qc = json.loads(json.dumps(qc))
        # the release's own list (prefix-free patterns: transformers renames the wrapper's modules
        # model.language_model.*, vLLM keeps language_model.model.*), with the vision parts beside it
        qc["ignore"] = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]
        for grp in (qc.get("config_groups") or {}).values():  # exact module names move; class names stay
            grp["targets"] = [t if t.startswith("re:") or t[:1].isupper() else p + t for t in grp.get("targets") or []]
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    return out
