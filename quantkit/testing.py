"""Fixtures for the test suite and the benchmarks (never imported by the package itself): the tiny models
(built in quantkit/tiny.py, re-exported here), transformers loading (quantkit/hf.py) and block-FP8 copies
of a checkpoint as the DeepSeek-V3 / Kimi-K2 releases store them.
"""

from __future__ import annotations

import torch

from .hf import load_model, quiet_transformers, read_json  # noqa: F401 (re-exported for tests and benchmarks)
from .arch.layout import EMBED, HF_BLOCK, LM_HEAD, ROUTER
from .pack.names import Tensor
from .tiny import (ARCHS, KIMI_K25_PREFIX, kimi_int4_grid, make_tiny_kimi_k25, make_tiny_model,  # noqa: F401
                   tiny_config, wrap_kimi_k25)


# ---- editing a checkpoint's tensors in place (tests) ---------------------------------------------
def zero_tensors(model_dir, names) -> None:
    """Set the tensors `names` of the checkpoint in `model_dir` to zero in place (each shard holding any of
    them rewritten once)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from .read.checkpoint import Checkpoint

    model_dir = Path(model_dir)
    ck = Checkpoint.open(model_dir)
    by_shard: dict[str, list[str]] = {}
    for name in names:
        by_shard.setdefault(ck.location[name], []).append(name)
    for shard, held in by_shard.items():
        t = load_file(str(model_dir / shard))
        for name in held:
            t[name] = torch.zeros_like(t[name])
        save_file(t, str(model_dir / shard), metadata={"format": "pt"})


# ---- making block-FP8 checkpoints (tests, benchmarks) ---------------------------------------------
def _release_fp8_module(module: str) -> bool:
    """Which Linears the DeepSeek-V3 / Kimi-K2 releases store in FP8: all but the router, the embeddings
    and lm_head (norms are 1-D and never quantized)."""
    return not (module.endswith(f".{HF_BLOCK}.{ROUTER}") or module.endswith(LM_HEAD)
                or EMBED.rsplit(".", 1)[1] in module)


def write_block_fp8_checkpoint(src_dir, dst_dir, block: tuple[int, int] = (128, 128), scale_fmt: str | None = None,
                               is_fp8=_release_fp8_module) -> None:
    """Write a block-FP8 copy of a BF16 checkpoint the way the releases are made: every 2-D Linear
    weight `is_fp8` selects -> float8_e4m3fn `weight` + float32 `weight_scale_inv` (amax / 448 per block,
    or with scale_fmt "ue8m0" the next power of two up), config quantization_config
    {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size}. Streams tensor by tensor."""
    import json
    import shutil
    from pathlib import Path

    from .quant.fp8 import FP8_DTYPE, FP8Layout, choose_scale, quantize
    from .read.checkpoint import INDEX_NAME, Checkpoint
    from .read.safetensors import SafetensorsFile
    from .read.sources import FLOAT_DTYPES
    from .write.writer import ShardWriter

    src, dst = Checkpoint.open(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    layout = FP8Layout("block", tuple(block))
    weight_map = {}
    total = 0
    for shard in src.shards:
        plan = []
        for name, info in shard.tensors.items():
            m = name[: -len(".weight")] if name.endswith(".weight") else None
            if m and len(info.shape) == 2 and info.dtype in FLOAT_DTYPES and is_fp8(m):
                plan.append((name, m))
            else:
                plan.append((name, None))
        specs = []
        for name, m in plan:
            info = shard.tensors[name]
            if m is None:
                specs.append((name, info.dtype, tuple(info.shape)))
            else:
                specs += [(name, FP8_DTYPE, tuple(info.shape)),
                          (Tensor.RELEASE_SCALE.of(m), torch.float32, layout.scale_shape(*info.shape))]
        w = ShardWriter(dst / shard.name, specs, metadata={"format": "pt"})
        with SafetensorsFile(shard.header) as f:
            for name, m in plan:
                t = f.get(name, copy=False)
                if m is None:
                    w.write(name, t)
                    continue
                scale = choose_scale(t, layout, power_of_two=scale_fmt == "ue8m0")
                w.write(name, quantize(t, scale, layout))
                w.write(Tensor.RELEASE_SCALE.of(m), scale)
        w.finish()
        total += w.size
        weight_map.update({n: shard.name for n, _, _ in specs})
    cfg = dict(src.config)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    if scale_fmt:
        cfg["quantization_config"]["scale_fmt"] = scale_fmt
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    (dst / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    for p in src.non_weight_files():
        shutil.copyfile(p, dst / p.name)
