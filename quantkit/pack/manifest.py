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

One half of a prefill/decode pair (convert/pair.py) adds `pair` and has one more status: its last write in
`convert` says "pair_pending" (PAIR_PENDING) with `pair: {role, files}`, and both halves are flipped to
"complete" together once both are written, with the rest of the section (`pair_problem` holds its types):

    pair  {role: "decode" | "prefill",
           files: {name: {size, sha256}} of every file convert wrote besides the shards and this manifest
                  (config.json, the index, the copied tokenizer files, ...; not the AFTER_CONVERT files, which
                  later commands rewrite): with `shards`, everything the directory may hold,
           partner: the other half's directory, relative to this one,
           kv_shard_sha256, kv_cache_scheme: the KV-scale shard and layout both halves share,
           partner_manifest_sha256: manifest_digest of the other half's complete manifest}
"""

from __future__ import annotations

import hashlib
import os
import re

from ..arch.layout import EXPERT
from .config import canonical_json

MANIFEST_NAME = "quantkit_manifest.json"
JOURNAL_DIR = ".quantkit-journal"  # only while converting: per-shard records, the calibration spool
# ~530 bytes per tensor: a Kimi K2 manifest (~200k tensors) is ~110 MB, beyond the limit on config files
MAX_MANIFEST_BYTES = 1 << 30
FORMAT_VERSION = 1
PAIR_KEY = "pair"  # one half of a prefill/decode pair (module docstring)
PAIR_PENDING = "pair_pending"  # a pair's half written whole, waiting for its partner: not complete
PAIR_ROLES = ("decode", "prefill")
# files quantkit writes into a finished checkpoint after convert (verify --save: verify.json and the model card
# README.md, card.py; report: quantkit_report.html, report/model.py): never recorded in `files`, never refused
AFTER_CONVERT = frozenset({"README.md", "verify.json", "quantkit_report.html"})
MAX_PAIR_PATH = 4096  # characters of a recorded partner path
_SHA256 = re.compile(r"[0-9a-f]{64}")
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
    """sha256 of a pair half's manifest as its partner records it: canonical JSON (pack/config.py) of the whole
    manifest but its own `partner_manifest_sha256` (two manifests cannot each hash the other whole)."""
    m = dict(manifest)
    if isinstance(m.get(PAIR_KEY), dict):
        m[PAIR_KEY] = {k: v for k, v in m[PAIR_KEY].items() if k != "partner_manifest_sha256"}
    return hashlib.sha256(canonical_json(m).encode()).hexdigest()


def sha256_text(v) -> bool:
    """Whether `v` is a sha256 as manifests write it: 64 lowercase hex digits."""
    return isinstance(v, str) and _SHA256.fullmatch(v) is not None


def recorded_name(name) -> bool:
    """Whether `name` may be a key of a pair half's `files`: one plain file name inside the checkpoint directory
    (no separator, no NUL, not hidden, so neither "." nor "..", at most 255 bytes)."""
    return (isinstance(name, str) and 0 < len(name.encode("utf-8", "surrogatepass")) <= 255 and "/" not in name
            and "\\" not in name and "\0" not in name and not name.startswith("."))


def pair_problem(section, *, complete: bool) -> str | None:
    """What is wrong with the `pair` section of a manifest (hostile: any JSON value), or None. `complete`: the
    section of a complete half (partner, KV shard, layout and the partner's digest), else a pending one."""
    if not isinstance(section, dict):
        return f"its '{PAIR_KEY}' section is {type(section).__name__}, not an object"
    if section.get("role") not in PAIR_ROLES:
        return f"its pair role is {str(section.get('role'))[:40]!r}, not 'decode' or 'prefill'"
    files = section.get("files")
    if not isinstance(files, dict) or not files:
        return "its pair section records no files"
    for n, e in files.items():
        if not recorded_name(n) or n in AFTER_CONVERT or n == MANIFEST_NAME:
            return f"its pair section records {n[:80]!r}, not a plain file name of the checkpoint"
        if not isinstance(e, dict) or type(e.get("size")) is not int or e["size"] < 0 or not sha256_text(e.get("sha256")):
            return f"its pair section records no size and sha256 for {n[:80]!r}"
    if not complete:
        return None
    partner = section.get("partner")
    if not isinstance(partner, str) or not partner or len(partner) > MAX_PAIR_PATH or "\0" in partner:
        return "its pair section records no partner directory"
    if os.path.isabs(partner):
        return f"its pair section records the partner at the absolute path {partner[:80]!r} (a relative one is written)"
    for k in ("kv_shard_sha256", "partner_manifest_sha256"):
        if not sha256_text(section.get(k)):
            return f"its pair section has no {k}"
    if section.get("kv_cache_scheme") is not None and not isinstance(section.get("kv_cache_scheme"), dict):
        return "its pair section's kv_cache_scheme is not an object"
    return None
