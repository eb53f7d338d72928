"""`quantkit_manifest.json`: what `convert` did to every tensor (docs/format.md, "The manifest").

Written first as {"status": "in_progress", "identity": ...} (so an interrupted conversion never looks
finished and `--resume` can tell its own output), last with "status": "complete". Top-level keys:

    status, format_version, tool {name, version}, identity (what a resume must match), recipe {name,
    sha256, text}, source {config_sha256, format, shards}, shards [{name, size, sha256, source_shard}],
    summary {tensors_total, modules_quantized, modules_passed_through, bytes_read, bytes_written},
    notes, calibration (+ expert_tokens, fallbacks, input_scale_fallbacks), kv_cache, quantization_config, tensors

`tensors` maps every output tensor to {shape, dtype, shard, source_shard, ...}; a quantized module's
tensors add {scheme, method, group, source_tensor, sqnr_db, [source_slice], [source_encoding], [tokens,
fallback, ...], [input_scale {amax, tokens, source, reason}]} (`module_entry`; input_scale: NVFP4 W4A4, calib/emit.py),
a passed-through one {scheme, method: passthrough, reason}.
"""

from __future__ import annotations

import hashlib

from ..arch.layout import EXPERT
from .config import canonical_json

MANIFEST_NAME = "quantkit_manifest.json"
JOURNAL_DIR = ".quantkit-journal"  # only while converting: per-shard records, the calibration spool
# ~530 bytes per tensor: a Kimi K2 manifest (~200k tensors) is ~110 MB, beyond the limit on config files
MAX_MANIFEST_BYTES = 1 << 30
FORMAT_VERSION = 1
PAIR_KEY = "pair"  # one half of a prefill/decode pair (convert/pair.py): its record of the other
_EXPERT_MODULE = EXPERT  # groups: prefix, expert, proj


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as the manifest spells dtypes."""
    return str(dtype).removeprefix("torch.")


def tensor_entry(shape, dtype, **meta) -> dict:
    return {"shape": list(shape), "dtype": dtype_name(dtype), **meta}


# The types of a tensor entry's metadata that convert's finishing step and the reports read (null allowed):
# what a resume holds the journal's entries and the calibration spool's module metadata to.
ENTRY_FIELDS = {"scheme": str, "method": str, "group": str, "source_tensor": str, "tokens": int, "fallback": str,
                "damping": (int, float), "heldout": dict, "input_scale": dict, "sqnr_db": (int, float),
                "modified_by": str}


def entry_fields_ok(e: dict) -> bool:
    """Whether the fields of `e` that ENTRY_FIELDS names have their types (a bool is no number)."""
    return not any(k in e and e[k] is not None and (not isinstance(e[k], t) or type(e[k]) is bool)
                   for k, t in ENTRY_FIELDS.items())


def module_entry(scheme_label: str, method: str, group: str, source_tensor: str, sqnr: float, *,
                 expert: int | None = None, rows: tuple[int, int] | None = None, encoding: str | None = None) -> dict:
    """The metadata every tensor of one quantized module carries."""
    meta = {"scheme": scheme_label, "method": method, "group": group, "source_tensor": source_tensor,
            "sqnr_db": round(sqnr, 4)}
    if expert is not None:
        meta["source_slice"] = {"expert": expert, "rows": list(rows)}
    if encoding is not None:
        meta["source_encoding"] = encoding  # dequantized from FP8 on read
    return meta


def expert_report(tensors: dict[str, dict]) -> dict:
    """Calibration tokens seen per expert (by layer, in expert order) and every fallback with its reason."""
    tokens: dict[str, dict[int, int]] = {}
    fallbacks: dict[str, str] = {}
    input_fallbacks: dict[str, dict] = {}  # NVFP4 W4A4: modules whose input scale is not their own calibration's
    for name, e in tensors.items():
        scale = e.get("input_scale") if name.endswith(".weight_packed") else None
        if isinstance(scale, dict) and scale.get("source") != "calibrated":
            input_fallbacks[name[: -len(".weight_packed")]] = {k: scale.get(k) for k in ("source", "tokens", "reason")}
        # routed tokens: the calibrated method's count, else (NVFP4 W4A4 RTN modules) the input scale's
        count = e.get("tokens", scale.get("tokens") if isinstance(scale, dict) else None)
        if not name.endswith(".weight_packed") or count is None:
            continue
        module = name[: -len(".weight_packed")]
        if e.get("fallback"):
            fallbacks[module] = e["fallback"]
        m = _EXPERT_MODULE.match(module)
        if m:
            tokens.setdefault(m[1], {})[int(m[2])] = count
    out = {"expert_tokens": {p: [c[i] for i in sorted(c)] for p, c in sorted(tokens.items())},
           "fallbacks": dict(sorted(fallbacks.items()))}
    if input_fallbacks:
        out["input_scale_fallbacks"] = dict(sorted(input_fallbacks.items()))
    return out


def manifest_digest(manifest: dict) -> str:
    """sha256 of a manifest without its pair section (what the partner records)."""
    return hashlib.sha256(canonical_json({k: v for k, v in manifest.items() if k != PAIR_KEY}).encode()).hexdigest()
