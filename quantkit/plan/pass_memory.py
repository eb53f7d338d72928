"""Memory of the calibrated pass, per rank, for the cost model (plan/calibration.py): device memory is not
re-derived here, the executor's own estimate (`LayerExecutor.plan_memory` with `calib.layer.statistics_bytes`,
calib/device.py) is run on the meta model built from the config, over a checkpoint that exists only as its
enumerated tensor headers (plan/tensors.py): no weights are needed. Host RAM adds the process, the layer's
packed results and the activations kept off the device.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Mapping


# ---- a checkpoint that exists only as headers --------------------------------------------------------------
def virtual_checkpoint(config: Mapping[str, Any], tensors: Mapping[str, tuple[tuple[int, ...], str]] | None = None):
    """A read.checkpoint.Checkpoint whose one shard exists only as a header: the tensors a config.json
    describes (plan.tensors.source_tensors), or `tensors`. Enough for the executor's meta model, its
    memory plan and the calibrated targets; never for reading data."""
    from ..arch import parse_config
    from ..read.checkpoint import Checkpoint, Shard
    from ..read.safetensors import DTYPES, Header, TensorInfo
    from .tensors import source_tensors

    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    if tensors is None:
        tensors = source_tensors(parse_config(cfg))
    name = "virtual.safetensors"
    infos, off = {}, 0
    for n, (shape, code) in tensors.items():
        nb = math.prod(shape) * DTYPES[code][1]
        infos[n] = TensorInfo(n, DTYPES[code][0], tuple(shape), off, off + nb)
        off += nb
    header = Header(Path("/nonexistent") / name, infos, {}, 0, off)
    return Checkpoint(Path("/nonexistent"), cfg, (Shard(name, header),), dict.fromkeys(infos, name))


@contextlib.contextmanager
def _no_cuda_calls():
    """plan_memory resets CUDA's peak statistics for a CUDA device; planning on a machine without one, skip it."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.reset_peak_memory_stats
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.reset_peak_memory_stats = saved


def compute_dtype_name(kind: str, spec: str | None) -> str:
    """The dtype name a pass on device kind `kind` computes in, for --compute-dtype `spec` (None: auto)."""
    import torch

    from ..calib.device import compute_dtype, dtype_name

    return dtype_name(compute_dtype(torch.device("cuda" if kind == "cuda" else "cpu"), spec))


def build_executor(ckpt, device: str, dtype: str | None = None):
    """The LayerExecutor a calibrated pass on `device` ("cpu" or "cuda") builds, over `ckpt` (a checkpoint
    or a virtual one), without touching a device: a CUDA executor is built on the CPU and then pointed at
    "cuda" (only its memory plan is used). `dtype`: its compute dtype (None: the device's default)."""
    import torch

    from ..calib.device import compute_dtype
    from ..calib.executor import LayerExecutor

    dev = torch.device("cuda" if device.startswith("cuda") else "cpu")
    ex = LayerExecutor(ckpt, device="cpu", dtype=compute_dtype(dev, dtype))
    ex.device = dev
    return ex


def memory_plan(ex, recipe, lengths: list[int], available: int | None, ranks: int = 1):
    """`ex.plan_memory` for the pass `recipe` runs on `ranks` ranks (GPTQ/AWQ statistics, else the KV
    observer's), as the calibrated convert and `calibrate` call it. A DeviceMemoryError is turned into
    (plan without a check, the error's message)."""
    from ..calib.layer import statistics_bytes
    from ..errors import DeviceMemoryError

    if recipe.needs_calibrated_pass:
        def stats(i, layer):
            return statistics_bytes(ex.ckpt, recipe, i, layer, ex.device, ex.dtype, ex.call_tokens(lengths), lengths,
                                    ranks)
    else:
        from ..calib.kv_scales import observer_bytes

        def stats(i, layer):
            return observer_bytes(ex, ex.call_tokens(lengths))
    ex.available_bytes = available
    with _no_cuda_calls():
        try:
            return ex.plan_memory(lengths, statistics=stats), None
        except DeviceMemoryError as e:
            # plan it anyway, with the activations in host memory (what the pass would do if it could run)
            ex.available_bytes = 1 << 62  # no check (None would ask the device what is free)
            first = ex.plan_memory(lengths, statistics=stats)
            ex.available_bytes = max(m.without_activations for m in first.layers)
            return ex.plan_memory(lengths, statistics=stats), e.message


def host_ram(c, plan, gq, passes_gq: bool, kind: str, ckpt, num_layers: int, held: dict) -> dict:
    """Host memory of the busiest rank by component (`held`: each layer's packed results it holds)."""
    from ..arch import layer_index

    host = {"process": c.process_bytes}
    # a layer's packed results before the spool write: a rank holds those it solved
    host["layer_results"] = max(held.values(), default=0)
    # the activations in host memory: two copies, each up to the budget kept in RAM (a memory map above it);
    # a rank writes only its own samples' rows of every-sample stores (untouched pages are not resident)
    share = (gq.rank_tokens / max(1, sum(gq.all_batches))) if passes_gq else 1.0
    host["activations"] = 0 if plan.activations == "device" else int(
        2 * min(plan.activation_bytes, _activation_budget()) * share)
    if kind == "cpu":  # the CPU is the device: the layer, its forward, statistics and solves are host memory
        host["layer"] = plan.peak_bytes
    else:
        host["read_buffer"] = max((ckpt.info(n).nbytes for n in ckpt.location
                                   if (i := layer_index(n)) is not None and i < num_layers), default=0)
    return host


def _activation_budget() -> int:
    from ..calib.executor import DEFAULT_ACTIVATION_BUDGET

    return DEFAULT_ACTIVATION_BUDGET

