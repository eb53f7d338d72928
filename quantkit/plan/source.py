"""What `plan` and `calibration_cost` are asked about: a config.json, a checkpoint directory (its headers,
never its data), a shipped reference config, or a hub id already in the local cache (`resolve`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..read.checkpoint import read_json_file
from .tensors import TensorShapes

REFERENCE_CONFIGS = ("kimi-k2", "glm-4.5", "glm-5")


def tensor_shapes_from_checkpoint(directory: str | Path) -> TensorShapes:
    """{name: (shape, dtype code)} from the validated safetensors headers of a checkpoint directory
    (read.checkpoint: metadata only, no data read)."""
    from ..read.checkpoint import Checkpoint
    from ..read.safetensors import CODE_OF

    ck = Checkpoint.open(directory)
    return {n: (tuple(ck.info(n).shape), CODE_OF[ck.info(n).dtype]) for n in ck.location}


@dataclass(frozen=True)
class Source:
    label: str
    config: Mapping[str, Any]
    checkpoint: Path | None  # directory with *.safetensors, or None (config only)


def _read_json(path: Path) -> Mapping[str, Any]:
    return read_json_file(path, "config file", ConfigError)


def reference_config(name: str) -> dict[str, Any]:
    """A shipped reference config.json (`kimi-k2`, `glm-4.5`, `glm-5`), `_source` provenance included."""
    res = resources.files("quantkit") / "data" / "configs" / f"{name}.json"
    if name not in REFERENCE_CONFIGS or not res.is_file():
        raise ConfigError(f"no reference config named {name!r}", hint=f"shipped: {', '.join(REFERENCE_CONFIGS)}")
    return json.loads(res.read_text(encoding="utf-8"))


def resolve(model_or_config: str | Path) -> Source:
    p = Path(model_or_config)
    if p.is_dir():
        if not (p / "config.json").exists():  # a FIFO or a device exists: read_json_file refuses it by kind
            raise ConfigError(f"{p} has no config.json", hint="pass a checkpoint directory or a config.json file")
        has_shards = any(p.glob("*.safetensors"))
        return Source(str(p), _read_json(p / "config.json"), p if has_shards else None)
    if p.exists():  # a file, or a FIFO / device that read_json_file refuses by kind
        return Source(str(p), _read_json(p), None)
    name = str(model_or_config)
    if name in REFERENCE_CONFIGS:
        return Source(name, reference_config(name), None)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name):  # a hub id already in the local cache (never downloads)
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except Exception:
            cached = None
        if isinstance(cached, str):
            d = Path(cached).parent
            return Source(name, _read_json(Path(cached)), d if any(d.glob("*.safetensors")) else None)
    raise ConfigError(f"{name!r} is not a config.json, a checkpoint directory or a reference config name",
                      hint=f"reference configs: {', '.join(REFERENCE_CONFIGS)}")
