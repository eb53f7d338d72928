"""The transformers side of quantkit: quiet logs, and loading a checkpoint as a transformers model (the
executor builds its layers through transformers' modeling code; `verify` and the demo load whole models)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def quiet_transformers(compressed_tensors: bool = True) -> None:
    """Silence transformers' info logs and progress bars (they go to stderr and drown our output), and
    compressed-tensors' logger when `compressed_tensors` (importing that package costs ~2 s: callers that
    never load a compressed-tensors checkpoint pass False)."""
    import transformers

    os.environ.setdefault("TQDM_DISABLE", "1")  # compressed-tensors' per-module progress bars
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if not compressed_tensors:
        return
    try:
        from compressed_tensors.logger import logger as ct_logger

        ct_logger.remove()
    except Exception:  # compressed-tensors is optional at run time
        pass


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """Load a (possibly quantized) checkpoint with transformers on CPU: a causal LM, or for a multimodal
    wrapper (Kimi K2.5) its image-text-to-text class, whose forward takes text alone."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from .arch import WRAPPERS

    quiet_transformers()
    model_type = read_json(Path(path) / "config.json").get("model_type")
    cls = AutoModelForImageTextToText if model_type in WRAPPERS else AutoModelForCausalLM
    return cls.from_pretrained(str(path), dtype=dtype)


def read_json(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def build_config(config: dict):
    """A transformers config object from a config.json dict: the model_type's own config class
    (aliases resolved), without remote code (`auto_map` dropped) and without `quantization_config`
    (quantized sources are dequantized on load by the calibration executor). A multimodal wrapper (Kimi
    K2.5's `kimi_k25`) is built as its text model, from its `text_config` (arch.WRAPPERS). What the calibration
    executor builds its layers from, and what `export` reads llama.cpp's hyper-parameters from."""
    import transformers

    from .arch import arch_for, text_config

    spec = arch_for(config, "calibrate")
    text, _ = text_config(config)
    cfg = {k: v for k, v in text.items()
           if k not in ("model_type", "auto_map", "quantization_config", "architectures", "transformers_version")
           and not k.startswith("_")}
    return transformers.CONFIG_MAPPING[spec.model_type](**cfg)
