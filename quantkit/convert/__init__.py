"""`quantkit convert`: stream a checkpoint shard by shard into a compressed-tensors checkpoint.

Pipeline (one way; how the code is organised: docs/code.md):

    read/     open + validate the source; what format each module is stored in (scan)
    match/    plan every shard: the recipe matched to every tensor, units of work, output shards sized;
              nothing is written before the whole plan is valid
    calib/    GPTQ/AWQ groups: the calibrated pass, layer by layer, into a spool (convert/calibrated.py)
    convert/  run each shard's units (convert/run.py): quantize (quant/), pack (pack/), stream the output
              shard to a temporary file and rename it (write/)
    pack/     index, config.json quantization_config, copied files, and the manifest last

Each source shard maps to its own output shard(s), so shards are independent units of work: they can
run in parallel (`workers`), resume after a crash (a journal records each finished shard), and the
output is byte-identical whatever the order they finish in.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from .. import __version__, options
from ..arch import text_config
from ..arch import check_expert_shapes, validate as validate_config
from ..card import write_model_card
from .. import timeline
from ..dist import world
from ..errors import OutputExists, RecipeError
from ..match.recipe import Recipe, load_recipe
from ..match.shards import (DEFAULT_BATCH_BYTES, DEFAULT_MAX_SHARD_BYTES, ShardContext, ShardPlan, output_shard_names,
                            plan_notes, plan_shard)
from ..match.units import CalibratedUnit, FP4Unit
from ..pack import kv as kvrules
from ..pack.config import quantization_config
from ..pack.manifest import (AFTER_CONVERT, FORMAT_VERSION, JOURNAL_DIR, MANIFEST_NAME, PAIR_KEY, PAIR_PENDING,
                             expert_report)
from ..quant.int4 import native_threads
from ..read.checkpoint import INDEX_NAME, Checkpoint
from ..read.sources import SourceFormat, detect_format, scan, validate as validate_sources
from ..read.rotate import Rotation
from ..read.tensors import TensorReader
from ..write.output import output_lock, prepare_output
from ..write.writer import copy_file_atomic, sha256_file, wait_durable, write_json_atomic
from .journal import trusted as trusted_records
from .calibrated import calibrated_pass, calibration_data, kv_scales, write_kv_scales
from .run import BatchBuffer, ShardResult, Spool, run_shard, worker
from ..pack.names import Tensor

__all__ = ["convert", "ConvertOptions", "ConvertResult", "MANIFEST_NAME", "JOURNAL_DIR", "DEFAULT_MAX_SHARD_BYTES",
           "DEFAULT_BATCH_BYTES"]


# What vLLM does with them (quantkit/engine/vllm.py, rule K2; docs/engine.md), said where the user looks.
MLA_KV_NOTE = ("FP8 KV-cache scales of an MLA model (DeepSeek-V3 / Kimi K2 / GLM-5) are written, but vLLM 0.33.0 "
               "does not load them: it serves the FP8 latent cache with scale 1.0. Install quantkit in vLLM's "
               "environment: its vLLM plugin (quantkit.engine.vllm_plugin) makes vLLM load them")


@dataclass(frozen=True)
class ConvertOptions:
    """Everything `convert` takes besides the two directories; the CLI's defaults are these."""

    recipe: str | Recipe = options.RECIPE
    workers: int = options.WORKERS
    resume: bool = True
    overwrite: bool = False
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    batch_bytes: int = DEFAULT_BATCH_BYTES
    # FP8 KV-cache scales to ship: a safetensors file of float32 `model.layers.L.self_attn.{k,v}_scale`
    # (as `quantkit calibrate` writes). None: calibrate if the recipe has a kv_cache section.
    kv_scales: str | None = None
    # KV scales already read or calibrated (pack.kv.KVScales): shipped as they are. convert/pair.py computes
    # them once and hands the same object to both checkpoints of a prefill/decode pair.
    kv: kvrules.KVScales | None = None
    # Calibration data for GPTQ/AWQ groups (and in-convert KV calibration); None: the recipe's
    # `calibration` section, then quantkit's defaults (match.recipe.CalibrationSpec).
    dataset: str | None = None
    num_samples: int | None = None
    seq_len: int | None = None
    # the source's hub id, when it came from the hub: the model card's base_model
    source_id: str | None = None
    model_card: bool = True  # write README.md (quantkit/card.py; a README of the source is extended)
    # where calibration (GPTQ/AWQ, KV scales) computes: cpu, cuda, cuda:N or auto (calib/device.py)
    device: str = options.DEVICE
    # what calibration's layers compute in: auto (float32 on the CPU, bfloat16 on a GPU), float32 or bfloat16
    compute_dtype: str = options.COMPUTE_DTYPE
    # the tensor-parallel size the output will be served at: W4AFP8 recipes are refused up front when vLLM's
    # W4AFP8 MoE kernel cannot take the expert widths at it (engine/w4afp8.py); None: tp 1, with a note
    tp: int | None = None
    # a recipe with weight groups whose targets match no module of the source is an error unless True
    # (docs/recipes.md: a typo in a pattern would otherwise write an unquantized copy marked complete)
    allow_unmatched: bool = False
    # one half of a prefill/decode pair (convert/pair.py): {"role", "partner", "partner_recipe_sha256"}. Part of
    # the identity (a resume continues only the same half of the same pair); the last manifest write then says
    # "pair_pending" and records every file written (pack/manifest.py), and convert/pair.py completes both halves
    pair: dict | None = None


@dataclass
class ConvertResult:
    output: str
    seconds: float
    bytes_read: int
    bytes_written: int
    tensors_total: int
    tensors_quantized: int
    peak_rss_bytes: int
    shards_resumed: int = 0
    modules_passed_through: int = 0
    notes: list = field(default_factory=list)  # what was not quantized as asked, and why (also in the manifest)
    # the calibration's device and its memory plan (calib/device.py: estimated peak bytes per layer, where
    # the activations lived, the measured peak on a GPU); None when nothing was calibrated in this run
    device: str | None = None
    device_memory: dict | None = None
    # where the time went, per rank and phase (quantkit/timeline.py): {"ranks": [per-rank timelines]}
    timeline: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


def peak_rss_bytes() -> int:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return max(own, kids)


def _source_fingerprint(src: Checkpoint) -> list[dict]:
    return [{"name": s.name, "size": s.size, "mtime_ns": s.path.stat().st_mtime_ns} for s in src.shards]


@dataclass
class _Job:
    """What a conversion will do, decided from the source and the recipe before anything is written (the same
    on every rank)."""

    src: Checkpoint
    recipe: Recipe
    fmt: SourceFormat
    stored: dict
    plans: list[ShardPlan]
    notes: list[str]
    want_kv: bool  # KV scales go into the output (given, computed by the caller, or calibrated here)
    source_kv: frozenset[str]  # the source's own KV-scale tensors
    calibrated: bool  # a calibrated pass runs (GPTQ/AWQ units, or NVFP4 W4A4 input scales)


def _plan_job(src_dir, opts: ConvertOptions) -> _Job:
    """Open and validate the source, hold the recipe to it, plan every shard (nothing written): the hostile
    config, a recipe matching nothing, a W4AFP8 shape vLLM refuses and a bad group size all fail here."""
    recipe = opts.recipe if isinstance(opts.recipe, Recipe) else load_recipe(opts.recipe)
    src = Checkpoint.open(src_dir)
    spec = validate_config(src.config, {n: src.info(n).shape for n in src.location})  # hostile configs stop here
    fmt = detect_format(src.config)
    stored = scan(src, fmt)
    logical = validate_sources(src, stored)  # every quantized module against its scheme (scales read, packed not)
    if recipe.rotate is not None:  # every tensor it turns known, the norm gains read: a refusal before any write
        src = replace(src, rotation=Rotation.plan(src, recipe.rotate, stored))
    if spec is not None:  # packed experts' logical shapes against config.json, as dense ones were above
        check_expert_shapes(spec, {m + ".weight": nk for m, nk in logical.items()})
    want_kv = opts.kv is not None or opts.kv_scales is not None or recipe.kv_cache is not None
    source_kv = frozenset(n for n in src.location if kvrules.KV_SCALE.match(n))
    companions = frozenset(t for sw in stored.values() for _, t in sw.tensors[1:])
    skip = companions | (source_kv if want_kv else frozenset())
    hidden = src.config.get("hidden_size") if isinstance(src.config.get("hidden_size"), int) else None
    if recipe.groups and not opts.allow_unmatched and not _matches_any(src, recipe, hidden):
        raise RecipeError(f"recipe {recipe.name[:60]!r} has weight groups, but their targets match no module of "
                          f"the source ({sum(1 for _ in src.location)} tensors): nothing would be quantized",
                          hint="check the targets/ignore patterns against the module names (`quantkit inspect`), "
                               "or pass --allow-unmatched to write the copy anyway")
    w4afp8_note = _w4afp8_rules(src, recipe, hidden, opts.tp)  # before any plan or write: a wrong shape costs seconds
    names = output_shard_names(src)
    ctx = ShardContext(hidden, opts.batch_bytes, opts.max_shard_bytes, stored=stored, skip=skip, location=src.location,
                       info=src.info, calibrated=recipe.needs_calibrated_pass,
                       rotated=frozenset(src.rotation.roles) if src.rotation is not None else frozenset())
    plans = [plan_shard(s, names[s.name], recipe, ctx) for s in src.shards]
    notes = plan_notes(plans, len(source_kv) if want_kv else 0, stored) + ([w4afp8_note] if w4afp8_note else [])
    if source_kv and not want_kv:  # the source's own KV scales are kept: held to the same rules
        with TensorReader.of(src) as r:
            notes += kvrules.check_source(r.get, source_kv)
    # every module a calibrated group targets may be stored INT4 already (Kimi K2.5): then nothing to calibrate
    # NVFP4 W4A4 modules need their input scales calibrated, whatever their method
    calibrated = recipe.needs_calibrated_pass and any(
        isinstance(u, CalibratedUnit) or (isinstance(u, FP4Unit) and u.scheme.w4a4) for p in plans for u in p.units)
    return _Job(src, recipe, fmt, stored, plans, notes, want_kv, source_kv, calibrated)


def _job_kv(job: _Job, opts: ConvertOptions, w, split_calib: bool, calib_report: dict):
    """The KV scales the output ships (None: none): the caller's (a prefill/decode pair), calibrated here over
    every rank, or read (or calibrated) by rank 0 and broadcast."""
    src, recipe = job.src, job.recipe
    if opts.kv is not None:  # computed by the caller (a prefill/decode pair): the same scales, as they are
        return opts.kv
    if job.want_kv and opts.kv_scales is None and split_calib:  # calibrated here: data parallel over the ranks
        with timeline.phase("kv"):
            return kv_scales(src, recipe, opts, report=calib_report if w.leader else None, world=w)
    return w.broadcast(w.step(lambda: kv_scales(src, recipe, opts, report=calib_report)
                              if job.want_kv and w.leader else None,
                              "reading the KV scales", "kv"))


def _kv_notes(src: Checkpoint, kv) -> list[str]:
    """What a user should know about the KV scales shipped: MLA caches, values near the FP8 range's ends."""
    notes = []
    if kv is not None and "kv_lora_rank" in text_config(src.config)[0]:
        from ..engine.vllm_config import kv_scale_use_notes

        notes.append(MLA_KV_NOTE)
        notes.extend(kv_scale_use_notes(src.config))
    if kv is not None:
        notes += kvrules.range_notes(kv.scales)
    return notes


def _identity(job: _Job, opts: ConvertOptions, data, calib_device=None) -> dict:
    """What makes an output this conversion's (a resume continues only an output with the same identity).
    `calib_device`: where calibration runs (None: nothing is calibrated); its compute dtype is part of it."""
    from ..calib.device import compute_dtype, dtype_name

    src = job.src
    pair = {} if opts.pair is None else {"pair": opts.pair}  # one half of a prefill/decode pair (convert/pair.py)
    return {"tool_version": __version__, "recipe_sha256": job.recipe.sha256,
            "config_sha256": hashlib.sha256((src.root / "config.json").read_bytes()).hexdigest(),
            "source": _source_fingerprint(src), "batch_bytes": opts.batch_bytes,
            "max_shard_bytes": opts.max_shard_bytes,
            "calibration": None if data is None else {k: data.describe()[k] for k in
                                                      ("source", "sha256", "num_samples", "seq_len", "seed")},
            "compute_dtype": None if calib_device is None else
            dtype_name(compute_dtype(calib_device, opts.compute_dtype)), **pair}


def _stream(job: _Job, out: Path, opts: ConvertOptions, w, spool: Spool, done: dict, progress) -> tuple[dict, dict]:
    """Convert this rank's share of the shards not done yet, journaling each; (results of every shard done so
    far on this rank, including `done`; the ones this rank converted now)."""
    src, journal = job.src, out / JOURNAL_DIR
    total = src.total_bytes
    finished_bytes = sum(src.shard(s).size for s in done)
    results: dict[str, dict] = dict(done)
    mine: dict[str, dict] = {}  # the shards this rank converts now

    def record(res: ShardResult):
        rec = asdict(res)
        # this shard is now done; no fsync: a record lost to a power cut only means the shard is redone
        write_json_atomic(journal / f"{res.source}.json", rec, indent=None, durable=False)
        results[res.source] = mine[res.source] = rec

    # with several ranks each converts its share of the shards (balanced by bytes) and journals them
    todo = w.split([p for p in job.plans if p.source not in done], lambda p: src.shard(p.source).size)
    if progress:
        progress(finished_bytes, total)
    # Streaming RTN is thousands of small cache-sized ops: OpenMP barriers cost more than a second thread
    # gains (measured by bench/convert_rtn.py), so each shard runs single-threaded; --workers runs shards
    # in parallel processes instead. The fused RTN kernel (quantkit.quant._rtn_native) has no such
    # barriers: it splits rows over the cores when shards run one at a time.
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def shards():
        with native_threads(_cpu_count() if opts.workers <= 1 else 1):
            _run_shards(todo, src, out, opts, spool, record, progress, finished_bytes, total)
        wait_durable()  # this rank's shards are on disk before rank 0 writes the index and manifest

    try:
        w.step(shards, "converting its shards", "stream")
    finally:
        torch.set_num_threads(prev_threads)
    return results, mine


def _calibrate(job: _Job, data, spool_dir: Path, log, opts: ConvertOptions, w, split_calib: bool,
               calib_report: dict) -> Spool:
    """The calibrated pass into its spool: every rank takes part (data and expert parallel,
    calib/parallel.py; rank 0 writes the spool), or rank 0 alone while the others wait (a GPU job whose
    process group is gloo)."""
    if split_calib or w.size == 1:
        return calibrated_pass(job.src, job.recipe, data, spool_dir, log, device=opts.device,
                               dtype=opts.compute_dtype, report=calib_report, world=w)
    return w.broadcast(w.step(lambda: calibrated_pass(job.src, job.recipe, data, spool_dir, log, device=opts.device,
                                                      dtype=opts.compute_dtype, report=calib_report)
                              if w.leader else None, "calibrating", "solve"))


def convert(src_dir: str | os.PathLike, out_dir: str | os.PathLike, opts: ConvertOptions = ConvertOptions(),
            progress: Callable[[int, int], None] | None = None,
            log: Callable[[str], None] | None = None) -> ConvertResult:
    """Convert `src_dir` into `out_dir` per `opts.recipe`. `progress(done_bytes, total_bytes)` is called
    as source bytes are consumed; `log(line)` receives each note (what is passed through or re-quantized
    rather than quantized as asked) as soon as it is known — the CLI prints them on stderr.

    Under torchrun every rank runs this: `w` (dist.world) makes each collective step a plain call at size 1.
    Rank 0 holds the output's lock, reads or calibrates the KV scales, writes the index and manifest; the
    calibrated pass and the shards are shared out."""
    t0 = time.perf_counter()
    job = _plan_job(src_dir, opts)
    src, recipe, notes, out = job.src, job.recipe, job.notes, Path(out_dir)
    options.parse_device(opts.device)  # a misspelled device or dtype fails here, whatever the recipe
    options.parse_compute_dtype(opts.compute_dtype)
    calib_device = None
    if job.calibrated or (job.want_kv and opts.kv_scales is None and opts.kv is None):
        from ..calib.device import resolve_device

        calib_device = resolve_device(opts.device)  # a device that is not there fails before anything is written
    w = world(opts.device)  # torchrun: this rank's place (size 1 otherwise)
    tl = timeline.start(w.rank)
    with timeline.phase("setup"):
        data = calibration_data(src, recipe, opts.dataset, opts.num_samples, opts.seq_len) if job.calibrated else None
    if job.calibrated and calib_device.type != "cpu":  # a layer that cannot fit on the GPU: refused before any work
        from .calibrated import preflight

        w.step(lambda: preflight(src, recipe, data, str(calib_device), w.size if w.backend == "nccl" else 1,
                                 dtype=opts.compute_dtype) if w.leader else None, "planning device memory")
    calib_report: dict = {}  # the calibration's device and memory plan, for the result
    # Several ranks calibrate together (calib/parallel.py): on the CPU over gloo, on GPUs over NCCL (each rank
    # on its LOCAL_RANK's GPU). A GPU job whose process group is gloo (a GPU asked for while torch.distributed
    # joined without one) calibrates on rank 0 alone while the others wait.
    split_calib = w.size > 1 and calib_device is not None and (calib_device.type == "cpu" or w.backend == "nccl")
    # KV scales: read and checked (or calibrated) once the plan is known to be valid, before any write
    kv = _job_kv(job, opts, w, split_calib, calib_report)
    notes += _kv_notes(src, kv)
    for n in notes:
        if log:
            log(n)

    identity = _identity(job, opts, data, calib_device)
    if opts.overwrite and out.exists():
        o, sr = out.resolve(), src.root.resolve()
        if sr == o or sr.is_relative_to(o):
            raise OutputExists(f"--overwrite would delete {str(out)!r}, which holds the source checkpoint",
                               hint="choose an output directory outside the source checkpoint")
    w.agree({"identity": identity, "output": str(out.resolve()), "overwrite": opts.overwrite,
             "resume": opts.resume, "kv_scales": opts.kv_scales})
    with contextlib.ExitStack() as held:
        def prepare():  # rank 0 holds OUT's lock for the whole job; the other ranks write into it under it
            held.enter_context(output_lock(out))
            found = prepare_output(out, identity, overwrite=opts.overwrite, resume=opts.resume)
            found = trusted_records(found, job.plans, {p.source: src.shard(p.source).size for p in job.plans}, out,
                                    src.info, log)
            write_json_atomic(out / MANIFEST_NAME, {"status": "in_progress", "identity": identity}, durable=False)
            return found

        done = w.broadcast(w.step(lambda: prepare() if w.leader else None, "preparing the output", "write"))
        spool = Spool()
        if job.calibrated and len(done) < len(job.plans):
            spool = _calibrate(job, data, out / JOURNAL_DIR / "calib", log, opts, w, split_calib, calib_report)
        results, mine = _stream(job, out, opts, w, spool, done, progress)
        timelines = w.all_gather(tl.to_json())
        if w.size > 1:
            for part in w.all_gather(mine):
                results.update(part)
            if progress:
                progress(src.total_bytes, src.total_bytes)
            if not w.leader:  # rank 0 writes index, config, card and manifest; every rank returns its result
                return _follow(w)

        for p in job.plans:  # what reading found (e.g. scales breaking a ue8m0 promise), in shard order
            for n in results[p.source].get("notes") or []:
                if n not in notes:
                    notes.append(n)
                    if log:
                        log(n)

        def finish():
            kv_out = write_kv_scales(out, kv) if kv is not None else None
            calibration = None if data is None else {**data.describe(), "compute_dtype": identity["compute_dtype"]}
            res = _finalize(job, opts, out, _Outcome(results, identity, notes, kv, kv_out, len(done), t0, calibration))
            res.device, res.device_memory = calib_report.get("device"), calib_report.get("memory")
            return res

        if w.size == 1:
            res = w.step(finish, "writing the index and manifest", "write")
        else:
            res = w.broadcast(w.step(finish, "writing the index and manifest", "write"))
        timelines[w.rank] = tl.to_json()  # this rank's, with the manifest written
        res.timeline = {"ranks": timelines}
        timeline.stop()
        return res


def _follow(w) -> "ConvertResult":
    """A rank other than 0 after its shards: rank 0's result once it has written the index and manifest."""
    return w.broadcast(w.step(lambda: None, "writing the index and manifest"))


def _source_modules(src: Checkpoint, hidden: int | None):
    """(module, shape) of every Linear of the source as recipes see it: `X.weight` 2-D, a packed `X.weight_packed`
    (shape as stored), each expert of a fused 3-D expert tensor."""
    from ..match.shards import fused_items

    for name in src.location:
        info = src.info(name)
        items = fused_items(name, info, hidden) if len(info.shape) == 3 else None
        if items:
            yield from ((m, tuple(shape)) for m, _, shape in items)
        elif name.endswith(".weight") and len(info.shape) == 2:
            yield name[: -len(".weight")], tuple(info.shape)
        elif name.endswith(Tensor.PACKED.dotted):
            yield name[: -len(Tensor.PACKED.dotted)], tuple(info.shape)


def _matches_any(src: Checkpoint, recipe: Recipe, hidden: int | None) -> bool:
    return any(recipe.match(m) is not None for m, _ in _source_modules(src, hidden))


def _w4afp8_rules(src: Checkpoint, recipe: Recipe, hidden: int | None, tp: int | None) -> str | None:
    """vLLM's W4AFP8 MoE shape rules (engine/w4afp8.py) on the modules the recipe's W4AFP8 groups target,
    from the headers alone; raises W4AFP8ShapeError, or returns a note naming the --tp values that work."""
    if not any(g.scheme.activations == "fp8" for g in recipe.groups):
        return None
    from ..engine.w4afp8 import check_modules
    from ..match.shards import fused_items

    modules = []
    for name in src.location:
        info = src.info(name)
        items = fused_items(name, info, hidden) if len(info.shape) == 3 else None
        pairs = [(m, tuple(shape)) for m, _, shape in items] if items else (
            [(name[: -len(".weight")], tuple(info.shape))] if name.endswith(".weight") and len(info.shape) == 2 else [])
        for module, shape in pairs:
            g = recipe.match(module)
            if g is not None and g.scheme.activations == "fp8":
                modules.append((module, shape))
    return check_modules(modules, tp)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _run_shards(todo, src: Checkpoint, out: Path, opts: ConvertOptions, spool, record, progress, finished_bytes: int,
                total: int) -> None:
    if opts.workers <= 1 or len(todo) <= 1:
        batches = BatchBuffer()  # one work-batch buffer for every shard (dropped when this returns)
        for p in todo:
            base = finished_bytes
            res = run_shard(p, src.root / p.source, out,
                            progress=(lambda r, b=base: progress(b + r, total)) if progress else None, spool=spool,
                            batches=batches, rotation=src.rotation)
            finished_bytes += src.shard(p.source).size
            record(res)
            if progress:
                progress(finished_bytes, total)
    else:
        import multiprocessing as mp

        threads = 1
        ex = ProcessPoolExecutor(max_workers=opts.workers, mp_context=mp.get_context("spawn"),
                                 initializer=_die_with_parent)
        try:
            for res in ex.map(worker, [(p, src.root / p.source, out, threads, spool, src.rotation) for p in todo]):
                record(res)
                finished_bytes += res.source_size
                if progress:
                    progress(finished_bytes, total)
        except BaseException:  # a failed shard, Ctrl-C, SIGTERM: no worker goes on writing after this returns
            procs = list((getattr(ex, "_processes", None) or {}).values())
            ex.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.join(10)
            raise
        ex.shutdown(wait=True)


def _die_with_parent() -> None:
    """A convert worker ends when the process that started it does (Linux PR_SET_PDEATHSIG), however it ends
    (SIGKILL included): a shard it was writing stays a temporary, and the resume redoes it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def _written_files(out: Path, names) -> dict:
    """{name: {size, sha256}} of the files `_finalize` wrote besides the shards (a pair half's `files`,
    pack/manifest.py), hashed as they were just written; the ones later commands rewrite are left out."""
    return {n: {"size": (out / n).stat().st_size, "sha256": sha256_file(out / n)}
            for n in sorted(set(names) - AFTER_CONVERT)}


@dataclass(frozen=True)
class _Outcome:
    """What the conversion did, for `_finalize`: every shard's journal record (`results`, by source shard), the
    output's identity, the notes, the KV scales shipped (`kv`; `kv_out`: their shard as written), the calibration
    data's description, how many shards a resume found done, and when the conversion started (`t0`)."""

    results: dict[str, dict]
    identity: dict
    notes: list[str]
    kv: kvrules.KVScales | None
    kv_out: dict | None
    resumed: int
    t0: float
    calibration: dict | None = None


def _finalize(job: _Job, opts: ConvertOptions, out: Path, outcome: _Outcome) -> ConvertResult:
    """The index, config.json, the copied files, and the manifest (pack/manifest.py) last. One half of a
    prefill/decode pair (`opts.pair`) ends with a manifest that says "pair_pending" (convert/pair.py completes it)."""
    src, fmt, recipe, plans = job.src, job.fmt, job.recipe, job.plans
    results, identity, notes, kv = outcome.results, outcome.identity, outcome.notes, outcome.kv
    kv_scheme = kv.config() if kv is not None else (fmt.kv_cache_scheme if job.source_kv else None)
    pair_role = opts.pair["role"] if opts.pair else None
    wait_durable()  # every shard written by this process is on disk before the index and manifest
    ordered = [results[p.source] for p in plans]
    tensors: dict[str, dict] = {}
    weight_map: dict[str, str] = {}
    out_shards = [{**o, "source_shard": r["source"]} for r in ordered for o in r["outputs"]]
    for rec in ordered:
        for name in sorted(rec["tensors"]):
            tensors[name] = rec["tensors"][name]
            weight_map[name] = rec["tensors"][name]["shard"]
    if outcome.kv_out is not None:
        out_shards.append({**outcome.kv_out, "source_shard": None})
        for name, t in kv.ordered():
            tensors[name] = {"shape": list(t.shape), "dtype": "float32", "shard": kvrules.KV_SHARD_NAME,
                             "source_shard": None, "kv_cache": kv.strategy}
            weight_map[name] = kvrules.KV_SHARD_NAME
    total_size = sum(o["size"] for o in out_shards)
    write_json_atomic(out / INDEX_NAME, {"metadata": {"total_size": total_size},
                                         "weight_map": dict(sorted(weight_map.items()))})
    from ..engine.vllm_config import apply_additions, config_additions

    added = config_additions(src.config, src.location)  # keys vLLM needs that the source omits
    config = apply_additions(dict(src.config), added)
    if added:
        notes = [*notes, "config.json: added " + ", ".join(f"{k}={v!r}" for k, v in added.items())
                 + " (vLLM needs it to load the router bias: docs/engine.md, rule R1)"]
    qc = quantization_config(results, kv_scheme, text_config(src.config)[1])
    if qc is None:
        config.pop("quantization_config", None)  # nothing quantized: the source's (FP8) config must not stay
    else:
        config["quantization_config"] = qc
    write_json_atomic(out / "config.json", config)
    copied = src.non_weight_files()
    for p in copied:
        copy_file_atomic(p, out / p.name)

    modules = {n.rsplit(".", 1)[0]: e for n, e in tensors.items() if "scheme" in e}
    quantized = [m for m, e in modules.items() if e["method"] != "passthrough"]
    manifest = {
        "status": "in_progress",
        "format_version": FORMAT_VERSION,
        "tool": {"name": "quantkit", "version": __version__},
        "identity": identity,
        "recipe": {"name": recipe.name, "sha256": recipe.sha256, "text": recipe.text},
        "source": {"config_sha256": hashlib.sha256((src.root / "config.json").read_bytes()).hexdigest(),
                   "format": {"kind": fmt.kind, "description": fmt.describe(),
                              "block": list(fmt.block) if fmt.block else None, "scale_fmt": fmt.scale_fmt,
                              "modules_to_not_convert": list(fmt.not_converted)},
                   "shards": [{"name": r["source"], "size": r["source_size"], "sha256": r["source_sha256"]}
                              for r in ordered]},
        "shards": [{"name": o["name"], "size": o["size"], "sha256": o["sha256"], "source_shard": o["source_shard"]}
                   for o in out_shards],
        "summary": {"tensors_total": len(tensors), "modules_quantized": len(quantized),
                    "modules_passed_through": len(modules) - len(quantized),
                    "modules_dequantized": sum(1 for e in tensors.values() if e.get("method") == "dequantized"),
                    "bytes_read": sum(r["source_size"] for r in ordered), "bytes_written": total_size},
        "notes": notes,
        "calibration": (None if outcome.calibration is None else
                        {**outcome.calibration, **expert_report(tensors)}),
        "rotation": None if src.rotation is None else src.rotation.manifest(),
        "kv_cache": (None if kv is None else {"strategy": kv.strategy, "scheme": kv.config(), "origin": kv.origin,
                                             "shard": kvrules.KV_SHARD_NAME, "tensors": len(kv.scales)}),
        "quantization_config": qc,
        "tensors": tensors,
    }
    if added:  # config.json keys vLLM needs that the source omitted (quantkit/engine/vllm_config.py)
        manifest["config_added"] = added
    write_json_atomic(out / MANIFEST_NAME, manifest)  # still in_progress: journal removed next
    shutil.rmtree(out / JOURNAL_DIR, ignore_errors=True)
    manifest["status"] = "complete"
    if opts.model_card:
        write_model_card(out, src.root, source_id=opts.source_id, manifest=manifest)
    if pair_role is not None:  # one half of a pair: complete once both halves are (convert/pair.py)
        manifest["status"] = PAIR_PENDING
        manifest[PAIR_KEY] = {"role": pair_role, "files": _written_files(out, [INDEX_NAME, "config.json",
                                                                              *(p.name for p in copied)])}
    write_json_atomic(out / MANIFEST_NAME, manifest)  # the last write: only now does it look finished
    return ConvertResult(str(out), round(time.perf_counter() - outcome.t0, 3), manifest["summary"]["bytes_read"],
                         total_size, len(tensors), len(quantized), peak_rss_bytes(), outcome.resumed,
                         len(modules) - len(quantized), list(notes))

