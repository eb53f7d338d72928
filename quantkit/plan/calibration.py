"""Cost model of the calibrated pass: wall time, device memory and host RAM of GPTQ / AWQ / KV-scale
calibration of a model, from its shapes and a small table of throughput figures, for a world of G ranks.

`calibration_cost(model_or_config, recipe, num_samples, seq_len, world_size=1, device="cpu")` answers,
before anything is downloaded: how long `convert --recipe R` spends calibrating N samples x T tokens, where
the time goes (per-layer forwards, Hessian accumulation, GPTQ solves, AWQ searches, reading the weights,
writing the spool and the activations, communication between ranks), how much device memory one rank
needs at its peak and how much host RAM. docs/cost.md describes the model and its constants.

Memory is not re-derived here: the executor's own estimate (`LayerExecutor.plan_memory` with
`calib.layer.statistics_bytes`, calib/device.py) is run on the meta model built from the config, over a
checkpoint that exists only as its enumerated tensor headers (plan/tensors.py): no weights are needed.

Time is a sum of counted work divided by rates:
- GEMM-shaped work (FLOPs) at `gemm_flops` scaled down for short matrices: a GEMM of m rows runs at
  gemm_flops * m / (m + gemm_half_rows); the Hessians' Gram products (x^T x, reduced over tokens) at
  `gram_flops` likewise; AWQ's clip search's group errors (batched float32 [m, 32] x [32, 32] products, far
  below a large GEMM's rate) at `block_form_flops`;
- GPTQ's factorizations (the Cholesky factor of the reversed Hessian and its triangular inverse: nominal
  2/3 K^3 per matrix, batched) at `chol_flops`; its column sweep as `sweep_col_s` per column step (a dozen small ops: the fixed
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

import contextlib
import heapq
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from ..arch.layout import ATTN, EXPERTS, ROUTER_MODULES
from ..errors import ConfigError
from ..match.recipe import affinity_experts
from .bounds import (MAX_CALIBRATION_SAMPLES, MAX_CALIBRATION_TOKENS, MAX_GPU_MEMORY_GIB, MAX_GPUS,
                     check_number)

GIB = 1 << 30


# ---- the constants ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Throughput:
    """Rates of one device kind. Units: FLOP/s, bytes/s, seconds, elements/s; `*_half_rows`: rows."""

    kind: str  # "cpu" | "cuda"
    provenance: str  # "measured" | "assumed"
    source: str  # where the figures come from: the machine and date, or the published figures and factors
    gemm_flops: float  # large GEMM in the device's default compute dtype (cpu: float32, cuda: bfloat16)
    gemm_half_rows: float  # rows m at which a GEMM [m, k] x [k, n] reaches half of gemm_flops
    gram_flops: float  # x^T x over tokens in float32 (Hessian accumulation), large
    gram_half_rows: float
    block_form_flops: float  # AWQ's clip search group errors: float32 [m, 32] x [32, 32] products, batched
    chol_flops: float  # batched Cholesky + triangular inverse, nominal 2/3 K^3 per matrix, solve dtype
    sweep_col_s: float  # fixed seconds per column step of GPTQ's sweep (per chunk of experts)
    sweep_elems_per_s: float  # in-block error-feedback updates, elements per second
    mem_bytes_per_s: float  # streaming element-wise work (read + write bytes)
    op_s: float  # one small tensor op: Python dispatch (cpu) or a kernel launch (cuda)
    read_bytes_per_s: float  # checkpoint reads (safetensors, positioned reads)
    write_bytes_per_s: float  # spool, activations and output shards, fsynced
    fsync_s: float  # a small file written and fsynced (spool records, progress, journal, manifest)
    module_s: float  # per quantized module: packing, metadata, its tensors recorded and written (beyond bytes)
    fake_quant_elems_per_s: float  # quant.awq.fake_quant (RTN quantize-dequantize, group 32), elements per second
    hash_bytes_per_s: float  # sha256 of written shards
    link_bytes_per_s: float  # between two ranks, each direction (cpu: gloo on one host; cuda: NVLink)
    process_bytes: int  # host RSS of a process once torch, transformers and quantkit are imported
    setup_s: float  # fixed: building the meta model, embedding, opening the checkpoint
    layer_s: float  # fixed per layer and pass: materializing, freeing (gc, malloc_trim), hooks
    threads: int = 0  # cpu: the threads the rates were measured with (the host's cores); 0: not thread-bound
    # cpu: the processes that computed at once on the host while the rates were measured, each on `threads`
    # (`plan --measure --gpus G`: this one and G - 1 neighbours); the host's threads are threads x ranks
    ranks: int = 1
    # large GEMM in the device's other compute dtype (--compute-dtype; cpu: bfloat16, cuda: float32), at the
    # same half rows; 0: not known (the default dtype's rate stands in, and the plan says so)
    alt_gemm_flops: float = 0.0
    startup_s: float = 0.0  # once per job: a fresh process's first executor (modeling imports, first use)
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    def for_threads(self, threads: float) -> "Throughput":
        """The rates of a process computing on `threads` of the table's threads: the multi-threaded rates
        (THREAD_SCALED) times threads / self.threads; dispatch, I/O and fixed costs unchanged. A table
        without a thread count (threads 0: a GPU's) is returned as it is."""
        if not self.threads or threads == self.threads:
            return self
        f = float(threads) / self.threads
        return replace(self, **{k: getattr(self, k) * f for k in THREAD_SCALED})

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "Throughput":
        names = {f.name for f in fields(cls)}
        missing = names - set(doc) - {"notes", "threads", "ranks", "startup_s", "alt_gemm_flops"}
        if missing:
            raise ConfigError(f"throughput table lacks {sorted(missing)}")
        kw = {k: v for k, v in doc.items() if k in names}
        kw["notes"] = tuple(kw.get("notes") or ())
        return cls(**kw)


# Measured by `python bench/calib_cost.py` (it prints this row to paste here). This one: a 2-vCPU Intel Xeon
# (Sapphire Rapids) VM, wall seconds, both threads (docs/cost.md has its check). The row before it (an AMD EPYC
# VM, 2026-12-03) predicted +18% / +36% / +16% for GPTQ / AWQ / KV scales on this VM.
CPU_MEASURED = Throughput(
    kind="cpu", provenance="measured",
    source="bench/calib_cost.py, Intel Xeon (Sapphire Rapids) VM, 2 CPUs, torch 2.13.0+cpu, 2 threads, 2026-12-06, "
           "wall seconds (load average 1.1 at the start; tree f349231: GEMMs in nn.Linear's layout, held-out check)",
    gemm_flops=3.281e+11, gemm_half_rows=42.17, gram_flops=3.194e+11, gram_half_rows=1.778,
    block_form_flops=1.197e+11, chol_flops=3.037e+10, sweep_col_s=3.275e-05, sweep_elems_per_s=3.98e+09,
    mem_bytes_per_s=3.203e+10, op_s=1.156e-06, read_bytes_per_s=6.187e+09, write_bytes_per_s=1.191e+09,
    fsync_s=0.0001286, module_s=0.001077, fake_quant_elems_per_s=1.178e+09, hash_bytes_per_s=1.372e+09,
    link_bytes_per_s=1.0e9, process_bytes=912769024, setup_s=0.06704, layer_s=5.177e-05, threads=2,
    startup_s=2.281, alt_gemm_flops=1.342e+12,
    notes=("link_bytes_per_s: assumed (gloo over loopback on one host), not measured",
           "alt_gemm_flops (bfloat16 GEMMs, --compute-dtype bfloat16): measured on this VM (AMX); a CPU without "
           "bfloat16 instructions runs them slower than float32: measure it (--measure)",
           "startup_s: measured by bench/calib_cost.py's measure_startup in the same run (fastest of three fresh "
           "processes)"),
)

# Assumed: one NVIDIA H100/H200 SXM GPU. Published dense peaks (NVIDIA H100/H200 SXM datasheets, without
# sparsity): bf16 tensor cores 989 TFLOP/s, fp32 (no TF32) 67 TFLOP/s; HBM3 3.35 TB/s (H100) / HBM3e
# 4.8 TB/s (H200); NVLink 4: 900 GB/s per GPU both directions together.
CUDA_ASSUMED = Throughput(
    kind="cuda", provenance="assumed",
    source="assumed from NVIDIA H100/H200 SXM published peaks x stated efficiency factors (not measured)",
    gemm_flops=0.5 * 989e12,  # bf16 dense peak x 0.5: the executor's GEMMs are separate eager matmuls
    gemm_half_rows=256.0,  # a [m, 7168] x [7168, 4096] bf16 GEMM is launch/memory bound below a few hundred rows
    alt_gemm_flops=0.7 * 67e12,  # float32 layers (--compute-dtype float32): fp32 peak x 0.7, as the Grams
    gram_flops=0.7 * 67e12,  # Hessians are float32 bmm (TF32 off, torch's default for matmul): fp32 peak x 0.7
    gram_half_rows=256.0,
    block_form_flops=0.1 * 67e12,  # AWQ's batched [m, 32] x [32, 32] float32 products: far from peak, x 0.1
    chol_flops=0.15 * 67e12,  # batched float32 potrf/potri: far from peak (cuSOLVER per matrix), x 0.15
    sweep_col_s=15 * 10e-6,  # ~15 kernel launches of ~10 us per column step, whatever the chunk
    sweep_elems_per_s=0.4 * 4.8e12 / 12,  # in-block update reads/writes ~12 bytes per element at 0.4 x HBM
    mem_bytes_per_s=0.5 * 4.8e12,  # H200 HBM3e x 0.5 for eager element-wise kernels
    op_s=10e-6,  # one kernel launch plus Python dispatch
    read_bytes_per_s=5e9,  # one node's local NVMe (or a parallel filesystem), shared by the node's ranks
    write_bytes_per_s=2e9,
    fsync_s=0.005,  # a local NVMe's flush
    module_s=0.003,  # per module on the host: packing, metadata, recording (as the CPU's)
    fake_quant_elems_per_s=0.5 * 4.8e12 / 240,  # ~15 element-wise kernels (~240 bytes per element) at 0.5 x HBM
    hash_bytes_per_s=1.5e9,  # sha256 on one host core
    link_bytes_per_s=0.7 * 450e9,  # NVLink 4, 450 GB/s each direction x 0.7 (NCCL all-to-all / all-gather bus)
    process_bytes=3_000_000_000,  # torch + transformers + the CUDA context's host side
    setup_s=30.0,  # building the meta model of a 1T model, opening ~1000 shards' headers, embedding
    layer_s=1.0,  # per layer and pass: allocating, freeing and synchronizing the device
    startup_s=10.0,  # the CPU's modeling imports (~2.6 s) plus creating the CUDA context and its first kernels
    notes=("every figure assumed: published H100/H200 peaks times the efficiency factors in "
           "quantkit/plan/calibration.py; measure on a GPU with bench/calib_cost.py --device cuda to replace them",),
)

THROUGHPUT: dict[str, Throughput] = {"cpu": CPU_MEASURED, "cuda": CUDA_ASSUMED}

# The rates that grow with a process's threads (torch's intra-op parallelism over the host's cores); on a CPU
# host, ranks share the table's threads (docs/cost.md, "Threads per rank": how it was checked).
THREAD_SCALED = ("gemm_flops", "gram_flops", "block_form_flops", "chol_flops", "sweep_elems_per_s",
                 "mem_bytes_per_s", "fake_quant_elems_per_s", "alt_gemm_flops")
DEVICE_KINDS = tuple(THROUGHPUT)


def throughput_for(device: str, table: Mapping[str, Throughput] | None = None) -> Throughput:
    kind = "cuda" if str(device).startswith("cuda") else str(device)
    t = (table or THROUGHPUT).get(kind)
    if t is None:
        raise ConfigError(f"no throughput figures for device {device!r}", hint=f"choose one of {', '.join(DEVICE_KINDS)}")
    return t


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


COMPONENTS = ("forward", "hessians", "gptq_solve", "awq_search", "input_amax", "kv_observe", "read_weights",
              "write_spool", "communication", "fixed")


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


def _compute_dtype(kind: str, spec: str | None) -> str:
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


# ---- shapes of a layer -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _LayerShape:
    dense_params: int  # Linear weights every token passes through (attention, dense MLP, shared experts, router)
    attn_params: int  # of which in the attention module
    experts: int
    p: int  # gate+up rows (2I)
    h: int
    i: int
    top_k: int
    heads: int
    qk_dim: int
    v_dim: int
    indexer: int  # index_n_heads * index_head_dim of a DSA indexer layer (0: none)
    src_bytes: int  # the layer's bytes on disk
    elements: int  # the layer's parameters
    tensors: int  # tensors read
    expert_src_bytes: int


def _layer_shape(ex, idx: int, layer, src_bytes: int, n_tensors: int, expert_bytes: int) -> _LayerShape:
    from torch import nn

    from ..calib import moe

    cfg = ex.config
    experts = next((m for m in layer.modules() if moe.is_routed_experts(m)), None)
    dense = attn = 0
    for name, m in layer.named_modules():
        if isinstance(m, nn.Linear):
            dense += m.in_features * m.out_features
            if name.startswith(f"{ATTN}."):
                attn += m.in_features * m.out_features
        elif name.endswith(ROUTER_MODULES) and getattr(m, "weight", None) is not None:
            dense += m.weight.numel()  # routers that are not nn.Linear
    e = p = h = i = k = 0
    if experts is not None:
        e, p, h = (int(d) for d in experts.gate_up_proj.shape)
        i = int(experts.down_proj.shape[-1])
        k = int(getattr(cfg, "num_experts_per_tok", None) or 8)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    if getattr(cfg, "kv_lora_rank", None):
        qk = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
        v = int(cfg.v_head_dim)
    else:
        qk = v = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    indexer = 0
    if getattr(cfg, "index_topk", None) and any("indexer" in n for n, _ in layer.named_modules()):
        indexer = int(getattr(cfg, "index_n_heads", 1) or 1) * int(getattr(cfg, "index_head_dim", 128) or 128)
    elements = sum(t.numel() for t in layer.state_dict().values())
    return _LayerShape(dense, attn, e, p, h, i, k, heads, qk, v, indexer, src_bytes, elements, n_tensors,
                       expert_bytes)


def _rate(peak: float, half: float, rows: float) -> float:
    rows = max(1.0, rows)
    return peak * rows / (rows + half)


# ---- the work of one layer ---------------------------------------------------------------------------------
def _forward(c: Throughput, s: _LayerShape, batches: list[int], t: int, item: int, hidden: int,
             part: str = "whole") -> float:
    """One forward of a layer over `batches` (the tokens of each forward call; samples of t tokens). `part`:
    "whole"; "to_experts", the first half of a split forward (attention and the router, up to the routed
    experts' call); "block", the second (the MLP block: router, routed and shared experts), as the GPTQ pass
    of the routed experts runs them (calib/executor.py forward_to / forward_from)."""
    from ..calib.executor import LIVE_TEMPORARIES

    attn_part, block_part = part != "block", part != "to_experts"
    router = s.experts * s.h
    if part == "whole":
        params = s.dense_params
    elif part == "to_experts":
        params = s.attn_params + router
    else:
        params = s.dense_params - s.attn_params
    live = {"whole": LIVE_TEMPORARIES, "to_experts": 10, "block": 6}[part]
    sec = 0.0
    for per_call in batches:
        n = max(1, per_call // t)  # samples in the call
        sec += 2 * per_call * params / _rate(c.gemm_flops, c.gemm_half_rows, per_call)
        stream = 2 * live * per_call * hidden * item
        ops = 0
        if attn_part:
            sec += 2 * n * s.heads * t * t * (s.qk_dim + s.v_dim) / _rate(c.gemm_flops, c.gemm_half_rows, t)
            if s.indexer:
                sec += 2 * n * t * t * s.indexer / _rate(c.gemm_flops, c.gemm_half_rows, t)
            # element-wise: the [B, heads, T, T] scores (scale, mask, softmax in float32: ~6 passes), the mask
            stream += 6 * n * s.heads * t * t * max(item, 4) + n * t * t * item
            ops += 100  # norms, projections, rotary, attention, residual, routing
        if block_part:
            ops += 50
            if s.experts:
                rows = per_call * s.top_k / s.experts  # routed rows per expert and call
                sec += 2 * per_call * s.top_k * (s.p * s.h + s.h * s.i) / _rate(c.gemm_flops, c.gemm_half_rows, rows)
                # gather, activation, routing weights, index_add of every routed row; router softmax/top-k; sorting
                stream += per_call * s.top_k * (3 * s.h + 3 * s.p) * item + per_call * s.experts * 4 * 4
                ops += 4 * s.experts  # the batched expert forward: two GEMMs, an index_add_ and bookkeeping per expert
        sec += stream / c.mem_bytes_per_s + ops * c.op_s
    return sec


def _hessians(c: Throughput, s: _LayerShape, batches: list[int], owned: int, hidden: int,
              per_token: int | None = None) -> float:
    """GPTQ statistics of one layer, by the rank that owns `owned` of its experts: the all-token x x^T (one
    rank sums it over every batch), and for each owned expert and batch the Gram of the rows routed to it,
    the down inputs of those rows (one gate/up product) and their Gram, added to the expert's sums.
    `per_token`: the experts each token's row goes to in the statistics (None: the router's top-k;
    `stats: affinity`: affinity_top_k, or every expert), plus the router's scoring of every token."""
    h, e = s.h or hidden, s.experts
    k = s.top_k if per_token is None else min(per_token, e)
    sec = 0.0
    for per_call in batches:
        sec += 2 * per_call * h * h / _rate(c.gram_flops, c.gram_half_rows, per_call)
        if not e or not owned:
            continue
        if per_token is not None:
            sec += 2 * per_call * h * e / _rate(c.gemm_flops, c.gemm_half_rows, per_call)
        rows = per_call * k / e  # per expert and batch (balanced routing)
        routed = rows * owned
        sec += 2 * routed * (h * h + s.i * s.i) / _rate(c.gram_flops, c.gram_half_rows, rows)
        sec += 2 * routed * h * s.p / _rate(c.gemm_flops, c.gemm_half_rows, rows)
        stream = routed * (2 * h + s.p + 2 * s.i) * 4 + owned * (h * h + s.i * s.i) * 4 * 3  # gathers, sums
        sec += stream / c.mem_bytes_per_s + owned * 12 * c.op_s
    return sec


def _fit_unquantized(c: Throughput, s: _LayerShape, batches: list[int], owned: int, hidden: int,
                     per_token: int | None = None, down_only: bool = False) -> tuple[float, float]:
    """(statistics seconds, solve seconds) GPTQ's fit_unquantized adds to one layer (its reference stream's
    forward is counted with the forwards): per owned expert and batch the cross-Gram of its rows with the
    unquantized model's (one more h x h Gram), then after the gate/up solves the down inputs of both streams
    (one more gate/up product than the statistics forward computes) and two i x i Grams; per matrix the
    fitted target: W (A - H) and two products with the solve's own inverse factor (~3 n_out k^2
    multiply-adds, float32; quant/gptq.py `fit`). `down_only` (fit_down): no reference stream, no gate/up
    cross-Gram, down_proj's target only."""
    h, e = s.h or hidden, s.experts
    if not e or not owned:
        return 0.0, 0.0
    k = s.top_k if per_token is None else min(per_token, e)
    stats = 0.0
    for per_call in batches:
        rows = per_call * k / e
        routed = rows * owned
        stats += 2 * routed * ((0 if down_only else h * h) + s.i * s.i) / _rate(c.gram_flops, c.gram_half_rows,
                                                                                 rows)
        stats += 2 * routed * h * s.p / _rate(c.gemm_flops, c.gemm_half_rows, rows)
        stats += routed * ((1 if down_only else 2) * h + s.p) * 4 / c.mem_bytes_per_s
    solve = sum(owned * 6 * n_out * kk * kk / _rate(c.gram_flops, c.gram_half_rows, n_out)
                for n_out, kk in ((s.p, h), (h, s.i))[1 if down_only else 0:])
    return stats, solve


# Coordinate descent after GPTQ (refine_sweeps) on the CPU: the multiply-adds of moved codes per code
# visited, as a fraction of k. Measured on the bench MoE's solve batches ([512, 512] and [512, 256]
# matrices, two sweeps after the refit): 2.1-2.9% of the codes move in the first sweep, 1.2-1.6% in the
# second, each updating the row's gradient over k columns (the last sweep: those still ahead).
REFINE_MOVED = 0.015


def _gptq_solves(c: Throughput, shapes: list[tuple[int, int, int, int]], block: int,
                 refit: bool = False, refine: int = 0) -> tuple[float, float]:
    """(Cholesky seconds, sweep seconds) of GPTQ on matrices [(count, n_out, k_in, chunk)]: `count` of them,
    `chunk` in one column sweep. `refit` (options.refit_scales): each matrix's scales refitted after the
    sweep, ~3 n_out k^2 flops in float32 (A's upper triangle from the codes and the Hessian, n_out k^2, and
    Hd w, 2 n_out k^2), counted as lazy-update GEMMs.
    `refine` (options.refine_sweeps): that many coordinate-descent sweeps after the solve (and the refit),
    plus the starting gradient (one n_out k^2 product); on a GPU each sweep is a column sweep like GPTQ's
    whose block updates reach every column (n_out k^2 flops), on the CPU the compiled row loop visits every
    code and pays k multiply-adds for each that moves (REFINE_MOVED)."""
    chol = sweep = 0.0
    for count, n_out, k, per in shapes:
        if not count:
            continue
        per = max(1, min(count, per))
        chunks = math.ceil(count / per)
        chol += count * (2 / 3) * k ** 3 / c.chol_flops
        b = min(block, k)
        sweep += chunks * k * c.sweep_col_s
        sweep += count * n_out * k * (b / 2 + 4) / c.sweep_elems_per_s
        # the lazy block updates: float32 bmm in the solve, at the float32 (Gram) rate
        sweep += count * n_out * k * max(0, k - b) / _rate(c.gram_flops, c.gram_half_rows, n_out)
        # act-order permutations, dequantize, SQNR, packing and emitting every module
        sweep += count * (6 * k * k * 8 + 24 * n_out * k) / c.mem_bytes_per_s + count * 40 * c.op_s
        sweep += count * c.module_s  # emitting it (gate/up: two modules, counted at the call)
        if refit:
            sweep += count * 3 * n_out * k * k / _rate(c.gram_flops, c.gram_half_rows, n_out)
        if refine:
            gemm = count * n_out * k * k / _rate(c.gram_flops, c.gram_half_rows, n_out)
            if c.kind == "cpu":  # the compiled row loop: every code visited, K multiply-adds per moved code
                sweep += refine * count * n_out * k * (1 + REFINE_MOVED * k) / c.sweep_elems_per_s + gemm
            else:
                sweep += refine * (chunks * k * c.sweep_col_s + count * n_out * k * (b / 2 + 4) / c.sweep_elems_per_s
                                   + gemm) + gemm
    return chol, sweep


def _heldout_check(c: Throughput, s: _LayerShape, tokens: int, owned: int, holdout: int, fit: tuple[bool, bool]):
    """GPTQ's held-out check (calib/gptq_pass._heldout_check) of the `owned` experts of the busiest rank, after
    their solves: every `holdout`-th row routed to an expert (of `tokens` calibration tokens, balanced routing)
    was kept out of its Hessians; per expert and matrix one product of those rows with W, W - D (GPTQ's) and
    W - D (RTN's, computed for the matrix), the squares of each part summed in float64. `fit` (gate/up, down):
    the matrix is checked against the unquantized model's outputs, one more product. Retries (an INT4 expert
    that RTN beats is solved again at higher damping, calib/gptq_pass.RETRY_DAMPING) depend on the data and
    are not counted."""
    rows = tokens * s.top_k / s.experts / holdout
    sec = 0.0
    for (n_out, k), ref in zip(((s.p, s.h), (s.h, s.i)), fit):
        flops = 2 * rows * k * n_out * (3 + int(ref))
        sec += owned * flops / _rate(c.gram_flops, c.gram_half_rows, rows)  # float32 whatever the layers' dtype
        # RTN's codes and both dequantizations, the three candidates side by side, then per part the product's
        # columns in float64, squared and summed
        stream = (8 * n_out * k * 4 + 6 * n_out * k * 4 + rows * 3 * n_out * (4 + 3 * 8)) * owned
        sec += stream / c.mem_bytes_per_s + owned * 30 * c.op_s
    return sec


def awq_candidates(n_grid: int, stride: int) -> tuple[int, int]:
    """Candidates of AWQ's scale searches per round (quant.awq.grid_coarse, grid_refine): s = 1 and every
    stride-th grid point, then up to 2 (stride - 1) neighbours of the best (fewer at the grid's ends)."""
    from ..quant.awq import grid_coarse  # torch is imported only where the plan needs it

    coarse = len(grid_coarse(n_grid, stride))
    return coarse, min(2 * (stride - 1), n_grid + 1 - coarse)


def _awq_search_parts(c: Throughput, s: _LayerShape, s_tok: int, n_grid: int, stride: int, clip: bool,
                      down: bool, experts: int, g_gu: int, g_dn: int) -> dict[str, float]:
    """AWQ's searches for one MoE layer (calib/awq_pass.py), seconds per part: `norm`, the norm scale
    (`awq_candidates` on 512 strided sampled tokens, 3 finalists on all of them: each a fake-quantized copy
    of every expert's gate/up and a forward of the MoE block); `down`, the per-expert up -> down scale (the
    down inputs, their weighted Gram, then per candidate a fake-quant of down and a quadratic form,
    H x I x I, per expert); `clip`, the clip search (the inputs' Gram; per ratio a fake-quant and the group
    errors, float32 [rows, g] x [g, g] products; the row test, a fake-quant and one [rows, K] x [K, K]
    product per matrix); `choice`, the four clip combinations on <= 512 rows; `rtn`, RTN with the found
    parameters, SQNR, packing."""
    e, h, p, i, k = s.experts, s.h, s.p, s.i, s.top_k
    cands = sum(awq_candidates(n_grid, stride))
    fq = c.fake_quant_elems_per_s
    mem = c.mem_bytes_per_s
    parts = dict.fromkeys(("norm", "down", "clip", "choice", "rtn"), 0.0)
    # (1) norm scale: every expert's gate/up scaled, fake-quantized and copied in per candidate, block forwards
    sub = min(512, s_tok)
    sec = (cands + 3) * e * p * h * (1 / fq + 12 / mem)
    block_tokens = cands * sub + 3 * s_tok
    block_rows = max(1.0, sub * k / e)
    sec += 2 * block_tokens * (k * (p * h + h * i) + s.dense_params) / _rate(c.gemm_flops, c.gemm_half_rows,
                                                                               block_rows)
    sec += block_tokens * k * (3 * h + 3 * p) * 4 / mem + (cands + 3) * (4 * e + 150) * c.op_s
    parts["norm"] = sec
    # the routed rows of the sampled tokens per expert (experts searched on their own rows)
    rows = s_tok * k / max(1, e)
    # (2) up -> down: down inputs, their weighted Gram, then per candidate a fake-quant of down and H x I x I
    sec = experts * 2 * rows * (h * p + i * i) / _rate(c.gemm_flops, c.gemm_half_rows, rows)
    if down:
        sec += experts * cands * (2 * h * i * i / _rate(c.gemm_flops, c.gemm_half_rows, h) + h * i / fq
                                  + h * i * 4 * 8 / mem)
    parts["down"] = sec
    if clip:
        sec = 0.0
        nratio = 12  # clip_ratios(4 bits, n_grid 20, max_shrink 0.5) and r = 1
        for n_out, kk, g in ((p, h, g_gu), (h, i, g_dn)):
            # the inputs' Gram (float32) and its diagonal blocks
            sec += experts * (2 * rows * kk * kk / _rate(c.gram_flops, c.gram_half_rows, rows)
                              + kk * kk * 8 / mem)
            # per ratio: a fake-quant, the error, the group errors, the running best
            sec += experts * nratio * (n_out * kk / fq + n_out * kk * 12 / mem
                                       + 2 * n_out * kk * g / c.block_form_flops + 8 * c.op_s)
            # the row test: a fake-quant with the chosen ratios, one float32 [rows, K] x [K, K] product
            sec += experts * (n_out * kk / fq + n_out * kk * 24 / mem
                              + 2 * n_out * kk * kk / _rate(c.gemm_flops, c.gemm_half_rows, n_out))
        parts["clip"] = sec
        crow = min(rows, 512)
        parts["choice"] = (experts * crow * (2 * 2 * h * p + 4 * 2 * i * h) / _rate(c.gemm_flops, c.gemm_half_rows, crow)
                           + experts * (p * h + h * i) * 2 / fq)
    # RTN with the found parameters, SQNR, packing and emitting
    parts["rtn"] = (experts * (p * h + h * i) * (1 / fq + 24 / mem) + experts * 60 * c.op_s
                    + experts * 3 * c.module_s)
    return parts



# ---- how the pass cuts its work ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Batches:
    batch_tokens: int  # tokens per forward call of the pass
    all_batches: list[int]  # tokens of every forward batch
    rank_batches: list[int]  # the busiest rank's batches
    rank_tokens: int  # the busiest rank's tokens


def _pass_batches(ex, lengths: list[int], g: int, capped: bool = True) -> _Batches:
    """A pass's forward batches (calib/activations.batch_plan; GPTQ/AWQ, `capped`: the executor's batch size
    capped so that the samples make at least a few batches, calib/spool.py; KV scales: the executor's) and
    the busiest rank's share of them (calib/parallel.py: the heaviest batch first, each to the least loaded
    rank)."""
    from ..calib import spool

    bt = ex.batch_tokens
    cap = getattr(spool, "pass_batch_tokens", None)
    if capped and cap is not None:
        bt = cap(bt, lengths)
    tokens = [sum(lengths[i] for i in b) for b in _batch_plan(lengths, bt)]
    load = [0] * g
    mine: list[list[int]] = [[] for _ in range(g)]
    least = [(0, r) for r in range(g)]  # (load, rank), a heap: its head is the least loaded, lowest rank
    for b in sorted(range(len(tokens)), key=lambda b: (-tokens[b], b)):
        _, r = heapq.heappop(least)
        load[r] += tokens[b]
        mine[r].append(tokens[b])
        heapq.heappush(least, (load[r], r))
    busiest = max(range(g), key=lambda r: (load[r], -r))
    return _Batches(bt, tokens, mine[busiest], load[busiest])


def _batch_plan(lengths: list[int], bt: int) -> list[list[int]]:
    try:
        from ..calib.activations import batch_plan
    except ImportError:  # the executor's own grouping: max(1, bt // T) samples of equal length per call
        def batch_plan(lengths, bt):
            per = max(1, bt // max(1, max(lengths)))
            return [list(range(i, min(len(lengths), i + per))) for i in range(0, len(lengths), per)]
    return batch_plan(lengths, bt)


def _kv_batch_tokens(ex) -> int:
    return ex.auto_batch_tokens()


def _kv_batches(ex, lengths: list[int], g: int) -> list[int]:
    """KV-scale calibration (quantkit.calibrate; calib/kv_dist.py over ranks): the executor's own batches,
    the busiest rank's share."""
    return _pass_batches(ex, lengths, g, capped=False).rank_batches


def _sweep_experts(k: int, n: int, group: int, kind: str) -> int:
    """Experts one column sweep covers (calib/gptq_pass.py sweep_experts)."""
    import torch

    from ..calib.gptq_pass import sweep_experts

    return int(sweep_experts(k, n, group, torch.device("cuda" if kind == "cuda" else "cpu")))


def _expert_group(s: _LayerShape, kind: str) -> int:
    """Experts solved at once, and the unit of expert ownership (calib/gptq_pass.py)."""
    import torch

    from ..calib import gptq_pass

    dev = torch.device("cuda" if kind == "cuda" else "cpu")
    fn = getattr(gptq_pass, "expert_group_size", None)
    if fn is not None:
        return int(fn(s.experts, s.h, s.i, dev))
    return min(gptq_pass.chunk_experts(s.h, dev), gptq_pass.chunk_experts(s.i, dev))


def _communication(s: _LayerShape, egroup, dense, gq: _Batches, g: int, item: int, hidden: int,
                   owned: int, s_tok: int) -> dict[str, float]:
    """Bytes one rank receives for one layer in a world of g ranks (calib/parallel.py): every batch's MoE
    inputs (float32 rows, routing indices and weights) broadcast by the rank that forwarded it (AWQ: the
    sampled rows and the block's outputs for them); dense targets' partial Hessians sent to their owners;
    the dequantized weights broadcast by their owners (GPTQ's routed experts on an INT4 grid: their codes,
    one byte each, and float32 scales and zero points per group instead; AWQ: the routed experts' from the
    ranks that searched and quantized them, the rest of the layer from rank 0, and the per-expert search
    results from the ranks that ran them). The packed results do not
    travel: each rank writes what it solved to the spool. GPTQ's fit_unquantized: every batch's unquantized-model MoE inputs too."""
    out: dict[str, float] = {}
    others = sum(gq.all_batches) - gq.rank_tokens
    if egroup is not None and egroup.method == "gptq":
        out["moe_inputs"] = others * (hidden * 4 + s.top_k * 16)
        if egroup.options.fit_unquantized:  # the unquantized model's rows beside them
            out["reference_inputs"] = others * hidden * 4
        sch = egroup.scheme
        if sch.for_in_features(s.h).fp4:
            out["dequantized_weights"] = (s.experts - owned) * (s.p * s.h + s.h * s.i) * item
        else:  # codes (int8) and per-group scales (float32), zero points too when asymmetric
            per_group = 4 * (1 if sch.symmetric else 2)
            out["expert_codes"] = (s.experts - owned) * sum(
                rows * k * (1 + per_group / (sch.for_in_features(k).group_size or k))
                for rows, k in ((s.p, s.h), (s.h, s.i)))
    elif egroup is not None and egroup.method == "rtn":  # NVFP4 W4A4 input amax: gathered maxima only
        out["input_amax"] = s.experts * 3 * 8 * (g - 1) / g
    elif egroup is not None:
        out["moe_inputs"] = s_tok * (g - 1) / g * (2 * hidden * 4 + s.top_k * 16)
        routed = s.experts * (s.p * s.h + s.h * s.i)
        out["dequantized_weights"] = (s.elements - routed + routed * (g - 1) / g) * item
        gs = egroup.scheme.group_size or s.h  # the other ranks' search results: down scales, clip ratios
        out["search_results"] = s.experts * (g - 1) / g * (s.i + 1 + (s.p * s.h + s.h * s.i) / gs) * 4
    if dense:
        out["dense_partials"] = len(gq.all_batches) * sum(m.in_features ** 2 * 4 for m, _ in dense.values()) \
            * (g - 1) / g
        out["dequantized_weights"] = out.get("dequantized_weights", 0) + sum(
            m.in_features * m.out_features * item for m, _ in dense.values()) * (g - 1) / g
    return out


# ---- the model ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _PassContext:
    """What every layer's time model of the calibrated pass reads."""

    c: "Throughput"
    ex: object  # the meta-built LayerExecutor
    ckpt: object  # the (virtual) checkpoint
    rec: object  # the Recipe
    kind: str  # "cpu" | "cuda"
    g: int  # ranks
    item: int  # bytes per element of the pass's dtype
    hidden: int
    num_samples: int
    seq_len: int
    gq: object  # the pass's batches over the ranks (_pass_batches), the top-up pool's included
    stats_batches: list[int]  # tokens per batch of the calibration samples alone (no top-up pool)


def _bytes_per_layer(ckpt, num_layers: int) -> dict[int, list[int]]:
    """Per decoder layer, from the (virtual) headers: [source bytes, tensors, routed-expert bytes]."""
    from ..arch import layer_index

    out: dict[int, list[int]] = {}
    for name in ckpt.location:
        li = layer_index(name)
        if li is None or li >= num_layers:
            continue
        info = ckpt.info(name)
        acc = out.setdefault(li, [0, 0, 0])
        acc[0] += info.nbytes
        acc[1] += 1
        if f".{EXPERTS}." in name:
            acc[2] += info.nbytes
    return out


def _calibrated_bytes(layout, rec, num_layers: int) -> tuple[dict[int, int], dict[str, bool]]:
    """(bytes the calibrated groups write per layer: the pass's results; module -> calibrated or not)."""
    from ..arch import layer_index
    from .tensors import tensor_bytes

    packed_layer: dict[int, int] = {}
    calibrated_module: dict[str, bool] = {}
    for name, (shape, code) in layout.items():
        li = layer_index(name)
        if li is None or li >= num_layers:
            continue
        module = name.rsplit(".", 1)[0]
        hit = calibrated_module.get(module)
        if hit is None:
            grp = rec.match(module)
            hit = calibrated_module[module] = grp is not None and grp.method != "rtn"
        if hit:
            packed_layer[li] = packed_layer.get(li, 0) + tensor_bytes(shape, code)
    return packed_layer, calibrated_module


def _pass_row(row: dict, comm: dict, held: dict, ctx: _PassContext, idx: int, layer, s, packed: int) -> int:
    """Add one layer's GPTQ/AWQ pass seconds to `row` (its communicated bytes to `comm`, the packed results the
    busiest rank holds and writes to `held[idx]`); 1 when the layer has something calibrated, else 0."""
    from ..calib.layer import linear_targets
    from ..calib.spool import fits_unquantized

    c, ex, rec, kind, g, item, hidden, gq = ctx.c, ctx.ex, ctx.rec, ctx.kind, ctx.g, ctx.item, ctx.hidden, ctx.gq
    num_samples, seq_len, link = ctx.num_samples, ctx.seq_len, c.link_bytes_per_s
    calibrated = 0
    _, egroup, dense = linear_targets(ctx.ckpt, rec, idx, layer)
    # NVFP4 W4A4 RTN targets are only observed (their input amax): no Hessian, no solve
    dense = {d: v for d, v in dense.items() if v[1].method != "rtn"}
    # statistics forward, then the quantized layer's forward (true-sequential): the busiest rank's batches.
    # GPTQ of the routed experts alone splits them (the statistics stop at the experts, the second
    # forward runs the MLP block only); a layer with nothing calibrated is forwarded once
    split = (egroup is not None and egroup.method in ("gptq", "rtn") and not dense
             and not getattr(ex.config, "index_topk", None))
    if split:
        row["forward"] += _forward(c, s, gq.rank_batches, seq_len, item, hidden, "to_experts") + \
            _forward(c, s, gq.rank_batches, seq_len, item, hidden, "block")
    else:
        row["forward"] += (2 if egroup is not None or dense else 1) * \
            _forward(c, s, gq.rank_batches, seq_len, item, hidden)
    if egroup is not None or dense:
        calibrated = 1
    if fits_unquantized(rec):  # the unquantized model's stream through every layer, saved with the progress
        row["forward"] += _forward(c, s, gq.rank_batches, seq_len, item, hidden)
        row["write_spool"] += gq.rank_tokens * hidden * item / c.write_bytes_per_s + c.fsync_s
    if egroup is not None and egroup.scheme.w4a4 and s.experts:
        # NVFP4 W4A4: each expert's input amax, and its down input's (one gate/up product per routed
        # token, the busiest rank's batches; calib/observers.py ExpertInputAmax)
        for per_call in gq.rank_batches:
            rows = per_call * s.top_k / s.experts
            row["input_amax"] += 2 * per_call * s.top_k * s.h * s.p / _rate(c.gemm_flops, c.gemm_half_rows,
                                                                               rows)
    owned = 0
    if egroup is not None and egroup.method == "gptq":
        group = _expert_group(s, kind)
        groups = math.ceil(s.experts / group)
        owned = min(s.experts, math.ceil(groups / g) * group)  # the busiest rank's experts
        o = egroup.options
        per_token = affinity_experts(o.affinity_top_k, s.top_k, s.experts) if o.stats == "affinity" else None
        # the Grams of the calibration samples (a top-up pool adds a few rows per starved expert: not counted)
        row["hessians"] += _hessians(c, s, ctx.stats_batches, owned, hidden, per_token)
        sweep = [_sweep_experts(kk, nn, group, kind) for nn, kk in ((s.p, s.h), (s.h, s.i))]
        ch, sw = _gptq_solves(c, [(owned, s.p, s.h, sweep[0]), (owned, s.h, s.i, sweep[1])],
                              egroup.options.block_size, egroup.options.refit_scales, egroup.options.refine_sweeps)
        row["gptq_solve"] += ch + sw + owned * c.module_s  # gate and up: one matrix, two modules
        if o.holdout >= 2:
            row["gptq_solve"] += _heldout_check(c, s, sum(ctx.stats_batches), owned, o.holdout,
                                                (bool(o.fit_unquantized), bool(o.fit_unquantized or o.fit_down)))
        if o.fit_unquantized or o.fit_down:
            fs, fsol = _fit_unquantized(c, s, ctx.stats_batches, owned, hidden, per_token,
                                        down_only=not o.fit_unquantized)
            row["hessians"] += fs
            row["gptq_solve"] += fsol
    elif egroup is not None and egroup.method == "awq":
        o = egroup.options
        s_tok = min(int(o.sample_tokens), num_samples * seq_len)
        sch = egroup.scheme
        # the norm-scale candidates of each round and the per-expert searches (awq_pass.search_owners:
        # about E / g each) are split over the ranks, and each rank quantizes and emits the experts it searched
        parts = _awq_search_parts(c, s, s_tok, o.n_grid, o.grid_stride, o.clip, o.scale_down, s.experts,
                                  sch.group_size or s.h, sch.group_size or s.i)
        share = math.ceil(s.experts / g) / s.experts
        # the busiest rank's share of the candidates' tokens: each round's candidates are split
        rounds = awq_candidates(o.n_grid, o.grid_stride)
        cands, mine, sub = sum(rounds), sum(math.ceil(r / g) for r in rounds), min(512, s_tok)
        norm_share = ((mine * sub + math.ceil(3 / g) * s_tok) / (cands * sub + 3 * s_tok)
                      if s_tok > sub else mine / cands)
        row["awq_search"] += (norm_share * parts["norm"]
                              + share * (parts["down"] + parts["clip"] + parts["choice"] + parts["rtn"]))
        row["awq_search"] += s_tok * hidden * 4 * 2 / c.mem_bytes_per_s  # the samples and block outputs
    if dense:
        dshapes = [(1, m.out_features, m.in_features, 1) for m, _ in dense.values()]
        mine = dshapes[::g]  # the i-th dense target belongs to rank i % G
        row["hessians"] += sum(2 * tok * k * k / _rate(c.gram_flops, c.gram_half_rows, tok)
                               for _, _, k, _ in dshapes for tok in gq.rank_batches)
        refit = any(getattr(grp.options, "refit_scales", False) for _, grp in dense.values())
        refine = max((getattr(grp.options, "refine_sweeps", 0) for _, grp in dense.values()), default=0)
        ch, sw = _gptq_solves(c, mine, 128, refit, refine)
        row["gptq_solve"] += ch + sw
    # the spool: the layer's packed results (each rank writes what it solved: the busiest rank's expert groups,
    # AWQ's about E / g experts) and the next layer's inputs (every rank its own samples')
    if g == 1:
        written = 1.0
    elif egroup is not None and egroup.method == "awq":
        written = math.ceil(s.experts / g) / s.experts if s.experts else 1 / g
    else:
        written = owned / s.experts if owned else 1 / g
    held[idx] = int(packed * written)
    row["write_spool"] += (held[idx] + gq.rank_tokens * hidden * item) / c.write_bytes_per_s + 5 * c.fsync_s
    if g > 1:
        got = _communication(s, egroup, dense, gq, g, item, hidden, owned,
                             min(int(egroup.options.sample_tokens), num_samples * seq_len)
                             if egroup is not None and egroup.method != "rtn" else 0)
        for k2, v in got.items():
            comm[k2] = comm.get(k2, 0) + v
        row["communication"] += sum(got.values()) / link
    return calibrated


def _kv_row(row: dict, ctx: _PassContext, s, kvb: list[int]) -> None:
    """Add one layer's KV calibration seconds (forward and the K/V observers) to `row`."""
    c, ex, item, hidden = ctx.c, ctx.ex, ctx.item, ctx.hidden
    row["forward"] += _forward(c, s, kvb, ctx.seq_len, item, hidden)
    kv_width = (int(getattr(ex.config, "kv_lora_rank", 0) or 0) + int(getattr(ex.config, "qk_rope_head_dim", 0)
                or 0)) or 2 * s.heads * s.qk_dim
    tokens = sum(kvb)
    row["kv_observe"] += 2 * tokens * hidden * kv_width / _rate(c.gemm_flops, c.gemm_half_rows, max(kvb)) \
        + 4 * tokens * kv_width * 4 / c.mem_bytes_per_s


def _host_ram(c, plan, gq, passes_gq: bool, kind: str, ckpt, num_layers: int, held: dict) -> dict:
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


def calibration_cost(model_or_config, recipe, num_samples: int, seq_len: int, *, world_size: int = 1,
                     device: str = "cpu", gpu_memory_gib: float | None = None,
                     throughput: Throughput | None = None, threads: float | None = None,
                     compute_dtype: str | None = None) -> CalibrationCost:
    """Predict the calibrated pass of `recipe` (a name, path or Recipe) on `num_samples` x `seq_len` tokens
    for `model_or_config` (config.json, checkpoint directory, reference config name), on `world_size` ranks
    of `device` ("cpu" or "cuda"). `gpu_memory_gib`: the device memory each rank may use (cuda; None: not
    checked). `throughput`: the rates (None: THROUGHPUT[device kind]). `threads`: the threads each rank
    computes on, for a table that states its own (`Throughput.threads`: the cpu's); None: the ranks share the
    host's threads (the table's threads x its ranks) on one host (torchrun gives each worker one thread when it
    starts several). A table measured as one of G ranks (`ranks` G) predicts a world of G best: other world
    sizes scale its rates by the threads alone, and the result says so.
    `compute_dtype`: what the layers compute in (options.COMPUTE_DTYPE_CHOICES, as `convert --compute-dtype`;
    None: "auto", the device's default): the forward's GEMMs then run at the table's rate for that dtype
    (`alt_gemm_flops` for the device's other one) and its activations take that dtype's bytes."""
    from ..match.recipe import Recipe, load_recipe
    from .source import resolve, tensor_shapes_from_checkpoint

    check_number("calibration samples N", num_samples, 1, MAX_CALIBRATION_SAMPLES, integer=True)
    check_number("calibration tokens per sample T", seq_len, 1, MAX_CALIBRATION_TOKENS, integer=True)
    check_number("world size", world_size, 1, MAX_GPUS, integer=True)
    if gpu_memory_gib is not None:
        check_number("gpu_memory_gib", gpu_memory_gib, 0, MAX_GPU_MEMORY_GIB, integer=False, lo_open=True)
    kind = "cuda" if str(device).startswith("cuda") else str(device)
    table = throughput or throughput_for(kind)
    if threads is not None:
        check_number("threads per rank", threads, 0, 1 << 20, integer=False, lo_open=True)
    host_threads = table.threads * table.ranks  # the host's, as the table was measured
    per_rank = (threads if threads is not None else host_threads / world_size) if table.threads else None
    c = table.for_threads(per_rank) if per_rank else table
    dtype, default = _compute_dtype(kind, compute_dtype), _compute_dtype(kind, "auto")  # gemm_flops is default's
    alt_unknown = dtype != default and not c.alt_gemm_flops
    if dtype != default and c.alt_gemm_flops:
        c = replace(c, gemm_flops=c.alt_gemm_flops)  # every GEMM of the layers' own computation
    rec = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    src = resolve(model_or_config)
    headers = tensor_shapes_from_checkpoint(src.checkpoint) if src.checkpoint is not None else None
    methods = tuple(sorted({g.method for g in rec.groups if g.method != "rtn"})) + \
        (("nvfp4_input_scales",) if any(g.scheme.w4a4 for g in rec.groups) else ()) + \
        (("kv_scales",) if rec.kv_cache is not None else ())
    out = CalibrationCost(model=src.label, recipe=rec.name, methods=methods, calibrated=bool(methods),
                          num_samples=num_samples, seq_len=seq_len, world_size=world_size, device=kind,
                          dtype=dtype, layers=0, calibrated_layers=0)
    out.constants = {"kind": c.kind, "provenance": c.provenance, "source": c.source, "values": table.to_json(),
                     "threads_per_rank": per_rank}
    if not methods:
        out.warnings.append(f"recipe {rec.name!r} has no calibrated group (GPTQ/AWQ) and no kv_cache section: "
                            "convert does not calibrate, nothing to predict")
        return out

    ckpt = virtual_checkpoint(src.config, headers)
    ex = build_executor(ckpt, kind, dtype)
    import torch

    item = torch.empty((), dtype=ex.dtype).element_size()
    g = world_size
    lengths = [seq_len] * num_samples
    pool = rec.balance_pool(num_samples)  # GPTQ's balance_tokens: the top-up pool is forwarded too
    gq = _pass_batches(ex, [seq_len] * (num_samples + pool), g)  # the GPTQ/AWQ pass: fixed forward batches
    out.pool_samples = pool
    kvb = _kv_batches(ex, lengths, g)  # KV calibration: the executor's batches over the ranks
    out.layers = ex.num_layers
    available = int(gpu_memory_gib * GIB) if (gpu_memory_gib and kind == "cuda") else None

    from ..arch import parse_config
    from .tensors import quantized_layout, tensor_bytes

    per_layer_bytes = _bytes_per_layer(ckpt, ex.num_layers)
    layout = quantized_layout({n: (ckpt.info(n).shape, _code(ckpt.info(n).dtype)) for n in ckpt.location}, rec,
                              spec=parse_config(ckpt.config))
    packed_layer, calibrated_module = _calibrated_bytes(layout, rec, ex.num_layers)

    secs = dict.fromkeys(COMPONENTS, 0.0)
    comm: dict[str, float] = {}
    held: dict[int, int] = {}  # layer -> packed result bytes of the busiest rank
    calib_layers = 0
    passes_gq = rec.needs_calibrated_pass
    passes_kv = rec.kv_cache is not None
    hidden = ex.hidden_size
    emb_rows = (num_samples + pool) * seq_len
    fixed = (c.startup_s + c.setup_s * (int(passes_gq) + int(passes_kv))
             + emb_rows * hidden * 4 / c.mem_bytes_per_s)
    secs["fixed"] += fixed
    ctx = _PassContext(c, ex, ckpt, rec, kind, g, item, hidden, num_samples, seq_len, gq,
                       _pass_batches(ex, lengths, g).all_batches if pool else gq.all_batches)
    for idx in range(ex.num_layers):
        layer = ex.decoder_layers[idx]
        sb, nt, eb = per_layer_bytes.get(idx, [0, 0, 0])
        s = _layer_shape(ex, idx, layer, sb, nt, eb)
        row: dict[str, float] = dict.fromkeys(COMPONENTS, 0.0)
        read = sb / c.read_bytes_per_s + s.elements * (item + 2 + item) / c.mem_bytes_per_s + nt * 6 * c.op_s
        if passes_gq:
            row["read_weights"] += read
            row["fixed"] += c.layer_s
            calib_layers += _pass_row(row, comm, held, ctx, idx, layer, s, packed_layer.get(idx, 0))
        if passes_kv:
            row["read_weights"] += read
            row["fixed"] += c.layer_s
            _kv_row(row, ctx, s, kvb)
        for k2, v in row.items():
            secs[k2] += v
        out.per_layer.append({"layer": idx, **{k2: round(v, 4) for k2, v in row.items() if v}})
    out.calibrated_layers = calib_layers
    out.seconds = {k: v for k, v in secs.items() if v}
    out.total_seconds = sum(secs.values())
    out.communication_bytes = {k: int(v) for k, v in comm.items()} if g > 1 else {}

    # after the pass, convert streams the source: every shard read, the packed experts from the spool,
    # the output written and hashed (not part of the calibration; the validation measures convert as a whole)
    src_total = sum(ckpt.info(n).nbytes for n in ckpt.location)
    out_total = sum(tensor_bytes(sh, d) for sh, d in layout.values())
    n_shards = len(list(src.checkpoint.glob("*.safetensors"))) if src.checkpoint is not None else \
        max(1, math.ceil(src_total / 5e9))  # hub releases: ~5 GB shards
    packed_total = sum(packed_layer.values())
    out.convert_output_seconds = (3 * n_shards + 8) * c.fsync_s + sum(calibrated_module.values()) * c.module_s + \
        (src_total + packed_total) / c.read_bytes_per_s + out_total / c.write_bytes_per_s + \
        out_total / (c.hash_bytes_per_s * g) + (src_total - packed_total) * 2 / c.mem_bytes_per_s

    # memory: the executor's own plan, as the pass makes it (every rank plans every sample's slot)
    ex.batch_tokens = gq.batch_tokens if passes_gq else _kv_batch_tokens(ex)
    plan, err = memory_plan(ex, rec, lengths, available, g)
    out.device_memory = plan.to_json()
    out.device_memory_bytes = plan.peak_bytes
    if available is not None:
        out.fits = err is None
    if err:
        out.warnings.append(f"does not fit: {err}")
    host = _host_ram(c, plan, gq, passes_gq, kind, ckpt, ex.num_layers, held)
    out.host_ram = host
    out.host_ram_bytes = sum(host.values())

    out.assumptions += _assumptions(c, g, kind, gq, kvb, passes_gq, passes_kv, per_rank)
    if dtype != default:
        out.assumptions.append(
            f"layers computed in {dtype}: " + (f"no {dtype} GEMM rate in the {kind} table, its {default} "
                                               "rate stands in" if alt_unknown else
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
    if table.ranks > 1 and table.ranks != g:
        out.warnings.append(f"the {kind} rates were measured as one of {table.ranks} ranks sharing the host, for "
                            f"a world of {g} they are scaled by the threads alone (measure with --gpus {g})")
    return out


def _is_experts(module) -> bool:
    from ..calib import moe

    return moe.is_routed_experts(module)


def _activation_budget() -> int:
    from ..calib.executor import DEFAULT_ACTIVATION_BUDGET

    return DEFAULT_ACTIVATION_BUDGET


def _code(dtype) -> str:
    from ..read.safetensors import CODE_OF

    return CODE_OF[dtype]


def _assumptions(c: Throughput, g: int, kind: str, gq: _Batches, kvb: list[int], passes_gq: bool,
                 passes_kv: bool, per_rank: float | None = None) -> list[str]:
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
