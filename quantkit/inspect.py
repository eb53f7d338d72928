"""`quantkit inspect`: what a checkpoint holds, per scheme — reads config.json and headers only.

Each tensor is attributed to the scheme of the module it belongs to, as read/sources.py reads the
checkpoint (the same reading `convert` does): a block-FP8 release's `weight` + `weight_scale_inv`
count under `fp8-block128x128`, a compressed-tensors INT4 module's `weight_packed` / `weight_scale` /
`weight_shape` under its group's label (e.g. `int4-g32-sym`), FP8 KV-cache scales under `kv-scales`,
and everything else under its dtype (`bfloat16`, `float32`, ...). `modules` counts quantized modules
(one per weight). A checkpoint whose format convert cannot read is still inspected, by dtype, with
the reason in `format_problem`.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from .read.checkpoint import Checkpoint, read_manifest
from .read.sources import detect_format, scan
from .errors import QuantkitError, SourceFormatError
from .pack.kv import KV_SCALE
from .pack.manifest import MANIFEST_NAME



def inspect_checkpoint(path: str | os.PathLike) -> dict:
    ck = Checkpoint.open(path)
    qc = ck.quantization_config or {}
    problem = None
    try:
        fmt = detect_format(ck.config)
        stored = scan(ck, fmt)
    except SourceFormatError as e:
        fmt, stored, problem = None, {}, e.message
    owner = {t: sw for sw in stored.values() for _, t in sw.tensors}
    schemes: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "modules": 0, "bytes": 0})
    for name in sorted(ck.location):
        info = ck.info(name)
        sw = owner.get(name)
        if sw is not None:
            label = sw.label
            if name == sw.primary:
                schemes[label]["modules"] += 1
        elif KV_SCALE.match(name):
            label = "kv-scales"
        else:
            label = str(info.dtype).removeprefix("torch.")
        schemes[label]["tensors"] += 1
        schemes[label]["bytes"] += info.nbytes
    manifest_status = None
    if (ck.root / MANIFEST_NAME).is_file():
        manifest_status = read_manifest(ck.root, QuantkitError).get("status")
    return {
        "path": str(Path(path)),
        "model_type": ck.config.get("model_type"),
        "architectures": ck.config.get("architectures"),
        "quantization": ({"quant_method": qc.get("quant_method"), "format": qc.get("format") or qc.get("fmt"),
                          "kv_cache_scheme": qc.get("kv_cache_scheme")} if qc else None),
        "source_format": fmt.describe() if fmt else None,
        "format_problem": problem,
        "manifest_status": manifest_status,
        "shards": len(ck.shards),
        "tensors": len(ck.location),
        "total_bytes": ck.total_bytes,
        "schemes": dict(sorted(schemes.items())),
    }
