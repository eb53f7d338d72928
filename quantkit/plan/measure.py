"""The calibration cost model's constants (plan/throughput.py `Throughput`), measured on this machine:
`quantkit plan ... --calibration N,T --measure` predicts with them instead of the shipped table, and
bench/calib_cost.py measures them to check the model against real conversions (and to ship a new CPU row).

What is measured, in the compute dtype of the device (float32 on the CPU, bfloat16 GEMMs on a GPU): GEMM FLOP/s
at several row counts, fitted as peak * m / (m + half), and the same GEMMs in the other dtype (their mean
ratio to the first gives `alt_gemm_flops`, for --compute-dtype); the Hessians' Gram products likewise; AWQ's
clip-search group errors; batched Cholesky + triangular inverse (quant.gptq.cholesky_inverse_upper); GPTQ's
column sweep (the fixed seconds per column step and the in-block update rate); streaming element-wise
bandwidth; one small tensor op; fsynced writes, page-cache reads, sha256; per-module emission; the process's
RSS after the imports; gc + malloc_trim per layer. Not measured, taken from the shipped table and said so
in the table's notes: the link between ranks, the fixed set-up of a pass and a fresh process's start-up
(bench/calib_cost.py measures the last two on its bench model; given the model's config, the start-up is
measured too: `measure_startup`). About 30-60 s on a 2-core CPU.

For a world of G CPU ranks on one host (`--gpus G --device cpu`) the rates are measured as a rank sees
them: on its share of the host's threads, while G - 1 neighbour processes compute alongside on theirs
(`neighbours`: float32 GEMMs and element-wise streams, what a pass mostly computes). Two processes on two
cores need not each run at one process's speed alone: they share caches, memory bandwidth and, on a VM,
whatever the host gives its vCPUs.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import os
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import ConfigError
from .bounds import MAX_GPUS, check_number
from .throughput import THROUGHPUT, Throughput

# the shapes the rates are measured on: bench/calib_cost.py's bench MoE (hidden 512, expert width 256)
HIDDEN, INTER = 512, 256
CHOL_LARGE = 2048  # the largest Hessian whose Cholesky is timed (2048 x 2048 float64: 32 MB, ~0.3 s on 2 cores)
MIN_S = 0.2  # each timing repeats its operation for at least this long


def best_seconds(fn, repeat: int = 3, min_s: float | None = None, clock=time.perf_counter) -> float:
    """Fastest seconds of one call of fn over `repeat` timings (each timing runs fn until min_s passed;
    None: MIN_S)."""
    min_s = MIN_S if min_s is None else min_s
    fn()
    best = float("inf")
    for _ in range(repeat):
        n, t0 = 0, clock()
        while True:
            fn()
            n += 1
            el = clock() - t0
            if el >= min_s:
                break
        best = min(best, el / n)
    return best


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _fit_half(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(peak, half) of rate(m) = peak * m / (m + half) from (m, rate) points, least squares on log(rate)
    (relative errors: every row count counts alike): half on a log grid, peak in closed form for each."""
    best = None
    for i in range(0, 161):
        half = 0.0 if i == 0 else 10 ** (i / 32)  # 1 .. 1e5 rows
        logs = [math.log(r) - math.log(m / (m + half)) for m, r in points]
        lp = statistics.fmean(logs)
        err = sum((v - lp) ** 2 for v in logs)
        if best is None or err < best[0]:
            best = (err, math.exp(lp), half)
    return best[1], best[2]


def rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class _Bench:
    """What measure_rates' measurements share: the device, its compute dtype (float32 on the CPU, bfloat16 GEMMs
    on a GPU) and GPTQ's solve dtype, one random generator (drawn from in the order the measurements run), the
    model's shapes, a scratch directory, the log and the clock."""

    dev: torch.device
    dt: torch.dtype
    sdt: torch.dtype
    g: torch.Generator
    hidden: int
    inter: int
    workdir: Path
    log: Callable[[str], None]
    clock: Callable[[], float]

    def best(self, fn, repeat: int = 3, min_s: float | None = None) -> float:
        return best_seconds(fn, repeat, min_s, self.clock)


def measure_rates(device: str, hidden: int, inter: int, workdir: Path, log, clock=time.perf_counter) -> dict:
    """Every rate and per-operation cost of the Throughput table for `device`, measured here on the shapes of a
    model of `hidden` and expert width `inter` (the table's fields; points behind the fits under keys
    starting with "_"). `clock`: what time is read with (time.process_time: CPU seconds of this process)."""
    dev = torch.device(device)
    bench = _Bench(dev, torch.float32 if dev.type == "cpu" else torch.bfloat16,
                   torch.float64 if dev.type == "cpu" else torch.float32, torch.Generator(device="cpu").manual_seed(0),
                   hidden, inter, workdir, log, clock)
    out: dict = {}
    ws, pts_gemm = _measure_products(bench, out)
    _measure_solves(bench, out)
    _measure_streams(bench, out)
    _measure_files(bench, out)
    _measure_modules(bench, out)
    _measure_process(bench, out)
    # last: a CPU process's float32 work was seen to slow after bfloat16 work (docs/calibration.md)
    _measure_alt_gemm(bench, out, ws, pts_gemm)
    return out


def _measure_products(bench: _Bench, out: dict) -> tuple[torch.Tensor, list[tuple[int, float]]]:
    """The GEMM, Gram and AWQ group-error rates into `out`; returns the GEMMs' expert weights and (rows, FLOP/s)
    points, which the other dtype's GEMMs are measured against last (_measure_alt_gemm)."""
    dev, dt, g, hidden, inter = bench.dev, bench.dt, bench.g, bench.hidden, bench.inter
    log, _best = bench.log, bench.best
    # GEMM [m, H] x [2I, H]^T at several m: the experts' gate/up as the forward runs them, in nn.Linear's layout
    # (the weight [out, in] used transposed: 12-20% slower than a contiguous [in, out] operand on one core of
    # this project's Intel VM) and each expert's own weights in turn (8 of them, more than a core's L2); the
    # attention projections are [tokens, H] x [*, H]^T too
    pts = []
    ws = torch.randn(8, 2 * inter, hidden, generator=g).to(dev, dt)
    for m in (16, 64, 256, 1024, 4096):
        a = torch.randn(m, hidden, generator=g).to(dev, dt)
        t = _best(lambda: ([torch.mm(a, w.T) for w in ws], _sync(dev))) / len(ws)
        pts.append((m, 2 * m * hidden * 2 * inter / t))
    out["gemm_flops"], out["gemm_half_rows"] = _fit_half(pts)
    pts_gemm = pts
    out["_gemm_points"] = [[m, round(r / 1e9, 2)] for m, r in pts]
    log(f"gemm: {[(m, round(r / 1e9, 1)) for m, r in pts]} GFLOP/s -> peak {out['gemm_flops'] / 1e9:.1f}, "
        f"half {out['gemm_half_rows']:.0f} rows")

    # Gram x^T x over m rows, batched over 8 experts, float32 (the Hessians)
    pts = []
    for m in (32, 128, 512, 2048):
        x = torch.randn(8, m, hidden, generator=g).to(dev, torch.float32)
        t = _best(lambda: (torch.bmm(x.transpose(1, 2), x), _sync(dev)))
        pts.append((m, 2 * 8 * m * hidden * hidden / t))
    out["gram_flops"], out["gram_half_rows"] = _fit_half(pts)
    out["_gram_points"] = [[m, round(r / 1e9, 2)] for m, r in pts]
    log(f"gram: {[(m, round(r / 1e9, 1)) for m, r in pts]} GFLOP/s")

    # AWQ clip search's group errors: per candidate, float32 [rows, 32] x [32, 32] quadratic forms batched over
    # every (expert, group) of a row chunk (quant.awq.search_clip); nominal 2 x rows x 32 x 32
    b, m, gs = 8 * hidden // 32, 256, 32
    d = torch.randn(b, m, gs, generator=g).to(dev)
    blk = torch.randn(b, gs, gs, generator=g).to(dev)
    t = _best(lambda: (torch.bmm(d, blk).mul_(d).sum(-1), _sync(dev)))
    out["block_form_flops"] = 2 * b * m * gs * gs / t
    log(f"group forms: {out['block_form_flops'] / 1e9:.1f} GFLOP/s")
    return ws, pts_gemm


def _measure_solves(bench: _Bench, out: dict) -> None:
    """GPTQ's rates into `out`: the batched Cholesky and triangular inverse, the column sweep (after the Gram
    rate, which the sweep's lazy updates are counted at)."""
    from ..quant.gptq import GPTQArgs, cholesky_inverse_upper, gptq

    dev, sdt, g, hidden, inter = bench.dev, bench.sdt, bench.g, bench.hidden, bench.inter
    log, _best = bench.log, bench.best
    # batched Cholesky of the reversed Hessian + its triangular inverse, nominal 2/3 K^3 per matrix, at the model's
    # widths and up to CHOL_LARGE, fitted as peak * k / (k + half): a 7168-wide expert's Hessian factorizes several
    # times faster per flop than a 512-wide one (measured at 256 .. 512 only, the rate over-predicted a 7168-wide
    # layer's solve by 85%: docs/cost.md "At real widths")
    pts = []
    for c, k in ((32, inter), (8, hidden), (2, max(hidden, CHOL_LARGE // 2)), (1, max(hidden, CHOL_LARGE))):
        x = torch.randn(c, 2 * k, k, generator=g, dtype=torch.float64)
        h = (x.transpose(1, 2) @ x / (2 * k)).to(dev, sdt)
        del x
        t = _best(lambda: (cholesky_inverse_upper(h, 0.01, 4, torch.float32), _sync(dev)), repeat=3)
        pts.append((k, c * 2 / 3 * k ** 3 / t))
    out["chol_flops"], out["chol_half_k"] = _fit_half(pts)
    out["_chol_points"] = [[k, round(r / 1e9, 2)] for k, r in pts]
    log(f"cholesky: {[(k, round(r / 1e9, 2)) for k, r in pts]} GFLOP/s -> peak {out['chol_flops'] / 1e9:.1f}, "
        f"half k {out['chol_half_k']:.0f}")

    # GPTQ's column sweep: gptq() minus its factorization, at a small (fixed cost) and a large shape
    def sweep(c, n, k):
        x = torch.randn(c, 4 * k, k, generator=g, dtype=torch.float64)
        h = (x.transpose(1, 2) @ x / (4 * k)).to(dev, sdt)
        w = (torch.randn(c, n, k, generator=g) * 0.02).to(dev)
        tf = _best(lambda: (gptq(w, h, GPTQArgs(4, 32, True, actorder=True, solve_dtype=sdt)), _sync(dev)), repeat=2)
        tc = _best(lambda: (cholesky_inverse_upper(h, 0.01, 4, torch.float32), _sync(dev)), repeat=2)
        lazy = 2 * c * n * sum(128 * max(0, k - i - 128) for i in range(0, k, 128))
        return max(1e-9, tf - tc - lazy / out["gram_flops"]), c, n, k

    small = sweep(1, 16, 256)
    large = sweep(8, 2 * inter, hidden)
    # t = k * col_s + c * n * k * (b/2 + 4) / rate, b = 128
    cols = [small[3], large[3]]
    elems = [s[1] * s[2] * s[3] * (min(128, s[3]) / 2 + 4) for s in (small, large)]
    ts = [small[0], large[0]]
    det = cols[0] * elems[1] - cols[1] * elems[0]
    col_s = (ts[0] * elems[1] - ts[1] * elems[0]) / det if det else ts[0] / cols[0]
    inv_rate = (cols[0] * ts[1] - cols[1] * ts[0]) / det if det else 0.0
    if col_s <= 0 or inv_rate <= 0:  # noisy: attribute the small shape to the fixed part, the rest to the rate
        col_s = ts[0] / cols[0]
        inv_rate = max(1e-15, (ts[1] - cols[1] * col_s) / elems[1])
    out["sweep_col_s"], out["sweep_elems_per_s"] = col_s, 1 / inv_rate
    log(f"sweep: {col_s * 1e6:.1f} us per column step, {out['sweep_elems_per_s'] / 1e9:.2f} G elements/s "
        f"(raw {ts[0]:.3f} s, {ts[1]:.3f} s)")


def _measure_streams(bench: _Bench, out: dict) -> None:
    """Element-wise rates into `out`: streaming bandwidth, AWQ's fake quantization, one small op's dispatch."""
    dev, g, hidden, inter, log, _best = bench.dev, bench.g, bench.hidden, bench.inter, bench.log, bench.best
    # streaming element-wise bandwidth: z = x + y over 64 MiB float32 (3 x 64 MiB moved)
    n = 16 << 20
    x, y = torch.randn(n, generator=g).to(dev), torch.randn(n, generator=g).to(dev)
    z = torch.empty_like(x)
    t = _best(lambda: (torch.add(x, y, out=z), _sync(dev)))
    out["mem_bytes_per_s"] = 3 * n * 4 / t
    log(f"stream: {out['mem_bytes_per_s'] / 1e9:.1f} GB/s")

    # AWQ's fake quantization (RTN quantize-dequantize, group 32) of every expert's gate/up
    from ..quant.awq import fake_quant

    wq = (torch.randn(32, 2 * inter, hidden, generator=g) * 0.02).to(dev)  # the bench model's 32 experts
    t = _best(lambda: (fake_quant(wq, 4, 32, True), _sync(dev)))
    out["fake_quant_elems_per_s"] = wq.numel() / t
    log(f"fake_quant: {out['fake_quant_elems_per_s'] / 1e6:.0f} M elements/s")

    # one small op: what dispatching a tensor op costs beyond its bytes (a 64-element add; on a GPU a launch)
    a64, b64 = torch.ones(64, device=dev), torch.ones(64, device=dev)
    c64 = torch.empty(64, device=dev)
    t = _best(lambda: [torch.add(a64, b64, out=c64) for _ in range(100)] and _sync(dev))
    out["op_s"] = t / 100
    log(f"op: {out['op_s'] * 1e6:.2f} us")


def _measure_files(bench: _Bench, out: dict) -> None:
    """File rates into `out`: fsynced writes, page-cache reads, sha256, a small file written and fsynced."""
    workdir, log, _best = bench.workdir, bench.log, bench.best
    # files: fsynced writes, page-cache reads, sha256
    f = workdir / "calib_cost.io"
    buf = os.urandom(64 << 20)
    size = 256 << 20

    def write():
        with open(f, "wb") as fh:
            for _ in range(size // len(buf)):
                fh.write(buf)
            fh.flush()
            os.fsync(fh.fileno())

    out["write_bytes_per_s"] = size / _best(write, repeat=2, min_s=0)

    def read():
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(bytearray(16 << 20)):
                pass

    out["read_bytes_per_s"] = size / _best(read, repeat=3, min_s=0)
    out["hash_bytes_per_s"] = len(buf) / _best(lambda: hashlib.sha256(buf).digest(), repeat=3, min_s=0)
    f.unlink()

    def small():  # a small file written and fsynced (the spool's JSON records, the journal)
        with open(f, "wb") as fh:
            fh.write(b"{}" * 512)
            fh.flush()
            os.fsync(fh.fileno())

    out["fsync_s"] = _best(small, repeat=5, min_s=0)
    f.unlink()
    log(f"files: write {out['write_bytes_per_s'] / 1e9:.2f} GB/s, read {out['read_bytes_per_s'] / 1e9:.2f} GB/s, "
        f"sha256 {out['hash_bytes_per_s'] / 1e9:.2f} GB/s, fsync of a small file {out['fsync_s'] * 1e3:.1f} ms")


def _measure_modules(bench: _Bench, out: dict) -> None:
    """The seconds per quantized module beyond its bytes into `out` (after the write rate)."""
    g, hidden, inter, log, _best = bench.g, bench.hidden, bench.inter, bench.log, bench.best
    f = bench.workdir / "calib_cost.io"
    # per quantized module: packing and recording it (calib/emit.py), its SQNR, its metadata as JSON and its
    # tensors written to a safetensors file (no fsync), beyond the bytes
    from ..arch.layout import EXPERTS, LayerNames
    from ..calib.emit import LayerResult, emit
    from ..match.recipe import load_recipe
    from ..quant.int4 import QParams, dequantize, rtn, sqnr_db
    from ..write.writer import write_safetensors

    scheme = load_recipe("int4-experts-gptq").groups[0].scheme
    mods = 32
    w = torch.randn(mods, 2 * inter, hidden, generator=g) * 0.02
    r = rtn(w, 4, 32, True)
    deq = dequantize(r.q, r.qparams.scale, None)

    layer = LayerNames("", 0)
    names = [f"{layer.mlp}.{EXPERTS}.{j}.{layer.experts.gate}" for j in range(mods)]

    def emit_all():
        res = LayerResult()
        for j in range(mods):
            emit(res, names[j], r.q[j], QParams(r.qparams.scale[j], None), scheme,
                 torch.bfloat16, {"method": "gptq", "sqnr_db": round(float(sqnr_db(w[j], deq[j])), 4)})
        write_safetensors(f, res.tensors)
        json.dumps(res.modules, sort_keys=True)

    t = _best(emit_all, repeat=2, min_s=0)
    f.unlink()
    out["module_s"] = max(1e-6, (t - mods * 2 * inter * hidden * 0.6 / out["write_bytes_per_s"]) / mods)
    log(f"per module: {out['module_s'] * 1e3:.2f} ms")


def _measure_process(bench: _Bench, out: dict) -> None:
    """The fixed costs into `out`: the process's RSS after the imports, gc + malloc_trim per layer."""
    log, _best = bench.log, bench.best
    # fixed costs: the process after the imports, gc (of what the pass created) + malloc_trim per layer
    import ctypes

    import transformers  # noqa: F401

    import quantkit.calib.executor  # noqa: F401
    import quantkit.convert  # noqa: F401

    def free():
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass

    free()  # the measurements' freed temporaries, which the command's malloc settings keep in the heap
    out["process_bytes"] = rss_now()

    gc.freeze()  # as LayerExecutor.layers does over a pass: what exists before the first layer is not walked
    try:
        out["layer_s"] = _best(free, repeat=3, min_s=0)  # the executor's free_layer: once per layer and pass
    finally:
        gc.unfreeze()
    log(f"process {out['process_bytes'] / 1e9:.2f} GB, per layer {out['layer_s'] * 1e3:.0f} ms")


def _measure_alt_gemm(bench: _Bench, out: dict, ws: torch.Tensor, pts_gemm: list[tuple[int, float]]) -> None:
    """`alt_gemm_flops` into `out`: _measure_products' GEMMs (expert weights `ws`, points `pts_gemm`) in the
    device's other compute dtype (--compute-dtype), their mean ratio to the default dtype's rate."""
    dev, dt, g, hidden, inter = bench.dev, bench.dt, bench.g, bench.hidden, bench.inter
    log, _best = bench.log, bench.best
    alt = torch.bfloat16 if dt == torch.float32 else torch.float32
    ratios = []
    ws = ws.to(alt)
    for m, r in pts_gemm:
        a = torch.randn(m, hidden, generator=g).to(dev, alt)
        t = _best(lambda: ([torch.mm(a, w.T) for w in ws], _sync(dev))) / len(ws)
        ratios.append(2 * m * hidden * 2 * inter / t / r)
    out["alt_gemm_flops"] = out["gemm_flops"] * statistics.fmean(ratios)
    out["_alt_gemm_ratios"] = [round(x, 3) for x in ratios]
    log(f"gemm in {str(alt).replace('torch.', '')}: x{[round(x, 2) for x in ratios]} the default dtype's rate -> "
        f"peak {out['alt_gemm_flops'] / 1e9:.1f} GFLOP/s")


# A neighbour rank: float32 GEMMs of the bench shapes and an element-wise stream, on its threads, until its
# parent closes its stdin or is gone. It says "ready" once its buffers exist and it has run one round.
_NEIGHBOUR = """
import os, select, sys, torch
torch.set_num_threads(int(sys.argv[1]))
parent = os.getppid()
a = torch.randn(8, 512, 512)
x, y = torch.randn(8 << 20), torch.randn(8 << 20)
z = torch.empty_like(x)
ready = False
while os.getppid() == parent and not select.select([sys.stdin], [], [], 0)[0]:
    for _ in range(4):
        torch.bmm(a, a)
    torch.add(x, y, out=z)
    if not ready:
        print("ready", flush=True)
        ready = True
"""


@contextlib.contextmanager
def neighbours(n: int, threads: int, timeout: float = 120.0):
    """`n` processes computing alongside this one (_NEIGHBOUR), each on `threads` threads, from when every one
    of them has started its work until the block ends; yields their Popen objects. They stop when the block
    ends (stdin closed, then killed if still there after 5 s) or when this process is gone."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _NEIGHBOUR, str(threads)], env=env, text=True,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        for p in procs:
            left = deadline - time.monotonic()
            line = p.stdout.readline() if left > 0 and select.select([p.stdout], [], [], left)[0] else ""
            if line.strip() != "ready":
                from ..errors import MeasurementError

                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=2)  # its exit status, where it is ending
                raise MeasurementError(f"a neighbour process for the measurement did not start within {timeout:g} s "
                                       f"(exit {p.returncode})")
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()


# A fresh process's start-up (`Throughput.startup_s`): after what `quantkit convert` has imported when convert()
# starts, the first meta model of the config (transformers' modeling imports, first use) cold minus warm.
_STARTUP_PROBE = """
import json, sys, time
import quantkit.cli, quantkit.convert
config = json.loads(open(sys.argv[1]).read())
times = []
for _ in range(2):
    t0 = time.perf_counter()
    from quantkit.arch import arch_for
    from quantkit.calib.executor import DEFAULT_EXPERTS_IMPLEMENTATION, build_config, build_meta_model
    build_meta_model(build_config(config), DEFAULT_EXPERTS_IMPLEMENTATION if arch_for(config, "calibrate").experts
                     else None)
    times.append(time.perf_counter() - t0)
print(times[0] - times[1])
"""


def measure_startup(config: dict, ranks: int = 1, threads: int = 1, rounds: int = 2, timeout: float = 300.0) -> float:
    """What a fresh `quantkit convert` process pays once before its first layer for a model of `config`
    (config.json's dict): transformers' modeling imports and the first meta model, cold minus warm, after
    what the CLI imports. `ranks` > 1: that many fresh processes at once, on `threads` threads each, as torchrun
    starts them (they import side by side); the slowest counts. The fastest of `rounds` rounds."""
    from ..errors import MeasurementError

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    best = float("inf")
    with tempfile.TemporaryDirectory(prefix="quantkit-startup-") as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps(config))
        for _ in range(rounds):
            procs = [subprocess.Popen([sys.executable, "-c", _STARTUP_PROBE, str(cfg)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(ranks)]
            outs = []
            try:
                for p in procs:
                    out, err = p.communicate(timeout=timeout)
                    tail = (err.strip().splitlines() or ["no message"])[-1]
                    try:
                        if p.returncode != 0:
                            raise ValueError
                        outs.append(float(out.strip().splitlines()[-1]))
                    except (ValueError, IndexError):
                        raise MeasurementError(f"the start-up probe failed (exit {p.returncode}): {tail[:300]}") \
                            from None
            except subprocess.TimeoutExpired:
                raise MeasurementError(f"the start-up probe took over {timeout:g} s") from None
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            best = min(best, max(outs))
    return max(0.0, best)


def machine_label(device: str, threads: int | None = None) -> str:
    """The processor, core and thread counts (None: torch's) and torch version (and the GPU's name for cuda)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{threads or torch.get_num_threads()} threads"
            + (f", {torch.cuda.get_device_name()}" if kind == "cuda" else ""))


def host_capacity() -> tuple[int, int | None]:
    """(the CPUs this process may run on, the bytes of memory available now; None where /proc/meminfo does not
    say)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh.read(1 << 16).decode("ascii", "replace").splitlines():
                if line.startswith("MemAvailable:"):
                    return cpus, int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return cpus, None


def check_host(ranks: int, capacity: tuple[int, int | None] | None = None) -> None:
    """Measuring as one of `ranks` CPU ranks runs `ranks` processes at once (this one and ranks - 1 neighbours,
    then `ranks` start-up probes): refused (ConfigError, before any process starts) where they outnumber this
    host's CPUs (`capacity`, None: host_capacity()), or where that many processes of the size of one that has
    imported torch, transformers and quantkit (the shipped CPU row's process_bytes) outgrow its available memory."""
    cpus, available = host_capacity() if capacity is None else capacity
    hint = (f"measure with --gpus {cpus} or fewer, or drop --measure (the shipped table predicts any number of "
            "ranks)")
    if ranks > cpus:
        raise ConfigError(f"--measure as one of {ranks} CPU ranks runs {ranks} processes at once; this host runs "
                          f"{cpus} side by side (its CPUs)", hint=hint)
    per = THROUGHPUT["cpu"].process_bytes
    if available is not None and ranks * per > available:
        raise ConfigError(f"--measure as one of {ranks} CPU ranks runs {ranks} processes of ~{per / 1e9:.1f} GB "
                          f"at once; this host has {available / 1e9:.1f} GB available", hint=hint)


def measure_throughput(device: str = "cpu", *, ranks: int = 1, threads: int | None = None, config: dict | None = None,
                       log=None, workdir: str | Path | None = None,
                       source: str = "quantkit plan --measure") -> Throughput:
    """A Throughput table for `device` ("cpu", or "cuda" where a GPU is visible) measured here: the shipped
    table's row with every measured field replaced (see the module's docstring for what is not measured).
    `ranks` (cpu): measured as one of that many ranks sharing this host: on `threads` threads (None: this
    process's threads // ranks, at least 1) while ranks - 1 neighbours compute alongside, each on as many.
    `config` (config.json's dict; cpu): also a fresh process's start-up for that model (`measure_startup`, with
    `ranks` processes starting at once); more ranks than this host can run at once are refused first
    (`check_host`). `log(message)`: progress, one line per measurement."""
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("measuring a GPU's throughput needs one here (torch sees no CUDA device)",
                          hint="run it on the GPU machine, or drop --measure to use the assumed figures")
    check_number("ranks", ranks, 1, MAX_GPUS, integer=True)
    if threads is not None:
        check_number("threads", threads, 1, 1 << 20, integer=True)
    if kind == "cpu":
        check_host(ranks)
    log = log or (lambda m: None)
    shared = kind == "cpu" and ranks > 1
    prev = torch.get_num_threads()
    per_rank = (threads or max(1, prev // ranks)) if kind == "cpu" else 0
    load0 = os.getloadavg()[0]
    torch.set_num_threads(per_rank or prev)
    try:
        with contextlib.ExitStack() as stack:
            if shared:
                log(f"starting {ranks - 1} neighbour process(es) on {per_rank} thread(s) each: the rates of one of "
                    f"{ranks} ranks sharing this host")
                stack.enter_context(neighbours(ranks - 1, per_rank))
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="quantkit-measure-", dir=workdir))
            rates = measure_rates(device, HIDDEN, INTER, Path(tmp), log)
    finally:
        torch.set_num_threads(prev)
    measured_startup = config is not None and kind == "cpu"
    if measured_startup:
        rates["startup_s"] = measure_startup(config, ranks, per_rank)
        log(f"start-up of a fresh process ({ranks} at once): {rates['startup_s']:.2f} s")
    base = THROUGHPUT[kind]
    return replace(base, provenance="measured",
                   source=f"{source}, {machine_label(device, per_rank or prev)}, "
                          f"{time.strftime('%Y-%m-%d', time.gmtime())}, load average {load0:.1f} at the start"
                          + (f", as one of {ranks} ranks computing at once" if shared else ""),
                   notes=(("link_bytes_per_s, setup_s: the shipped table's, not measured here",) if measured_startup
                          else ("link_bytes_per_s, setup_s, startup_s: the shipped table's, not measured here",)),
                   threads=per_rank, ranks=ranks if shared else 1,
                   **{k: v for k, v in rates.items() if not k.startswith("_")})
