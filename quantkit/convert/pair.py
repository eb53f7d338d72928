"""`quantkit convert SRC OUT --recipe R --pair fp8-prefill`: a prefill/decode checkpoint pair from one source.

Disaggregated serving runs prefill and decode on separate GPU pools and ships the KV cache from one to the
other: the prefill pool serves FP8 weights (compute bound), the decode pool INT4 weights (bandwidth bound).
A cache written under one FP8 scale and read under another is silent corruption, so both checkpoints must
carry the same KV scales. Here they are computed once (calibrated on the source, or read from --kv-scales)
and the same tensors are written into both; each manifest then records the other (pack/manifest.py):

    "pair": {"role": "decode" | "prefill",
             "files": {name: {size, sha256}} of every file the half holds besides its shards and manifest,
                      hashed as convert wrote them (config.json, the index, the copied files),
             "partner": <the partner directory, relative to this one>,
             "kv_shard_sha256": sha256 of model-kv-scales.safetensors (the same bytes in both),
             "kv_cache_scheme": the config's kv_cache_scheme (the same in both),
             "partner_manifest_sha256": pack.manifest.manifest_digest of the partner's complete manifest
                                        (all of it but the partner's own partner_manifest_sha256)}

With the shards' sha256 the manifest already holds, each half's manifest thus binds every byte of that half,
and each records the digest of the other's: the halves are bound by content. `quantkit verify DECODE --pair
PREFILL` checks all of it (verify/pair.py).

Order of work, and what a kill at any point leaves:
1. Plan, nothing written: both recipes loaded and each held to the source as convert holds one (`_plan_job`:
   config, source formats, targets, group sizes, W4AFP8 shapes), the prefill recipe's FP8 group, the two
   directories (not the same, neither inside the other, neither the source's for --overwrite) and what each
   holds (`_state`): nothing, an unfinished conversion of this half (its identity, which names the pair), a
   half written whole, or a complete pair. A half written whole by an earlier run is checked against its
   manifest (every shard and file, verify/integrity.py) and not converted again; first, the hidden temporaries
   a killed run left at the top of a half that is not complete are removed (`_sweep`).
2. The KV scales, once (skipped when both halves are already written; a written half's KV shard must hold the
   scales computed now).
3. The decode half into OUT, then the prefill half, each by `convert` (resumable shard by shard, its journal):
   the last write of each is its full manifest with "status": "pair_pending" (pack.manifest.PAIR_PENDING) and
   `pair: {role, files}`. A pending half is not complete: `verify` fails it, and `convert` without --pair will
   not take it for its own (the identity differs).
4. `link`: both manifests are rewritten complete with the whole pair section, the prefill half first and OUT
   last, so that OUT says complete only when both halves do.

So the same command run again after a kill resumes where it stopped and writes the bytes an uninterrupted run
writes. A kill before step 4 leaves neither half complete; the one point where exactly one is, between the
two renames of step 4, leaves the prefill half complete and OUT pending (its partner digest already names
OUT's complete manifest: the rerun only writes OUT's). A complete pair is refused like a complete output
(OutputExists); --overwrite empties both directories first.

Not here: one streamed pass writing both outputs; the source is read twice (once per checkpoint), the KV
calibration once. Under torchrun, --pair is refused (run it on one process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from .. import options
from ..dist import launched
from ..errors import ConfigError, OutputExists, PairMismatch, QuantkitError, ResumeMismatch
from ..match.recipe import Recipe, check_prefill_recipe, load_recipe
from ..pack import kv as kvrules
from ..pack.manifest import (JOURNAL_DIR, MANIFEST_NAME, MAX_MANIFEST_BYTES, PAIR_KEY, PAIR_PENDING, manifest_digest,
                             pair_problem)
from ..read.checkpoint import read_json_file
from ..read.safetensors import SafetensorsFile
from ..write.output import clear_dir, output_lock
from ..write.writer import write_json_atomic

__all__ = ["convert_pair", "PairResult", "PAIR_RECIPES", "prefill_dir", "link"]

PAIR_RECIPES = ("fp8-prefill",)  # what --pair accepts by name (any recipe path works too)
_AGAIN = "pass --overwrite to convert both halves again, or choose other directories"


def prefill_dir(out: str | os.PathLike) -> Path:
    """The prefill checkpoint's default directory: OUT-prefill beside OUT."""
    o = Path(out)
    return o.with_name(o.name + "-prefill")


def _shown(p: Path) -> str:
    return repr(str(p)[:200])


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


@dataclass
class _Half:
    role: str  # "decode" (OUT) or "prefill"
    root: Path
    opts: object  # this half's ConvertOptions (recipe, pair), the KV scales still to be set
    identity: dict  # what its manifest says while it is being written (convert._identity)
    state: str = "new"  # "new": convert writes it (from nothing, or resuming); "pending" / "complete": written
    manifest: dict | None = None  # its manifest, when written


def convert_pair(src_dir: str | os.PathLike, out_dir: str | os.PathLike, opts, pair_recipe: str | Recipe,
                 prefill_out: str | os.PathLike | None = None, progress: Callable[[int, int], None] | None = None,
                 log: Callable[[str], None] | None = None) -> PairResult:
    """Write the decode checkpoint `out_dir` (opts.recipe) and the prefill checkpoint `prefill_out` (default
    OUT-prefill; `pair_recipe`, e.g. fp8-prefill) from `src_dir`, with one set of KV scales in both (the module
    docstring: the order of work, and how a rerun resumes)."""
    from . import convert
    from .calibrated import kv_scales

    if launched()[1] > 1:
        raise ConfigError("convert --pair runs on one process, not under torchrun",
                          hint="run the pair without torchrun, or convert the two recipes separately with the same "
                               "--kv-scales file")
    out = Path(out_dir)
    pre = Path(prefill_out) if prefill_out is not None else prefill_dir(out)
    src, decode, prefill, kv_recipe = _plan(src_dir, out, pre, opts, pair_recipe)
    halves = (decode, prefill)
    for h in halves:
        if h.state != "complete" and not opts.overwrite:
            _sweep(h.root)
        if h.state != "new":
            _check_written(h)
            if log:
                log(f"pair: the {h.role} half {str(h.root)[:200]} was written whole by an earlier run and matches its "
                    "manifest: not converted again")
    kv = None
    if any(h.state == "new" for h in halves):
        if log:
            log("pair: KV-cache scales computed once, written to both checkpoints")
        kv = kv_scales(src, kv_recipe, opts)
        for h in halves:
            if h.state != "new":
                _same_kv(h, kv)
    if opts.overwrite:  # neither half may say complete while the other is rewritten: both emptied first
        for h in halves:
            if h.root.is_dir():
                with output_lock(h.root):
                    clear_dir(h.root)
    total = 2 * src.total_bytes
    results = {}
    for i, h in enumerate(halves):
        offset = i * src.total_bytes
        if h.state == "new":
            each = (lambda done, _t, o=offset: progress(o + done, total)) if progress else None
            results[h.role] = convert(src_dir, h.root, replace(h.opts, kv=kv), progress=each, log=log).to_json()
        else:
            results[h.role] = _written_result(h)
            if progress:
                progress(offset + src.total_bytes, total)
    kv_sha = link(out, pre)
    origin = kv.origin if kv is not None else _kv_origin(decode.manifest)
    return PairResult(results["decode"], results["prefill"], kv_sha, origin)


def _plan(src_dir, out: Path, pre: Path, opts, pair_recipe):
    """Everything checked before anything is written: the recipes against the source, the directories and
    what they hold. -> (source checkpoint, decode half, prefill half, recipe whose kv_cache section calibrates)."""
    from . import _identity, _plan_job
    from .calibrated import calibration_data

    ro, rp = _resolved(out), _resolved(pre)
    if ro == rp:
        raise ConfigError("the prefill checkpoint would overwrite the decode checkpoint",
                          hint="pass a different --pair-out")
    if ro.is_relative_to(rp) or rp.is_relative_to(ro):
        inner, outer = (out, pre) if ro.is_relative_to(rp) else (pre, out)
        raise ConfigError(f"the pair's checkpoints nest: {_shown(inner)} is inside {_shown(outer)}",
                          hint="write the two halves to separate directories (default: OUT and OUT-prefill beside "
                               "it)")
    options.parse_device(opts.device)  # a misspelled device or dtype fails here, whatever the recipes
    options.parse_compute_dtype(opts.compute_dtype)
    decode_recipe = opts.recipe if isinstance(opts.recipe, Recipe) else load_recipe(opts.recipe)
    prefill_recipe = check_prefill_recipe(pair_recipe if isinstance(pair_recipe, Recipe) else load_recipe(pair_recipe))
    # the halves are planned as convert plans them with KV scales to ship (the ones computed below)
    planned_kv = kvrules.KVScales({}, "tensor", {})
    halves = []
    for role, root, recipe, partner, other in (("decode", out, decode_recipe, pre, prefill_recipe),
                                               ("prefill", pre, prefill_recipe, out, decode_recipe)):
        half_opts = replace(opts, recipe=recipe, kv=None,
                            pair={"role": role, "partner": os.path.relpath(_resolved(partner), _resolved(root)),
                                  "partner_recipe_sha256": other.sha256})
        job = _plan_job(src_dir, replace(half_opts, kv=planned_kv))  # hostile configs, recipes that cannot apply
        if opts.overwrite:
            sr = job.src.root.resolve()
            if root.exists() and (sr == _resolved(root) or sr.is_relative_to(_resolved(root))):
                raise OutputExists(f"--overwrite would delete {_shown(root)}, which holds the source checkpoint",
                                   hint="choose an output directory outside the source checkpoint")
        calib_device = data = None
        if job.calibrated:  # as convert() decides it: with KV scales given, only GPTQ/AWQ/W4A4 groups calibrate
            from ..calib.device import resolve_device

            calib_device = resolve_device(opts.device)
            data = calibration_data(job.src, job.recipe, opts.dataset, opts.num_samples, opts.seq_len)
        halves.append(_Half(role, root, half_opts, _identity(job, half_opts, data, calib_device)))
        src = job.src
    decode, prefill = halves
    for h in halves:
        _state(h, overwrite=opts.overwrite, resume=opts.resume)
    if decode.state == "complete":
        if prefill.state == "complete":
            raise OutputExists(f"{_shown(out)} and {_shown(pre)} already hold a complete prefill/decode pair", hint=_AGAIN)
        raise OutputExists(f"{_shown(out)} holds a complete decode half, but its prefill half {_shown(pre)} is not "
                           "complete", hint=_AGAIN)
    if prefill.state == "complete" and decode.state != "pending":
        raise OutputExists(f"{_shown(pre)} holds a complete prefill half, but {_shown(out)} holds no finished decode "
                           "half of it", hint=_AGAIN)
    kv_recipe = decode_recipe if decode_recipe.kv_cache is not None else prefill_recipe
    if kv_recipe.kv_cache is None and opts.kv_scales is None:
        kv_recipe = replace(kv_recipe, kv_cache=load_recipe("fp8-kv").kv_cache)
    return src, decode, prefill, kv_recipe


def _resolved(p: Path) -> Path:
    try:
        return p.resolve()
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"output directory {_shown(p)} cannot be resolved ({type(e).__name__})") from None


def _only_own_debris(entries: list[Path]) -> bool:
    """What a conversion killed before its first manifest leaves (as write/output.py resumes): an empty
    journal and hidden temporaries."""
    for p in entries:
        if p.name == JOURNAL_DIR and p.is_dir() and not p.is_symlink() and not any(p.glob("*.json")):
            continue
        if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file():
            continue
        return False
    return True


def _state(h: _Half, overwrite: bool, resume: bool) -> None:
    """What `h.root` holds, as convert --pair may continue it (sets h.state, h.manifest), or the refusal: a
    file, a foreign directory, a complete conversion that is not this half, another conversion's journal."""
    root = h.root
    if root.is_symlink() or root.exists():
        if not root.is_dir():
            raise OutputExists(f"output {_shown(root)} exists and is not a directory")
    else:
        return
    if overwrite:
        return  # emptied before anything is written
    try:
        entries = list(root.iterdir())
    except OSError as e:
        raise OutputExists(f"output directory {_shown(root)} cannot be listed ({e.strerror or type(e).__name__})") \
            from None
    if not entries:
        return
    manifest = root / MANIFEST_NAME
    if not resume:
        raise OutputExists(f"output directory {_shown(root)} is not empty")
    if not (manifest.exists() or manifest.is_symlink()):
        if _only_own_debris(entries):
            return
        raise OutputExists(f"output directory {_shown(root)} is not empty")
    m = read_json_file(manifest, f"{MANIFEST_NAME} of the {h.role} half {_shown(root)}", ResumeMismatch,
                       limit=MAX_MANIFEST_BYTES)
    status = m.get("status")
    ours = m.get("identity") == h.identity
    if status == "complete":
        if not ours or PAIR_KEY not in m:
            raise OutputExists(f"{_shown(root)} already holds a complete conversion", hint=_AGAIN)
    elif not ours:
        raise ResumeMismatch(f"{_shown(root)} holds an unfinished conversion of a different source, recipe, "
                             "calibration, pair or quantkit version; refusing to mix them")
    if status == "in_progress":
        return  # convert() continues it from its journal
    if status not in ("complete", PAIR_PENDING):
        raise ResumeMismatch(f"the {MANIFEST_NAME} of {_shown(root)} has status {str(status)[:40]!r}")
    problem = pair_problem(m.get(PAIR_KEY), complete=status == "complete")
    if problem is None and m[PAIR_KEY]["role"] != h.role:
        problem = f"it is the {m[PAIR_KEY]['role']} half, not the {h.role} half"
    if problem:
        raise ResumeMismatch(f"{_shown(root)} is not the {h.role} half of this pair: {problem}", hint=_AGAIN)
    h.state, h.manifest = ("complete" if status == "complete" else "pending"), m


def _sweep(root: Path) -> None:
    """Remove the hidden temporaries a killed earlier run left at the top of a half it did not complete (the
    model card's have random names, so resuming would not overwrite them; verify refuses any), under the
    directory's lock: a conversion writing there now is refused (OutputBusy), never robbed of its files."""
    if not root.is_dir():
        return
    with output_lock(root):
        for p in root.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file() and not p.is_symlink():
                p.unlink()


def _check_written(h: _Half) -> None:
    """A half an earlier run wrote whole: every shard and file as its manifest recorded them (the check verify
    runs), before it is trusted."""
    from ..verify.integrity import check_checkpoint

    _, mm, _ = check_checkpoint(h.root, lambda _s: None, h.manifest, pending=True)
    if mm:
        first = mm.items[0]
        raise ResumeMismatch(f"the {h.role} half {_shown(h.root)} no longer matches its manifest: "
                             f"{str(first['file'])[:120]}: {str(first['problem'])[:300]}", hint=_AGAIN)


def _same_kv(h: _Half, kv: kvrules.KVScales) -> None:
    """A half written by an earlier run holds the KV scales this run computed, bit for bit."""
    want = kv.ordered()
    try:
        with SafetensorsFile(h.root / kvrules.KV_SHARD_NAME) as f:
            names = list(f.header.tensors)
            same = names == [n for n, _ in want] and all(
                torch.equal(f.get(n).reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))
                and f.get(n).dtype == t.dtype and tuple(f.get(n).shape) == tuple(t.shape) for n, t in want)
    except QuantkitError:
        same = False
    if not same:
        raise ResumeMismatch(f"the {h.role} half {_shown(h.root)} was written with other KV-cache scales than this "
                             "run's (another --kv-scales file, or calibration options)", hint=_AGAIN)


def _written_result(h: _Half) -> dict:
    """convert's result for a half an earlier run wrote (from its checked manifest)."""
    from . import ConvertResult, peak_rss_bytes

    m = h.manifest
    s = m.get("summary") if isinstance(m.get("summary"), dict) else {}

    def count(k):
        return s.get(k) if type(s.get(k)) is int else 0

    src = m.get("source") if isinstance(m.get("source"), dict) else {}
    notes = m.get("notes") if isinstance(m.get("notes"), list) else []
    return ConvertResult(str(h.root), 0.0, count("bytes_read"), count("bytes_written"), count("tensors_total"),
                         count("modules_quantized"), peak_rss_bytes(),
                         len(src.get("shards")) if isinstance(src.get("shards"), list) else 0,
                         count("modules_passed_through"), [n for n in notes if isinstance(n, str)]).to_json()


def _kv_origin(m: dict | None) -> dict:
    kv = (m or {}).get("kv_cache")
    origin = kv.get("origin") if isinstance(kv, dict) else None
    return origin if isinstance(origin, dict) else {}


def _read_half(root: Path, role: str) -> dict:
    m = read_json_file(root / MANIFEST_NAME, f"{MANIFEST_NAME} of the {role} half {_shown(root)}", PairMismatch,
                       limit=MAX_MANIFEST_BYTES)
    status = m.get("status")
    if status not in (PAIR_PENDING, "complete"):
        raise PairMismatch(f"the {role} half {_shown(root)} is not written whole (status {str(status)[:40]!r})")
    problem = pair_problem(m.get(PAIR_KEY), complete=status == "complete")
    if problem is None and m[PAIR_KEY]["role"] != role:
        problem = f"it is the {m[PAIR_KEY]['role']} half"
    if problem:
        raise PairMismatch(f"the {role} half {_shown(root)} is not one half of a pair: {problem}")
    return m


def _kv_shard_sha(m: dict, role: str) -> str:
    shards = m.get("shards")
    found = [s.get("sha256") for s in (shards if isinstance(shards, list) else [])
             if isinstance(s, dict) and s.get("name") == kvrules.KV_SHARD_NAME]
    if len(found) != 1 or not isinstance(found[0], str):
        raise PairMismatch(f"the {role} half holds no FP8 KV-cache scales ({kvrules.KV_SHARD_NAME}): a pair shares "
                           "an FP8 KV cache")
    return found[0]


def _kv_scheme(m: dict):
    qc = m.get("quantization_config")
    return qc.get("kv_cache_scheme") if isinstance(qc, dict) else None


def link(decode: Path, prefill: Path) -> str:
    """Complete both halves (step 4 of the module docstring): each manifest gets the whole pair section and
    "status": "complete", the prefill half's written first and OUT's last; a half already complete must be
    exactly what this computes. Returns the KV shard's sha256; both halves must hold the same KV shard."""
    decode, prefill = Path(decode), Path(prefill)
    md, mp = _read_half(decode, "decode"), _read_half(prefill, "prefill")
    kv_sha = _kv_shard_sha(md, "decode")
    if _kv_shard_sha(mp, "prefill") != kv_sha:
        raise PairMismatch("the two checkpoints' KV-scale shards differ: the pair cannot share a KV cache")
    scheme = _kv_scheme(md)
    if _kv_scheme(mp) != scheme:
        raise PairMismatch("the two checkpoints' KV-cache layouts (kv_cache_scheme) differ")
    finals = {}
    for role, root, m, partner in (("decode", decode, md, prefill), ("prefill", prefill, mp, decode)):
        f = dict(m)  # the pending manifest, as convert wrote it, completed (key order kept: the same bytes)
        f["status"] = "complete"
        f[PAIR_KEY] = {"role": role, "files": m[PAIR_KEY]["files"],
                       "partner": os.path.relpath(partner.resolve(), root.resolve()), "kv_shard_sha256": kv_sha,
                       "kv_cache_scheme": scheme, "partner_manifest_sha256": None}
        finals[role] = f
    finals["decode"][PAIR_KEY]["partner_manifest_sha256"] = manifest_digest(finals["prefill"])
    finals["prefill"][PAIR_KEY]["partner_manifest_sha256"] = manifest_digest(finals["decode"])
    for role, root, m in (("prefill", prefill, mp), ("decode", decode, md)):  # OUT last: complete means both are
        if m.get("status") == "complete":
            if m != finals[role]:
                raise PairMismatch(f"the {role} half {_shown(root)} is complete but not as this pair completes it "
                                   "(its pair section or manifest was edited, or it belongs to another pair)")
            continue
        write_json_atomic(root / MANIFEST_NAME, finals[role])
    return kv_sha
