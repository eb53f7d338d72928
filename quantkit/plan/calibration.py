"""Cost model of the calibrated pass: wall time, device memory and host RAM of GPTQ / AWQ / KV-scale
calibration of a model, from its shapes and a small table of throughput figures, for a world of G ranks.

`calibration_cost(model_or_config, recipe, num_samples, seq_len, CostOptions(world_size=1, device="cpu"))`
answers, before anything is downloaded: how long `convert --recipe R` spends calibrating N samples x T tokens,
where the time goes (per-layer forwards, Hessian accumulation, GPTQ solves, AWQ searches, reading the weights,
writing the spool and the activations, communication between ranks), how much device memory one rank
needs at its peak and how much host RAM. docs/cost.md describes the model and its constants.

This module is the report: the options, the result (`CalibrationCost`) and its assumptions and warnings. The
parts it is made of each have their module: the rates (plan/throughput.py, `THROUGHPUT`: one row per device
kind), the memory (plan/pass_memory.py: the executor's own estimate, run on the meta model built from the
config over a checkpoint that exists only as its enumerated tensor headers; no weights are needed) and the
work per component (plan/pass_work.py).

Time is a sum of counted work divided by rates:
- GEMM-shaped work (FLOPs) at `gemm_flops` scaled down for short matrices: a GEMM of m rows runs at
  gemm_flops * m / (m + gemm_half_rows); the Hessians' Gram products (x^T x, reduced over tokens) at
  `gram_flops` likewise; AWQ's clip search's group errors (batched float32 [m, 32] x [32, 32] products, far
  below a large GEMM's rate) at `block_form_flops`;
- GPTQ's factorizations (the Cholesky factor of the reversed Hessian and its triangular inverse: nominal
  2/3 K^3 per matrix, batched) at `chol_flops` * K / (K + `chol_half_k`); its column sweep as `sweep_col_s` per column step (a dozen small ops: the fixed
  part) plus its in-block updates at `sweep_elems_per_s` (elements updated per second), the lazy block
  updates as GEMM work;
- streaming work (norms, softmax, gathers, conversions, quantize/dequantize) at `mem_bytes_per_s`; every
  small tensor op (one per expert in the batched forward, per expert per chunk in the statistics) costs
  `op_s`; reads, writes and hashing of files at their own rates; MoE inputs, Hessians and weights
  between ranks at `link_bytes_per_s`.
The table (`THROUGHPUT`) holds one row per device kind: "cpu" measured by bench/calib_cost.py (which prints
a new row to paste, and compares the prediction with a real conversion), "cuda" assumed from published
peak figures with stated efficiency factors. Every report says which of its constants are measured and
which assumed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ConfigError
from .bounds import (MAX_CALIBRATION_SAMPLES, MAX_CALIBRATION_TOKENS, MAX_GPU_MEMORY_GIB, MAX_GPUS,
                     check_number)
from .pass_memory import build_executor, compute_dtype_name, host_ram, memory_plan, virtual_checkpoint
from .pass_work import (PassContext, bytes_per_layer, calibrated_bytes, kv_batch_tokens, kv_batches, pass_batches,
                        pass_seconds)
from .throughput import THREAD_SCALED, THROUGHPUT, Throughput, throughput_for

# THROUGHPUT and Throughput are plan/throughput.py's, named here too for the callers of the cost model
__all__ = ["calibration_cost", "CostOptions", "CalibrationCost", "parse_calibration", "THROUGHPUT", "Throughput"]

GIB = 1 << 30


@dataclass(frozen=True)
class CostOptions:
    """Where the calibrated pass runs, for `calibration_cost`: `world_size` ranks of `device` ("cpu" or "cuda").
    `gpu_memory_gib`: the device memory each rank may use (cuda; None: not checked). `throughput`: the rates
    (None: THROUGHPUT[device kind]). `threads`: the threads each rank computes on, for a table that states its
    own (`Throughput.threads`: the cpu's); None: the ranks share the host's threads (the table's threads x its
    ranks) on one host (torchrun gives each worker one thread when it starts several). `compute_dtype`: what the
    layers compute in (options.COMPUTE_DTYPE_CHOICES, as `convert --compute-dtype`; None: "auto", the device's
    default)."""

    world_size: int = 1
    device: str = "cpu"
    gpu_memory_gib: float | None = None
    throughput: Throughput | None = None
    threads: float | None = None
    compute_dtype: str | None = None


def parse_calibration(text: str) -> tuple[int, int]:
    """"N,T" (or "NxT") -> (samples, tokens per sample), each a decimal integer of ASCII digits in
    [1, MAX_CALIBRATION_SAMPLES] and [1, MAX_CALIBRATION_TOKENS] (plan/bounds.py); a ConfigError for anything
    else."""
    shown = repr(str(text)[:40])
    m = re.fullmatch(r"\s*([0-9]{1,12})\s*[,x]\s*([0-9]{1,12})\s*", str(text))
    if m is None:
        raise ConfigError(f"--calibration must be N,T (samples, tokens per sample), got {shown}",
                          hint="e.g. --calibration 128,2048")
    n, t = int(m[1]), int(m[2])
    if not (1 <= n <= MAX_CALIBRATION_SAMPLES and 1 <= t <= MAX_CALIBRATION_TOKENS):
        raise ConfigError(f"--calibration N,T must be 1 <= N <= {MAX_CALIBRATION_SAMPLES} samples and 1 <= T <= "
                          f"{MAX_CALIBRATION_TOKENS} tokens, got {shown}", hint="e.g. --calibration 128,2048")
    return n, t


# ---- the result ------------------------------------------------------------------------------------------
@dataclass
class CalibrationCost:
    """What `calibration_cost` predicts. Seconds are wall seconds of the whole world (the ranks run in
    parallel; a rank's work is its share); bytes are per rank."""

    model: str
    recipe: str
    methods: tuple[str, ...]  # "gptq", "awq", "kv_scales": the passes the recipe runs
    calibrated: bool
    num_samples: int
    seq_len: int
    world_size: int
    device: str
    dtype: str
    layers: int
    calibrated_layers: int
    pool_samples: int = 0  # GPTQ's balance_tokens: top-up samples forwarded after the calibration samples
    seconds: dict[str, float] = field(default_factory=dict)  # by component, summed over layers and passes
    total_seconds: float = 0.0
    convert_output_seconds: float = 0.0  # after the pass: streaming the source and writing the output
    per_layer: list[dict[str, Any]] = field(default_factory=list)
    communication_bytes: dict[str, int] = field(default_factory=dict)  # per rank, summed over layers
    device_memory: dict[str, Any] | None = None  # the executor's plan for one rank (calib/device.py)
    device_memory_bytes: int | None = None  # the plan's peak (the busiest rank's expert Hessians)
    fits: bool | None = None  # the largest layer fits the device memory (None: not checked)
    host_ram_bytes: int | None = None
    host_ram: dict[str, int] = field(default_factory=dict)
    constants: dict[str, Any] = field(default_factory=dict)
    assumptions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The `calibration` object of `quantkit plan --json` (docs/cost.md lists the keys)."""
        return {
            "calibrated": self.calibrated, "recipe": self.recipe, "methods": list(self.methods),
            "num_samples": self.num_samples, "seq_len": self.seq_len, "world_size": self.world_size,
            "pool_samples": self.pool_samples,
            "device": self.device, "dtype": self.dtype, "layers": self.layers,
            "calibrated_layers": self.calibrated_layers,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "total_seconds": round(self.total_seconds, 3),
            "convert_output_seconds": round(self.convert_output_seconds, 3),
            "communication_bytes": dict(self.communication_bytes),
            "device_memory_bytes": self.device_memory_bytes,
            "fits": self.fits,
            "device_memory": self.device_memory,
            "host_ram_bytes": self.host_ram_bytes, "host_ram": dict(self.host_ram),
            "per_layer": self.per_layer,
            "constants": self.constants, "assumptions": list(self.assumptions), "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class _Rates:
    """The rates one rank computes at (`c`) and what they come from."""

    table: Throughput  # the table as given (CostOptions.throughput, or the device kind's row)
    c: Throughput  # its rates for one rank: scaled to the rank's threads, GEMMs at the compute dtype's rate
    per_rank: float | None  # the threads each rank computes on (None: the table is not thread-bound)
    dtype: str  # what the layers compute in
    default: str  # the device's default compute dtype, whose GEMM rate is the table's gemm_flops
    alt_unknown: bool  # `dtype` is not the default and the table has no GEMM rate for it


def _rates(kind: str, opts: CostOptions) -> _Rates:
    """The rates of one of `opts.world_size` ranks of device kind `kind` (CostOptions)."""
    table = opts.throughput or throughput_for(kind)
    if opts.threads is not None:
        check_number("threads per rank", opts.threads, 0, 1 << 20, integer=False, lo_open=True)
    host_threads = table.threads * table.ranks  # the host's, as the table was measured
    per_rank = ((opts.threads if opts.threads is not None else host_threads / opts.world_size) if table.threads
                else None)
    c = table.for_threads(per_rank) if per_rank else table
    # gemm_flops is the default dtype's
    dtype, default = compute_dtype_name(kind, opts.compute_dtype), compute_dtype_name(kind, "auto")
    alt_unknown = dtype != default and not c.alt_gemm_flops
    if dtype != default and c.alt_gemm_flops:
        c = replace(c, gemm_flops=c.alt_gemm_flops)  # every GEMM of the layers' own computation
    return _Rates(table, c, per_rank, dtype, default, alt_unknown)


def _methods(rec) -> tuple[str, ...]:
    """The calibrated passes `rec` runs: "awq", "gptq", "nvfp4_input_scales", "kv_scales"."""
    return tuple(sorted({g.method for g in rec.groups if g.method != "rtn"})) + \
        (("nvfp4_input_scales",) if any(g.scheme.w4a4 for g in rec.groups) else ()) + \
        (("kv_scales",) if rec.kv_cache is not None else ())


def calibration_cost(model_or_config, recipe, num_samples: int, seq_len: int,
                     opts: CostOptions = CostOptions()) -> CalibrationCost:
    """Predict the calibrated pass of `recipe` (a name, path or Recipe) on `num_samples` x `seq_len` tokens
    for `model_or_config` (config.json, checkpoint directory, reference config name), where `opts` says
    (CostOptions: `world_size` ranks of `device`, their memory, rates, threads and compute dtype). A table
    measured as one of G ranks (`ranks` G) predicts a world of G best: other world sizes scale its rates by
    the threads alone, and the result says so. A compute dtype other than the device's default runs the
    forward's GEMMs at the table's rate for that dtype (`alt_gemm_flops`) and its activations take that dtype's
    bytes."""
    from ..match.recipe import Recipe, load_recipe
    from .source import resolve, tensor_shapes_from_checkpoint

    check_number("calibration samples N", num_samples, 1, MAX_CALIBRATION_SAMPLES, integer=True)
    check_number("calibration tokens per sample T", seq_len, 1, MAX_CALIBRATION_TOKENS, integer=True)
    check_number("world size", opts.world_size, 1, MAX_GPUS, integer=True)
    if opts.gpu_memory_gib is not None:
        check_number("gpu_memory_gib", opts.gpu_memory_gib, 0, MAX_GPU_MEMORY_GIB, integer=False, lo_open=True)
    kind = "cuda" if str(opts.device).startswith("cuda") else str(opts.device)
    r = _rates(kind, opts)
    rec = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    src = resolve(model_or_config)
    headers = tensor_shapes_from_checkpoint(src.checkpoint) if src.checkpoint is not None else None
    methods = _methods(rec)
    out = CalibrationCost(model=src.label, recipe=rec.name, methods=methods, calibrated=bool(methods),
                          num_samples=num_samples, seq_len=seq_len, world_size=opts.world_size, device=kind,
                          dtype=r.dtype, layers=0, calibrated_layers=0)
    out.constants = {"kind": r.c.kind, "provenance": r.c.provenance, "source": r.c.source,
                     "values": r.table.to_json(), "threads_per_rank": r.per_rank}
    if not methods:
        out.warnings.append(f"recipe {rec.name!r} has no calibrated group (GPTQ/AWQ) and no kv_cache section: "
                            "convert does not calibrate, nothing to predict")
        return out

    ckpt = virtual_checkpoint(src.config, headers)
    ex = build_executor(ckpt, kind, r.dtype)
    import torch

    from ..arch import parse_config
    from .tensors import quantized_layout

    g = opts.world_size
    lengths = [seq_len] * num_samples
    pool = rec.balance_pool(num_samples)  # GPTQ's balance_tokens: the top-up pool is forwarded too
    gq = pass_batches(ex, [seq_len] * (num_samples + pool), g)  # the GPTQ/AWQ pass: fixed forward batches
    out.pool_samples = pool
    kvb = kv_batches(ex, lengths, g)  # KV calibration: the executor's batches over the ranks
    out.layers = ex.num_layers
    layout = quantized_layout({n: (ckpt.info(n).shape, _code(ckpt.info(n).dtype)) for n in ckpt.location}, rec,
                              spec=parse_config(ckpt.config))
    packed_layer, calibrated_module = calibrated_bytes(layout, rec, ex.num_layers)
    ctx = PassContext(r.c, ex, ckpt, rec, kind, g, torch.empty((), dtype=ex.dtype).element_size(), ex.hidden_size,
                      num_samples, seq_len, gq, pass_batches(ex, lengths, g).all_batches if pool else gq.all_batches)
    t = pass_seconds(ctx, kvb, bytes_per_layer(ckpt, ex.num_layers), packed_layer, pool)
    out.per_layer = t.per_layer
    out.calibrated_layers = t.calibrated_layers
    out.seconds = {k: v for k, v in t.seconds.items() if v}
    out.total_seconds = sum(t.seconds.values())
    out.communication_bytes = {k: int(v) for k, v in t.communication.items()} if g > 1 else {}
    out.convert_output_seconds = _convert_output_seconds(ctx, src, layout, packed_layer, calibrated_module)
    available = int(opts.gpu_memory_gib * GIB) if (opts.gpu_memory_gib and kind == "cuda") else None
    _memory(out, ctx, lengths, available, t.held)
    _notes(out, ctx, r, kvb)
    return out


def _convert_output_seconds(ctx: PassContext, src, layout, packed_layer: dict[int, int],
                            calibrated_module: dict[str, bool]) -> float:
    """After the pass, convert streams the source: every shard read, the packed experts from the spool, the
    output written and hashed (not part of the calibration; the validation measures convert as a whole)."""
    from .tensors import tensor_bytes

    c, ckpt, g = ctx.c, ctx.ckpt, ctx.g
    src_total = sum(ckpt.info(n).nbytes for n in ckpt.location)
    out_total = sum(tensor_bytes(sh, d) for sh, d in layout.values())
    n_shards = len(list(src.checkpoint.glob("*.safetensors"))) if src.checkpoint is not None else \
        max(1, math.ceil(src_total / 5e9))  # hub releases: ~5 GB shards
    packed_total = sum(packed_layer.values())
    return (3 * n_shards + 8) * c.fsync_s + sum(calibrated_module.values()) * c.module_s + \
        (src_total + packed_total) / c.read_bytes_per_s + out_total / c.write_bytes_per_s + \
        out_total / (c.hash_bytes_per_s * g) + (src_total - packed_total) * 2 / c.mem_bytes_per_s


def _memory(out: CalibrationCost, ctx: PassContext, lengths: list[int], available: int | None,
            held: dict[int, int]) -> None:
    """The device memory and host RAM of one rank into `out`: the executor's own plan, as the pass makes it
    (every rank plans every sample's slot), against `available` bytes (None: not checked); `held`, the packed
    result bytes the busiest rank holds per layer."""
    ex, rec = ctx.ex, ctx.rec
    passes_gq = rec.needs_calibrated_pass
    ex.batch_tokens = ctx.gq.batch_tokens if passes_gq else kv_batch_tokens(ex)
    plan, err = memory_plan(ex, rec, lengths, available, ctx.g)
    out.device_memory = plan.to_json()
    out.device_memory_bytes = plan.peak_bytes
    if available is not None:
        out.fits = err is None
    if err:
        out.warnings.append(f"does not fit: {err}")
    host = host_ram(ctx.c, plan, ctx.gq, passes_gq, ctx.kind, ctx.ckpt, ex.num_layers, held)
    out.host_ram = host
    out.host_ram_bytes = sum(host.values())


def _notes(out: CalibrationCost, ctx: PassContext, r: _Rates, kvb: list[int]) -> None:
    """The assumptions and warnings of the prediction into `out`: the model's, the compute dtype's, the table's."""
    c, g, kind = ctx.c, ctx.g, ctx.kind
    passes_gq = ctx.rec.needs_calibrated_pass
    out.assumptions += _assumptions(ctx, kvb, r.per_rank)
    if r.dtype != r.default:
        dtype, default = r.dtype, r.default
        out.assumptions.append(
            f"layers computed in {dtype}: " + (f"no {dtype} GEMM rate in the {kind} table, its {default} "
                                               "rate stands in" if r.alt_unknown else
                                               f"GEMMs at the table's {dtype} rate (alt_gemm_flops); Hessians, "
                                               "solves and searches' float32 work as in the default dtype"))
        if kind == "cpu" and passes_gq:
            out.warnings.append(
                "bfloat16 layers on the CPU with GPTQ/AWQ: on the bench MoE (hidden 512, experts of width 256) "
                "int4-experts-gptq measured 1.15-1.2x float32's time, where this model predicts less (its solves "
                "ran slower in a bfloat16 process and its small expert GEMMs gained nothing; bench/README.md): "
                "bfloat16 pays off on the CPU for forward-bound passes (KV scales)")
    if c.provenance == "assumed":
        out.warnings.append(f"the {kind} throughput figures are assumptions, not measurements ({c.source})")
    if r.table.ranks > 1 and r.table.ranks != g:
        out.warnings.append(f"the {kind} rates were measured as one of {r.table.ranks} ranks sharing the host, for "
                            f"a world of {g} they are scaled by the threads alone (measure with --gpus {g})")


def _code(dtype) -> str:
    from ..read.safetensors import CODE_OF

    return CODE_OF[dtype]


def _assumptions(ctx: PassContext, kvb: list[int], per_rank: float | None = None) -> list[str]:
    c, g, kind, gq = ctx.c, ctx.g, ctx.kind, ctx.gq
    passes_gq, passes_kv = ctx.rec.needs_calibrated_pass, ctx.rec.kv_cache is not None
    a = [f"throughput: {c.kind} figures {c.provenance} ({c.source})"
         + (f"; measured as one of {c.ranks} ranks computing at once, on {c.threads} threads each"
            if c.ranks > 1 else "")
         + (f"; each rank computes on {per_rank:g} of the table's {c.threads} threads: the multi-threaded rates "
            f"({', '.join(THREAD_SCALED)}) scaled by {per_rank:g}/{c.threads}" if per_rank and per_rank != c.threads
            else ""),
         "per layer: GPTQ/AWQ forward twice (statistics, then the quantized layer: true-sequential), GPTQ of the "
         "routed experts alone in two halves (attention up to the experts, then the MLP block); KV scales once",
         "GEMM rate for m rows: gemm_flops x m / (m + gemm_half_rows); routed experts at m = routed rows per "
         "expert and call (balanced routing)"]
    if passes_gq:
        a.append(f"GPTQ/AWQ pass: {len(gq.all_batches)} forward batches of <= {gq.batch_tokens} tokens"
                 + (f", the busiest of {g} ranks forwards {len(gq.rank_batches)} ({gq.rank_tokens} tokens)"
                    if g > 1 else ""))
    if passes_kv:
        a.append(f"KV-scale calibration: the executor's forward batches over the ranks (the busiest forwards "
                 f"{len(kvb)}); per-layer maxima combined (a few floats)")
    if g > 1:
        a += [f"world size {g} (calib/parallel.py): batches data parallel; expert groups owned round-robin, each "
              "owner accumulates its experts' Hessians from every batch's MoE inputs (broadcast) and solves them; "
              "one rank sums the all-token Hessian; dequantized weights broadcast by their owners, each rank writes the "
              f"packed results it solved; AWQ's norm-scale candidates and per-expert searches split over the ranks; link {c.link_bytes_per_s / 1e9:.0f} GB/s per "
              "rank, no overlap with compute"]
    a.append("device memory: the executor's plan (LayerExecutor.plan_memory + calib.layer.statistics_bytes) with "
             "the pass's batches; every rank holds the whole layer, and the Hessians of the experts it owns (the "
             "busiest rank's are planned)")
    a.append("host RAM: process baseline + the layer's packed results + the activations when they are not on the "
             "device (at most the 4 GiB kept in RAM per copy)"
             + (" + the layer, its statistics and solves (the CPU is the device)" if kind == "cpu" else
                " + one source tensor being read"))
    return a
