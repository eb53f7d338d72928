"""`quantkit inspect`: what a checkpoint holds, per scheme — reads config.json and headers only."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from .io.checkpoint import Checkpoint, read_json_file

PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def _int_label(weights: dict) -> str:
    part = f"g{weights.get('group_size')}" if weights.get("strategy") == "group" else str(weights.get("strategy"))
    return f"int{weights.get('num_bits')}-{part}-{'sym' if weights.get('symmetric', True) else 'asym'}"


def inspect_checkpoint(path: str | os.PathLike) -> dict:
    ck = Checkpoint.open(path)
    qc = ck.quantization_config or {}
    int_label = None
    for g in (qc.get("config_groups") or {}).values():
        w = (g or {}).get("weights") or {}
        if w.get("type") == "int":
            int_label = _int_label(w)
    packed_modules = {n.rsplit(".", 1)[0] for n in ck.location if n.endswith(".weight_packed")}
    schemes: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "modules": 0, "bytes": 0})
    for name in ck.location:
        info = ck.info(name)
        module, _, suffix = name.rpartition(".")
        if module in packed_modules and suffix in PACKED_SUFFIXES:
            label = int_label or "int4-packed"
            if suffix == "weight_packed":
                schemes[label]["modules"] += 1
        elif "float8" in str(info.dtype) or (suffix in ("weight_scale", "weight_scale_inv")
                                             and module + ".weight" in ck.location
                                             and "float8" in str(ck.info(module + ".weight").dtype)):
            label = "fp8"
            if suffix == "weight":
                schemes[label]["modules"] += 1
        else:
            label = str(info.dtype).removeprefix("torch.")
        schemes[label]["tensors"] += 1
        schemes[label]["bytes"] += info.nbytes
    manifest_status = None
    mp = ck.root / "quantkit_manifest.json"
    if mp.is_file():
        manifest_status = read_json_file(mp, "quantkit_manifest.json").get("status")
    return {
        "path": str(Path(path)),
        "model_type": ck.config.get("model_type"),
        "architectures": ck.config.get("architectures"),
        "quantization": ({"quant_method": qc.get("quant_method"), "format": qc.get("format") or qc.get("fmt"),
                          "kv_cache_scheme": qc.get("kv_cache_scheme")} if qc else None),
        "manifest_status": manifest_status,
        "shards": len(ck.shards),
        "tensors": len(ck.location),
        "total_bytes": ck.total_bytes,
        "schemes": dict(sorted(schemes.items())),
    }
