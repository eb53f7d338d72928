"""The calibrated pass over the whole model, layer by layer, into a spool directory that `convert` reads.

Results go to the spool, one safetensors file + one JSON file per layer (under torchrun, per layer and rank: each
rank writes what it solved, `layer_name`):
- packed tensors under their final output names (`<module>.weight_packed`, `.weight_scale`, ...),
- overrides: source tensors whose values changed (AWQ folds its scales into the post-attention norm, the
  router and the shared experts), stored in the source dtype under the source name,
- per-module metadata (method, tokens seen, fallback and why, damping, SQNR).
`convert` then streams the checkpoint as usual, taking these tensors instead of recomputing them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import timeline
from ..errors import CalibrationError
from ..match.recipe import Recipe
from ..pack.manifest import entry_fields_ok
from ..write.writer import fsync_path, write_json_atomic, write_safetensors
from .device import Placement
from .layer import quantize_layer, statistics_bytes

PROGRESS_NAME = "progress.json"  # in the spool: how far an interrupted pass got

# The calibrated pass cuts the samples into at least this many forward batches when they allow it (whole
# samples per batch; fewer tokens per call than the executor's default when needed): the batches are the
# unit of data parallelism, and they are the same whatever the world size (calib/parallel.py).
MIN_BATCHES = 8


def pass_batch_tokens(batch_tokens: int, lengths: list[int]) -> int:
    """Tokens per forward call of the calibrated pass: the executor's, capped so that the samples make at
    least MIN_BATCHES batches (never below the longest sample). Samples of one length (the usual `seq_len`
    calibration) are then cut into a multiple of MIN_BATCHES batches as equal as whole samples allow, so
    that 2, 4 or 8 ranks forward the same tokens each (64 samples of 256 at 1634 tokens: 16 batches of 4
    samples, not 10 of 6 and one of 4, which left one of two ranks 13% more). Depends on the samples only."""
    if not lengths:
        return batch_tokens
    cap = max(max(lengths), -(-sum(lengths) // MIN_BATCHES))
    tokens = max(1, min(int(batch_tokens), cap))
    t, n = max(lengths), len(lengths)
    if t > 0 and all(x == t for x in lengths):
        per = max(1, tokens // t)  # samples per batch
        # the most samples per batch (at least half the allowed) that cut them into a multiple of MIN_BATCHES
        # equal batches; else that many batches, as equal as whole samples allow
        even = [p for p in range(per, (per + 1) // 2 - 1, -1) if n % p == 0 and (n // p) % MIN_BATCHES == 0]
        if even:
            per = even[0]
        else:
            batches = -(-(-(-n // per)) // MIN_BATCHES) * MIN_BATCHES
            per = max(1, -(-n // batches))
        tokens = per * t
    return tokens


_LAYER_STEM = re.compile(r"layer-(\d{5})(?:-rank(\d{1,6})-of-(\d{1,6}))?")  # what layer_name gives; fullmatch


def layer_name(layer: int, rank: int = 0, size: int = 1) -> str:
    """The spool files' stem of layer `layer`'s results solved by rank `rank` of a world of `size`."""
    return f"layer-{layer:05d}" if size == 1 else f"layer-{layer:05d}-rank{rank}-of-{size}"


def _is_layer_name(name: str, size: int, below: int) -> bool:
    """Whether `name` is a spool stem `layer_name` gives for a layer before `below` in a world of `size`."""
    m = _LAYER_STEM.fullmatch(name)
    if m is None or int(m[1]) >= below:
        return False
    return m[2] is None if size == 1 else (m[2] is not None and name == layer_name(int(m[1]), int(m[2]), size)
                                           and int(m[2]) < size)


def activations_name(layer: int, rank: int = 0, size: int = 1) -> str:
    """The spool file of layer `layer`'s input activations (of rank `rank`'s samples in a world of `size`)."""
    return f"activations-{layer:05d}.bin" if size == 1 else f"activations-{layer:05d}-rank{rank}-of-{size}.bin"


def reference_name(layer: int, rank: int = 0, size: int = 1) -> str:
    """The spool file of the unquantized model's hidden states entering layer `layer` (fit_unquantized; of
    rank `rank`'s samples in a world of `size`)."""
    return f"reference-{layer:05d}.bin" if size == 1 else f"reference-{layer:05d}-rank{rank}-of-{size}.bin"


def fits_unquantized(recipe: Recipe) -> bool:
    """Whether a GPTQ group of `recipe` fits its experts to the unquantized model (options.fit_unquantized):
    the pass then forwards the unquantized model's hidden states beside the quantized ones."""
    return any(g.method == "gptq" and g.options.fit_unquantized for g in recipe.groups)


# a module's metadata from the pass goes into its manifest entries (pack/manifest.ENTRY_FIELDS); the keys that
# describe the stored tensor are convert's own, never the spool's
_NOT_META = {"shape", "dtype", "shard"}


def index_problem(index, spool: Path) -> str | None:
    """What makes the finished spool's index (index.json, hostile: it lies in OUT) or a layer record it names
    unusable, or None: its layers must be spool stems whose `.json` and `.safetensors` exist in `spool`, each
    `.json` listing tensor names; its modules' metadata must have the types the manifest entries take."""
    if not isinstance(index, dict):
        return "the index is not an object"
    layers, modules, overrides = index.get("layers"), index.get("modules"), index.get("overrides", [])
    if not isinstance(layers, list) or not all(isinstance(n, str) and _LAYER_STEM.fullmatch(n) for n in layers):
        return "its layers are not spool file names"
    if not isinstance(overrides, list) or not all(isinstance(n, str) for n in overrides):
        return "its overrides are not tensor names"
    if not isinstance(modules, dict):
        return "its modules are not an object"
    for m, meta in modules.items():
        if not isinstance(meta, dict) or _NOT_META & set(meta) or not entry_fields_ok(meta):
            return f"the metadata of {str(m)[:120]} has fields of the wrong type"
    for n in layers:
        if not (spool / f"{n}.safetensors").is_file():
            return f"{n}.safetensors is missing"
        try:
            rec = json.loads((spool / f"{n}.json").read_text())
        except (OSError, ValueError):
            return f"{n}.json is missing or not JSON"
        if not isinstance(rec, dict) or not all(isinstance(rec.get(k), list) and all(isinstance(x, str) for x in rec[k])
                                                for k in ("tensors", "overrides")):
            return f"{n}.json does not list its tensors"
    return None


def _read_progress(spool: Path, num_layers: int, lengths: list[int], hidden: int, dtype: torch.dtype,
                   batch_tokens: int, rank: int = 0, size: int = 1, reference: bool = False):
    """The progress record of an interrupted pass over the same samples, if whole and consistent (anything
    else, torn or foreign, means starting over): (next layer, index so far, this rank's activation file,
    the unquantized model's hidden states file or None). A distributed pass's record names its world size
    and batch size: it resumes under the same ones. `reference`: the pass keeps the unquantized model's
    stream (fits_unquantized), which the record must name."""
    try:
        rec = json.loads((spool / PROGRESS_NAME).read_text())
        nxt, index, name = rec["next_layer"], rec["index"], rec["activations"]
        layers = index["layers"]
        ref = rec.get("reference")
        ok = (isinstance(nxt, int) and 0 < nxt < num_layers and rec["lengths"] == lengths
              and (ref == reference_name(nxt, 0, size) and (spool / reference_name(nxt, rank, size)).is_file()
                   if reference else ref is None)
              and rec["hidden"] == hidden and rec["dtype"] == str(dtype)
              and rec.get("world", 1) == size and rec.get("batch_tokens", batch_tokens) == batch_tokens
              and name == activations_name(nxt, 0, size)
              and (spool / activations_name(nxt, rank, size)).is_file()
              and isinstance(index["modules"], dict) and isinstance(index["overrides"], list)
              and isinstance(layers, list) and all(isinstance(n, str) and _is_layer_name(n, size, nxt) for n in layers)
              and all((spool / f"{n}.json").is_file() and (spool / f"{n}.safetensors").is_file() for n in layers))
        act = spool / activations_name(nxt, rank, size)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (nxt, index, act, spool / reference_name(nxt, rank, size) if reference else None) if ok else None


def run_calibrated(src_dir, recipe: Recipe, samples, spool: Path, *, progress: Callable[[int, int], None] | None = None,
                   log: Callable[[str], None] = lambda m: None, placement: Placement = Placement(), world=None,
                   pool: int = 0) -> dict | None:
    """Quantize every calibrated group of `recipe` layer by layer; write the spool; return its index
    {"layers": [...], "modules": {module: meta}, "overrides": [names], "device": ..., "memory": {...}}.

    `placement` (calib/device.py): the device (cpu, cuda, cuda:N, auto; None: options.DEVICE) and the compute
    dtype (None: the device's) as for LayerExecutor. Before any layer is read, every layer's peak device memory
    is estimated (its weights, forward, statistics and solves: layer.statistics_bytes) and checked against
    `placement.available_bytes` (None: what the GPU reports free; the CPU is not checked); the plan goes to
    `log` and the index.

    `world` (quantkit.dist.World; None: one process): with several ranks every rank calls this with the same
    arguments; the pass is data and expert parallel (calib/parallel.py), rank 0 writes the spool and returns
    the index, the other ranks return None. The result is the same bytes whatever the world size.

    Resumable per layer: after each layer the spool gets that layer's results (fsynced), then the next
    layer's input activations (the quantized layer's outputs, written whole or not at all; with several
    ranks, one file per rank holding its own batches' samples, every one written before the record), then a
    progress record naming them. A pass that finds a consistent record in `spool` (under the same world
    size) continues at that layer with those activations, and ends with the same results as an
    uninterrupted pass (the pass is deterministic).

    `pool`: the last `pool` samples are the top-up pool of GPTQOptions.balance_tokens (calib/data.py), forwarded
    after every calibration sample; only the routed experts' statistics read them (calib/hessians.py)."""
    from ..dist import World
    from .executor import LayerExecutor

    w = world if world is not None else World()
    spool = Path(spool)
    with timeline.phase("setup"):
        ex = LayerExecutor(src_dir, dtype=placement.dtype, device=placement.device, workdir=spool,
                           available_bytes=placement.available_bytes)
        return _run(_Pass.start(ex, w, recipe, samples, pool, spool, progress, log), samples)


def primary_tokens(lengths: list[int], pool: int, batch_tokens: int) -> int | None:
    """The calibration samples' tokens when the last `pool` samples are a top-up pool (None: no pool), checked
    to come first in the pass's batch order: the statistics tell the pool's rows by their running count."""
    if not pool:
        return None
    from .activations import batch_plan

    first = len(lengths) - pool
    order = [i for chunk in batch_plan(lengths, batch_tokens) for i in chunk]
    if any(i >= first for i in order[:first]):
        raise CalibrationError("the top-up pool's samples do not come after every calibration sample in the "
                               "pass's batch order (they must be full length)")
    return sum(lengths[:first])


@dataclass
class _Pass:
    """What every layer's step of the calibrated pass needs: the executor (checkpoint, compute dtype, device
    memory plan), the ranks (calib/parallel.py), the recipe, the samples' lengths and the calibration tokens
    before a top-up pool (`primary`, None: no pool), the spool directory and where progress and log lines go."""

    ex: object  # calib/executor.py LayerExecutor
    par: object  # calib/parallel.py Parallel
    recipe: Recipe
    lengths: list[int]
    primary: int | None
    spool: Path
    progress: Callable[[int, int], None] | None
    log: Callable[[str], None]
    plan: object = None  # calib/device.py MemoryPlan

    @classmethod
    def start(cls, ex, world, recipe: Recipe, samples, pool: int, spool: Path, progress, log) -> "_Pass":
        """The pass over `samples` (the last `pool` of them a top-up pool) on `ex` in `world`: its batches cut, its
        ranks' shares set and every layer's device memory planned (refused before any layer is read when a
        layer cannot fit)."""
        from .parallel import Parallel

        lengths = [int(len(x)) for x in samples]
        ex.batch_tokens = pass_batch_tokens(ex.batch_tokens, lengths)
        par = Parallel(world, lengths, ex.batch_tokens)
        p = cls(ex, par, recipe, lengths, primary_tokens(lengths, pool, ex.batch_tokens), spool, progress, log)
        if par.distributed:
            ex.share = set(par.mine)
            ex.file_tag = f"-rank{par.rank}-of-{par.size}"
        p.plan = ex.plan_memory(lengths, statistics=lambda i, layer: statistics_bytes(  # refuses first
            ex.ckpt, recipe, i, layer, ex.device, ex.dtype, ex.call_tokens(lengths), lengths, par.size))
        if par.leader:
            log(p.plan.summary())
        return p


def _resume(p: _Pass, samples, fit: bool):
    """(inputs, first layer, index, the unquantized model's stream or None) to go on from: a consistent progress
    record's, when every rank found one at the same layer, else the samples' from layer 0."""
    ex, par = p.ex, p.par
    found = _read_progress(p.spool, ex.num_layers, p.lengths, ex.hidden_size, ex.dtype, ex.batch_tokens, par.rank,
                           par.size, reference=fit)
    restored = reference = None
    if found is not None:
        try:
            restored = ex.restore_samples(found[2], p.lengths, par.samples())
            if fit:
                reference = ex.restore_samples(found[3], p.lengths, par.samples())
        except (OSError, ValueError):  # activations that do not fit the samples: start over
            if restored is not None:
                restored.close()
            restored = None
    # every rank resumes at the same layer, or none does
    views = par.world.all_gather(None if restored is None else found[0])
    if restored is not None and all(v == found[0] for v in views):
        if par.leader:
            p.log(f"resuming calibration at layer {found[0]} of {ex.num_layers}")
        return restored, found[0], found[1], reference
    if restored is not None:
        restored.close()
        if reference is not None:
            reference.close()
            reference = None
    return samples, 0, {"layers": [], "modules": {}, "overrides": []}, reference


def _run(p: _Pass, samples):
    ex, par, spool = p.ex, p.par, p.spool
    fit = fits_unquantized(p.recipe)
    if fit:
        ex.check_second_stream()  # before any layer
    spool.mkdir(parents=True, exist_ok=True)
    inputs, start, index, reference = _resume(p, samples, fit)
    ref = _Reference(reference) if fit else None
    try:
        _layer_loop(p, inputs, start, index, ref)
    finally:
        if ref is not None and ref.store is not None:
            ref.store.close()

    def cleanup():
        if par.leader:
            for f in [spool / PROGRESS_NAME, *spool.glob("activations-*"), *spool.glob(".activations-*"),
                      *spool.glob("reference-*"), *spool.glob(".reference-*")]:
                f.unlink(missing_ok=True)

    par.step(cleanup, "finishing the calibration spool", "write")
    ex.measured_peak_bytes()
    if not par.leader:
        return None
    index["device"] = str(ex.device)
    index["memory"] = p.plan.to_json()
    return index


class _Reference:
    """The unquantized model's hidden states beside the quantized ones (fit_unquantized): each layer is
    forwarded over them before it is quantized, its routed experts' inputs kept for the statistics."""

    def __init__(self, store):
        self.store = store

    def advance(self, ex, step) -> list:
        """Forward `step`'s (still unquantized) layer over the stream; returns the routed experts' inputs of
        each forward call, in batch order (nothing for a layer without routed experts)."""
        from .layer import _find_moe

        moe = _find_moe(step.layer)
        if self.store is None:  # the first layer: the stream starts from the same embeddings
            self.store = ex._new_store(step.inputs.lengths)
            self.store.data.copy_(step.inputs.data)
        out, seen = ex.forward_capture(step.layer, self.store, moe[1] if moe is not None else None)
        self.store.close()
        self.store = out
        return seen


def _layer_loop(p: _Pass, inputs, start: int, index: dict, ref: _Reference | None) -> None:
    """Every layer from `start`: its statistics, solves and spool files, the next layer's inputs saved and the
    progress recorded (`index` grows in place). `ref`: the unquantized model's stream (fit_unquantized)."""
    ex, par = p.ex, p.par
    for step in ex.layers(inputs, start=start):
        seen = None
        if ref is not None:
            seen = par.step(lambda: ref.advance(ex, step),
                            f"forwarding the unquantized decoder layer {step.index}", "forward")
        r = quantize_layer(ex.ckpt, p.recipe, step, p.log, **({"par": par} if par.distributed else {}),
                           **({"primary_tokens": p.primary} if p.primary is not None else {}),
                           **({"reference": seen} if seen is not None else {}))
        del seen
        nxt = step.index + 1 if step.index + 1 < ex.num_layers else None
        # every rank's part of the layer, written, with the check (one collective)
        parts = [x for x in par.step_all(lambda: _finish_layer(p, step, r, nxt, ref),
                                         f"forwarding decoder layer {step.index} and saving its results", "forward")
                 if x is not None]
        for name, meta in parts:  # in rank order, then the input scales: the same index whatever the world size
            index["layers"].append(name)
            index["modules"].update(meta["modules"])
        for _, meta in parts:
            for module, extra in meta["input_scales"].items():
                index["modules"].setdefault(module, {}).update(extra)
        index["overrides"].extend(sorted(o for _, meta in parts for o in meta["overrides"]))
        if nxt is not None:
            par.step(lambda: _record(p, nxt, index, ref is not None),
                     f"recording the progress of the calibration after decoder layer {step.index}", "write")
        if p.progress:
            p.progress(step.index + 1, ex.num_layers)


def _write_layer(p: _Pass, step, r):
    """This rank's part of the layer's result `r` (what it solved) into one spool file pair, made durable:
    (name, its record), or None when it has nothing."""
    if not (r.tensors or r.overrides):
        return None
    par, spool = p.par, p.spool
    name = layer_name(step.index, par.rank, par.size)
    tensors = {**{k: v.contiguous() for k, v in r.tensors.items()},
               **{k: v.contiguous() for k, v in r.overrides.items()}}
    write_safetensors(spool / f"{name}.safetensors", dict(sorted(tensors.items())))
    meta = {"tensors": sorted(r.tensors), "overrides": sorted(r.overrides), "modules": r.modules,
            "input_scales": r.input_scales}
    (spool / f"{name}.json").write_text(json.dumps(meta, sort_keys=True))
    fsync_path(spool / f"{name}.safetensors")
    fsync_path(spool / f"{name}.json")
    return name, meta


def _finish_layer(p: _Pass, step, r, nxt: int | None, ref: _Reference | None):
    """What needs no other rank: one step, so the ranks align once here, not thrice. The layer forwarded
    (true-sequential: the next layer calibrates on this layer's quantized output), its result written, the
    next layer's inputs (and the unquantized stream) saved. Returns `_write_layer`'s."""
    par, spool = p.par, p.spool
    step.forward()
    with timeline.phase("write"):
        written = _write_layer(p, step, r)
        if nxt is not None:
            step.outputs.save_samples(spool / activations_name(nxt, par.rank, par.size), par.samples())
            if ref is not None:
                ref.store.save_samples(spool / reference_name(nxt, par.rank, par.size), par.samples())
    return written


def _record(p: _Pass, nxt: int, index: dict, reference: bool) -> None:
    """The progress record naming layer `nxt`'s inputs (every rank's activations are durable: the record may
    name them), the older activation files removed."""
    par, ex, spool = p.par, p.ex, p.spool
    if par.rank != par.size - 1:  # the last rank: rank 0 has more to write (index, AWQ's results)
        return
    write_json_atomic(spool / PROGRESS_NAME, {
        "next_layer": nxt, "activations": activations_name(nxt, 0, par.size), "world": par.size,
        "batch_tokens": ex.batch_tokens, "lengths": p.lengths, "hidden": ex.hidden_size,
        "dtype": str(ex.dtype), "index": index,
        **({"reference": reference_name(nxt, 0, par.size)} if reference else {})})
    keep = {f(nxt, r_, par.size) for r_ in range(par.size) for f in (activations_name, reference_name)}
    for old in [*spool.glob("activations-*.bin"), *spool.glob("reference-*.bin")]:
        if old.name not in keep:
            old.unlink(missing_ok=True)
