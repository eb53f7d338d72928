"""`quantkit convert SRC OUT --recipe R --pair fp8-prefill`: a prefill/decode checkpoint pair from one source.

Disaggregated serving runs prefill and decode on separate GPU pools and ships the KV cache from one to the
other: the prefill pool serves FP8 weights (compute bound), the decode pool INT4 weights (bandwidth bound).
A cache written under one FP8 scale and read under another is silent corruption, so both checkpoints must
carry the same KV scales. Here they are computed once (calibrated on the source, or read from --kv-scales)
and the same tensors are written into both; each manifest then records the other:

    "pair": {"role": "decode" | "prefill", "partner": <the partner directory, relative to this one>,
             "partner_manifest_sha256": sha256 of the partner's manifest without its "pair" section
                                        (canonical JSON, pack/manifest.py manifest_digest),
             "kv_shard_sha256": sha256 of model-kv-scales.safetensors (the same bytes in both),
             "kv_cache_scheme": the config's kv_cache_scheme (the same in both)}

(the partner's hash leaves its own "pair" section out: two manifests cannot each hash the other whole).
`quantkit verify DECODE --pair PREFILL` checks all of it (verify/pair.py).

Not here: one streamed pass writing both outputs; the source is read twice (once per checkpoint), the KV
calibration once. Under torchrun, --pair is refused (run it on one process).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, PairMismatch, RecipeError
from ..match.recipe import Recipe, load_recipe
from ..pack import kv as kvrules
from ..pack.manifest import MANIFEST_NAME, PAIR_KEY, manifest_digest
from ..read.checkpoint import Checkpoint
from ..write.writer import write_json_atomic

__all__ = ["convert_pair", "PairResult", "PAIR_RECIPES", "prefill_dir"]

PAIR_RECIPES = ("fp8-prefill",)  # what --pair accepts by name (any recipe path works too)


def prefill_dir(out: str | os.PathLike) -> Path:
    """The prefill checkpoint's default directory: OUT-prefill beside OUT."""
    o = Path(out)
    return o.with_name(o.name + "-prefill")


@dataclass
class PairResult:
    decode: dict  # convert's result (ConvertResult.to_json()) for OUT
    prefill: dict  # and for the prefill checkpoint
    kv_shard_sha256: str
    kv_origin: dict

    def to_json(self) -> dict:
        """convert --json's keys for OUT (the decode checkpoint) first, then the pair's."""
        return {**self.decode, "pair": {"prefill": self.prefill, "kv_shard_sha256": self.kv_shard_sha256,
                                        "kv_origin": self.kv_origin}}


def convert_pair(src_dir: str | os.PathLike, out_dir: str | os.PathLike, opts, pair_recipe: str | Recipe,
                 prefill_out: str | os.PathLike | None = None, progress: Callable[[int, int], None] | None = None,
                 log: Callable[[str], None] | None = None) -> PairResult:
    """Write the decode checkpoint `out_dir` (opts.recipe) and the prefill checkpoint `prefill_out` (default
    OUT-prefill; `pair_recipe`, e.g. fp8-prefill) from `src_dir`, with one set of KV scales in both."""
    from . import convert
    from .calibrated import kv_scales
    from ..arch import validate as validate_config

    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ConfigError("convert --pair runs on one process, not under torchrun",
                          hint="run the pair without torchrun, or convert the two recipes separately with the same "
                               "--kv-scales file")
    out = Path(out_dir)
    pre = Path(prefill_out) if prefill_out is not None else prefill_dir(out)
    if pre.resolve() == out.resolve():
        raise ConfigError("the prefill checkpoint would overwrite the decode checkpoint",
                          hint="pass a different --pair-out")
    decode_recipe = opts.recipe if isinstance(opts.recipe, Recipe) else load_recipe(opts.recipe)
    prefill_recipe = pair_recipe if isinstance(pair_recipe, Recipe) else load_recipe(pair_recipe)
    if not any(g.scheme.type == "float" and g.scheme.num_bits == 8 for g in prefill_recipe.groups):
        raise RecipeError(f"the pair's prefill recipe {prefill_recipe.name[:60]!r} has no FP8 weight group",
                          hint="use --pair fp8-prefill (FP8 weights for the prefill pool)")
    src = Checkpoint.open(src_dir)
    validate_config(src.config, {n: src.info(n).shape for n in src.location})  # hostile configs stop here
    # one set of KV scales: from --kv-scales, else calibrated under the decode recipe's kv_cache section, else
    # the prefill recipe's (fp8-prefill: strategy tensor)
    kv_recipe = decode_recipe if decode_recipe.kv_cache is not None else prefill_recipe
    if kv_recipe.kv_cache is None and opts.kv_scales is None:
        kv_recipe = replace(kv_recipe, kv_cache=load_recipe("fp8-kv").kv_cache)
    if log:
        log("pair: KV-cache scales computed once, written to both checkpoints")
    kv = kv_scales(src, kv_recipe, opts.kv_scales, opts.dataset, opts.num_samples, opts.seq_len, device=opts.device,
                   dtype=opts.compute_dtype)
    total = 2 * src.total_bytes

    def half(offset):
        return (lambda done, _t: progress(offset + done, total)) if progress else None

    d = convert(src_dir, out, replace(opts, recipe=decode_recipe, kv=kv), progress=half(0), log=log)
    p = convert(src_dir, pre, replace(opts, recipe=prefill_recipe, kv=kv), progress=half(src.total_bytes), log=log)
    kv_sha = link(out, pre)
    return PairResult(d.to_json(), p.to_json(), kv_sha, kv.origin)


def _read_manifest(root: Path) -> dict:
    try:
        m = json.loads((root / MANIFEST_NAME).read_text())
    except (OSError, ValueError) as e:
        raise PairMismatch(f"{str(root)[:200]!r} has no readable {MANIFEST_NAME} ({type(e).__name__})") from None
    if not isinstance(m, dict) or m.get("status") != "complete":
        raise PairMismatch(f"{str(root)[:200]!r} is not a complete quantkit checkpoint")
    return m


def _kv_shard(root: Path, manifest: dict) -> dict | None:
    return next((s for s in manifest.get("shards") or [] if isinstance(s, dict)
                 and s.get("name") == kvrules.KV_SHARD_NAME), None)


def link(decode: Path, prefill: Path) -> str:
    """Record each checkpoint in the other's manifest (the module docstring's pair section); returns the
    KV shard's sha256. Both must hold the same KV shard bytes."""
    md, mp = _read_manifest(decode), _read_manifest(prefill)
    kd, kp = _kv_shard(decode, md), _kv_shard(prefill, mp)
    if kd is None or kp is None or kd.get("sha256") != kp.get("sha256"):
        raise PairMismatch("the two checkpoints' KV-scale shards differ: the pair cannot share a KV cache")
    scheme = (md.get("quantization_config") or {}).get("kv_cache_scheme")
    dd, dp = manifest_digest(md), manifest_digest(mp)
    for root, m, role, partner, digest in ((decode, md, "decode", prefill, dp), (prefill, mp, "prefill", decode, dd)):
        m[PAIR_KEY] = {"role": role, "partner": os.path.relpath(partner.resolve(), root.resolve()),
                       "partner_manifest_sha256": digest, "kv_shard_sha256": kd["sha256"], "kv_cache_scheme": scheme}
        write_json_atomic(root / MANIFEST_NAME, m)
    return kd["sha256"]
