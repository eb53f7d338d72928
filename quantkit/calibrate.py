"""`quantkit calibrate`: FP8 KV-cache scales (and expert token counts) from calibration data.

Pipeline: open the checkpoint -> tokenize and sample the calibration data (`calib.data`) -> stream the
decoder layers one at a time (`calib.executor`) with a KV-cache observer and an expert-token counter
attached (`calib.observers`) -> scales = amax / 448 per layer -> `CalibrationResult`, written by
`write_scales` as a small safetensors file that `convert --kv-scales` and vLLM-style loaders read:
`model.layers.L.self_attn.k_scale` / `v_scale`, float32, shape [1] (strategy "tensor") or
[num_kv_heads, 1, 1] ("attn_head"; for MLA the "head" count is 1). Names are relative to the text
model; a wrapper's checkpoint carries them under its prefix (`CalibrationResult.checkpoint_scales`).

Memory: one decoder layer's weights (in the compute dtype) plus two copies of the calibration
activations (samples x seq_len x hidden); docs/calibration.md derives the bound. `device` (cpu, cuda,
cuda:N, auto; the default is options.DEVICE, shared with the CLI): on a GPU the layers run there in
bfloat16, and every layer's peak device memory is estimated and checked before any work (calib/device.py).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import __version__, options
from .errors import CalibrationError, KVScalesError
from .calib.data import DEFAULT_SEED, load_calibration_data, load_tokenizer
from .calib.executor import DEFAULT_ACTIVATION_BUDGET, LayerExecutor
from .arch import check_expert_shapes, validate as validate_config
from .read.sources import validate as validate_sources
from .read.kv_scales import read_kv_scales
# the result's types live in calib/kv_scales.py (calib/kv_dist.py builds them too); re-exported here
from .calib.kv_scales import CalibrationResult, LayerKV, kv_result, observer_bytes, peak_rss_bytes  # noqa: F401
from .calib.observers import ExpertTokenCounter, KVCacheObserver
from .write.writer import write_safetensors
from .pack import kv as kvrules

# The one set of defaults the CLI, recipes and library share (quantkit/options.py).
DEFAULT_NUM_SAMPLES: int = options.NUM_SAMPLES
DEFAULT_SEQ_LEN: int = options.SEQ_LEN
DEFAULT_STRATEGY = options.KV_STRATEGY
DEFAULT_DEVICE = options.DEVICE
STRATEGIES = kvrules.STRATEGIES
SCALES_FORMAT = "quantkit-kv-scales"


@dataclass(frozen=True)
class CalibrateOptions:
    """Everything `calibrate` takes besides the checkpoint and its callbacks; the CLI's defaults are these.

    dataset/num_samples/seq_len/seed: the calibration data (quantkit.calib.data formats). strategy: "tensor" or
    "attn_head". device: cpu, cuda, cuda:N or auto (None: the default). dtype: what the layers compute in, a
    torch dtype or auto, float32, bfloat16 (None, auto: float32 on the CPU, bfloat16 on a GPU). batch_tokens:
    tokens per forward call (None: sized to the layer, see `LayerExecutor.auto_batch_tokens`).
    activation_budget_bytes: the activations one call may hold. available_bytes: the device memory the plan may
    use (None: what the GPU reports free)."""

    dataset: str | os.PathLike | None = None
    num_samples: int = DEFAULT_NUM_SAMPLES
    seq_len: int = DEFAULT_SEQ_LEN
    strategy: str = DEFAULT_STRATEGY
    seed: int = DEFAULT_SEED
    dtype: torch.dtype | str | None = None
    device: str | None = DEFAULT_DEVICE
    batch_tokens: int | None = None
    activation_budget_bytes: int = DEFAULT_ACTIVATION_BUDGET
    available_bytes: int | None = None


def calibrate(model_dir: str | os.PathLike, opts: CalibrateOptions = CalibrateOptions(),
              progress: Callable[[int, int], None] | None = None,
              log: Callable[[str], None] | None = None) -> CalibrationResult:
    """Calibrate FP8 KV-cache scales for the checkpoint in `model_dir` (see the module docstring) as `opts` says.
    `progress(layer_idx, num_layers)` is called after each decoder layer; `log(line)` gets the device and its
    memory plan before the first."""
    if opts.strategy not in STRATEGIES:
        raise CalibrationError(f"unknown KV-cache strategy {opts.strategy!r}",
                               hint="use --strategy tensor or attn_head")
    t0 = time.perf_counter()
    ex = LayerExecutor(model_dir, dtype=opts.dtype, device=opts.device, batch_tokens=opts.batch_tokens,
                       activation_budget_bytes=opts.activation_budget_bytes, available_bytes=opts.available_bytes)
    # a compressed-tensors / FP8 source is checked as convert checks it (finite, plausible scales, shapes that
    # agree) before its decoded weights are trusted for calibration (read/sources.py, pack/checks.py)
    logical = validate_sources(ex.ckpt, ex.stored)
    spec = validate_config(ex.ckpt.config, {n: ex.ckpt.info(n).shape for n in ex.ckpt.location})
    if spec is not None:  # packed experts' logical shapes against config.json, as convert holds them
        check_expert_shapes(spec, {m + ".weight": nk for m, nk in logical.items()})
    data = load_calibration_data(opts.dataset, tokenizer=load_tokenizer(model_dir), vocab_size=ex.config.vocab_size,
                                 num_samples=opts.num_samples, seq_len=opts.seq_len, seed=opts.seed)
    lengths = [len(s) for s in data.samples]
    plan = ex.plan_memory(lengths, statistics=lambda i, layer: observer_bytes(ex, ex.call_tokens(lengths)))
    if log is not None:
        log(plan.summary())
    kv, experts = KVCacheObserver(), ExpertTokenCounter()
    final = ex.run(data.samples, [kv, experts], progress=progress)
    final.close()
    ex.measured_peak_bytes()

    return kv_result(model_dir, ex, kv, experts, opts.strategy, data, t0, plan)


def write_scales(result: CalibrationResult, path: str | os.PathLike) -> int:
    """Write `result.scales` as safetensors to `path` (via a temporary file, then renamed); sets
    `result.output` and returns the bytes written. The metadata records the scheme and the data used."""
    path = Path(path)
    for name, t in result.scales.items():  # pack/kv.py's rules, plausible range included: nothing else is written
        problem = kvrules.tensor_problem(name, t)
        if problem:
            raise KVScalesError(f"calibration gave {problem}", hint="the model's activations are implausible on "
                                "this data (check its weights); the scales were not written")
    meta = {"format": SCALES_FORMAT, "strategy": result.strategy, "kv_cache_scheme": json.dumps(result.kv_cache_scheme),
            "model_type": result.model_type, "attention": result.attention, "quantkit_version": __version__,
            "data": json.dumps(result.data, sort_keys=True)}
    if result.prefix:  # the names in the file are relative to the text model; a checkpoint adds this prefix
        meta["prefix"] = result.prefix
    tmp = path.with_name(f".{path.name}.tmp")
    n = write_safetensors(tmp, result.scales, metadata=meta)
    os.replace(tmp, path)
    result.output = str(path)
    return n


def read_scales(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read and validate a KV-scales file (pack/kv.py's rules): only `model.layers.L.self_attn.{k,v}_scale`,
    float32, shape [1] or [H, 1, 1], finite and positive, both K and V for every layer, one shape throughout."""
    scales = read_kv_scales(path)
    layers = {int(kvrules.KV_SCALE.match(n)[1]) for n in scales}
    shape = next(iter(scales.values())).shape
    kvrules.validate(scales, num_layers=max(layers) + 1, attn_layers=layers, kv_heads=shape[0], mla=False)
    return scales


def scales_strategy(scales: dict[str, torch.Tensor]) -> str:
    """"tensor" or "attn_head", from the shapes of validated scales (`read_scales`)."""
    return kvrules.strategy_of(tuple(next(iter(scales.values())).shape))
