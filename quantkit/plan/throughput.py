"""The throughput table of the calibrated pass's cost model (plan/calibration.py): the rates of one device
kind, one row per kind. "cpu" is measured by `python -m bench calib_cost` (which prints a new row to paste
here), "cuda" assumed from published peak figures with stated efficiency factors; plan/measure.py measures a
row on this machine (`quantkit plan --measure`). docs/cost.md describes every rate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from ..errors import ConfigError


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
    # the order k at which a Cholesky + inverse of a k x k matrix reaches half of chol_flops: it runs faster on
    # larger matrices (an AVX2 VM: 6.5 GFLOP/s at k = 256, 25 at 4096); 0: one rate whatever k (a table measured
    # before it was)
    chol_half_k: float = 0.0
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
        missing = names - set(doc) - {"notes", "threads", "ranks", "startup_s", "alt_gemm_flops", "chol_half_k"}
        if missing:
            raise ConfigError(f"throughput table lacks {sorted(missing)}")
        kw = {k: v for k, v in doc.items() if k in names}
        kw["notes"] = tuple(kw.get("notes") or ())
        return cls(**kw)


# Measured by `python -m bench calib_cost` (it prints this row to paste here). This one: a 2-vCPU Intel Xeon
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
           "quantkit/plan/throughput.py; measure on a GPU with `python -m bench calib_cost --device cuda` to "
           "replace them",),
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
