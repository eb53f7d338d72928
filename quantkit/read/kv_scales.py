"""A KV-scales file, as `quantkit calibrate` writes it: read through the one safetensors reader and each tensor
held to the rules of pack/kv.py."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import KVScalesError
from ..pack.kv import tensor_problem, unprefixed
from .safetensors import SafetensorsFile


def read_kv_scales(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a KV-scales file (as `quantkit calibrate` writes it) and check each tensor on its own."""
    p = Path(path)
    if p.is_dir():
        raise KVScalesError(f"KV-scales file {str(p)[:200]!r} is a directory, not a safetensors file",
                            hint="pass the .safetensors file `quantkit calibrate --output` wrote, not its folder")
    if not p.exists():  # a FIFO or a device exists: the header reader refuses it by kind
        raise KVScalesError(f"KV-scales file {str(p)[:200]!r} does not exist")
    with SafetensorsFile(p) as f:
        scales = {unprefixed(n): f.get(n) for n in f.header.tensors}
    for name, t in scales.items():
        problem = tensor_problem(name, t)
        if problem:
            raise KVScalesError(f"{p.name}: {problem}")
    if not scales:
        raise KVScalesError(f"{p.name}: holds no scales")
    return scales
