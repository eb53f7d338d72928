"""The calibrated pass over the whole model, layer by layer, into a spool directory that `convert` reads.

Results go to the spool, one safetensors file + one JSON file per layer:
- packed tensors under their final output names (`<module>.weight_packed`, `.weight_scale`, ...),
- overrides: source tensors whose values changed (AWQ folds its scales into the post-attention norm, the
  router and the shared experts), stored in the source dtype under the source name,
- per-module metadata (method, tokens seen, fallback and why, damping, SQNR).
`convert` then streams the checkpoint as usual, taking these tensors instead of recomputing them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import torch

from ..match.recipe import Recipe
from ..write.writer import fsync_path, write_json_atomic, write_safetensors
from .layer import quantize_layer, statistics_bytes

PROGRESS_NAME = "progress.json"  # in the spool: how far an interrupted pass got


def _read_progress(spool: Path, num_layers: int, lengths: list[int], hidden: int, dtype: torch.dtype):
    """The progress record of an interrupted pass over the same samples, if whole and consistent (anything
    else, torn or foreign, means starting over): (next layer, index so far, activation file)."""
    try:
        rec = json.loads((spool / PROGRESS_NAME).read_text())
        nxt, index, name = rec["next_layer"], rec["index"], rec["activations"]
        layers = index["layers"]
        ok = (isinstance(nxt, int) and 0 < nxt < num_layers and rec["lengths"] == lengths
              and rec["hidden"] == hidden and rec["dtype"] == str(dtype)
              and name == f"activations-{nxt:05d}.bin" and (spool / name).is_file()
              and isinstance(index["modules"], dict) and isinstance(index["overrides"], list)
              and isinstance(layers, list) and all(isinstance(n, str) and re.fullmatch(r"layer-\d{5}", n)
                                                   and int(n[6:]) < nxt for n in layers)
              and all((spool / f"{n}.json").is_file() and (spool / f"{n}.safetensors").is_file() for n in layers))
        act = spool / name
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (nxt, index, act) if ok else None


def run_calibrated(src_dir, recipe: Recipe, samples, spool: Path, *, progress: Callable[[int, int], None] | None = None,
                   log: Callable[[str], None] = lambda m: None, dtype: torch.dtype | None = None,
                   device: str | torch.device | None = None, available_bytes: int | None = None) -> dict:
    """Quantize every calibrated group of `recipe` layer by layer; write the spool; return its index
    {"layers": [...], "modules": {module: meta}, "overrides": [names], "device": ..., "memory": {...}}.

    `device` (cpu, cuda, cuda:N, auto; None: options.DEVICE) and `dtype` (None: the device's compute dtype)
    as for LayerExecutor. Before any layer is read, every layer's peak device memory is estimated (its
    weights, forward, statistics and solves: layer.statistics_bytes) and checked against `available_bytes`
    (None: what the GPU reports free; the CPU is not checked); the plan goes to `log` and the index.

    Resumable per layer: after each layer the spool gets that layer's results (fsynced), then the next
    layer's input activations (the quantized layer's outputs, written whole or not at all), then a progress
    record naming both. A pass that finds a consistent record in `spool` continues at that layer with
    those activations, and ends with the same results as an uninterrupted pass (the pass is deterministic)."""
    from .executor import LayerExecutor

    spool = Path(spool)
    ex = LayerExecutor(src_dir, dtype=dtype, device=device, workdir=spool, available_bytes=available_bytes)
    ckpt = ex.ckpt
    dtype = ex.dtype
    lengths = [int(len(x)) for x in samples]
    plan = ex.plan_memory(lengths, statistics=lambda i, layer: statistics_bytes(
        ckpt, recipe, i, layer, ex.device, ex.dtype, ex.call_tokens(lengths), lengths))  # refuses before any work
    log(plan.summary())
    spool.mkdir(parents=True, exist_ok=True)
    index = {"layers": [], "modules": {}, "overrides": []}
    start, inputs = 0, samples
    found = _read_progress(spool, ex.num_layers, lengths, ex.hidden_size, dtype)
    if found is not None:
        try:
            inputs = ex.restore(found[2], lengths)
        except (OSError, ValueError):
            pass  # activations that do not fit the samples: start over
        else:
            start, index = found[0], found[1]
            log(f"resuming calibration at layer {start} of {ex.num_layers}")
    for step in ex.layers(inputs, start=start):
        r = quantize_layer(ckpt, recipe, step, log)
        step.forward()  # true-sequential: the next layer calibrates on this layer's quantized output
        if r.tensors or r.overrides:
            name = f"layer-{step.index:05d}"
            tensors = {**{k: v.contiguous() for k, v in r.tensors.items()},
                       **{k: v.contiguous() for k, v in r.overrides.items()}}
            write_safetensors(spool / f"{name}.safetensors", dict(sorted(tensors.items())))
            meta = {"tensors": sorted(r.tensors), "overrides": sorted(r.overrides), "modules": r.modules}
            (spool / f"{name}.json").write_text(json.dumps(meta, sort_keys=True))
            fsync_path(spool / f"{name}.safetensors")
            fsync_path(spool / f"{name}.json")
            index["layers"].append(name)
            index["modules"].update(r.modules)
            index["overrides"].extend(sorted(r.overrides))
        if step.index + 1 < ex.num_layers:
            act = f"activations-{step.index + 1:05d}.bin"
            step.outputs.save(spool / act)
            write_json_atomic(spool / PROGRESS_NAME, {"next_layer": step.index + 1, "activations": act,
                                                      "lengths": lengths, "hidden": ex.hidden_size,
                                                      "dtype": str(dtype), "index": index})
            for old in spool.glob("activations-*.bin"):
                if old.name != act:
                    old.unlink(missing_ok=True)
        if progress:
            progress(step.index + 1, ex.num_layers)
    for p in [spool / PROGRESS_NAME, *spool.glob("activations-*"), *spool.glob(".activations-*")]:
        p.unlink(missing_ok=True)
    ex.measured_peak_bytes()
    index["device"] = str(ex.device)
    index["memory"] = plan.to_json()
    return index
