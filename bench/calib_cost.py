"""The calibration cost model's constants, measured, and its prediction checked against a real conversion.

    python -m bench calib_cost                 # constants + GPTQ and AWQ of the bench model (~5 min quiet)
    python -m bench calib_cost --quick         # 2 layers, 8 samples: the bench's own logic (~1 min)
    python -m bench calib_cost --smoke         # 1 layer, 4 experts, GPTQ only, 2 x 16 tokens
    python -m bench calib_cost --no-awq        # GPTQ only
    python -m bench calib_cost --device cuda   # measure a GPU's constants (where one is available)

1. Constants (quantkit/plan/calibration.py, `Throughput`), measured on this machine in the compute dtype
   of `--device` (float32 on the CPU): GEMM FLOP/s at several row counts m of [m, K] x [K, N] (K = N = the
   bench model's hidden size) fitted as peak * m / (m + half); the Gram products x^T x of the Hessians likewise;
   AWQ's clip-search group errors (batched float32 [256, 32] x [32, 32] products); batched Cholesky + triangular inverse (quant.gptq.cholesky_inverse_upper) on the
   bench model's Hessian shapes; GPTQ's column sweep (quant.gptq.gptq minus its factorization, on two shapes:
   the fixed seconds per column step and the in-block update rate); streaming element-wise bandwidth; the
   cost of one small tensor op; fsynced file writes, page-cache reads and sha256; the process's RSS after
   the imports; the fixed setup (an executor over the bench model) and the fixed cost per layer (gc +
   malloc_trim, the executor's free_layer). The link between ranks is not measured (assumed, stated).
2. The bench model (the issue's, bench.harness.bench_moe): qwen3_moe built with quantkit.tiny.make_tiny_model, 8 layers,
   32 routed experts per layer, hidden 512, expert width (moe_intermediate_size) 256, top-4 routing,
   8 query / 4 KV heads of 64, dense intermediate 1024 (unused: every layer is MoE), vocab 4096, BF16 weights;
   16 samples x 256 random token ids.
3. `quantkit.convert.convert` with int4-experts-gptq (and int4-experts-awq, and fp8-kv: KV scales only),
   single process, on the CPU:
   wall time against `calibration_cost(...)` with the constants just measured (and with the shipped table).
   Target: within 20%.

Writes bench/results/calib_cost.json, and prints the `Throughput(...)`
row to paste into quantkit/plan/calibration.py (CPU_MEASURED) once measured on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.harness import (BENCH_MOE, REPO, Run, add_common_args, bench_moe, last_json, measure_cmd, scratch_dir,
                           token_rows)

BENCH = BENCH_MOE
TARGET = 0.20
CLOCK = time.perf_counter  # --cpu-time: time.process_time (one thread: CPU seconds of the process)


def measure_setup(src: Path, calib: Path, n: int, t: int) -> float:
    """The fixed part of a calibrated convert (setup_probe): the faster of a first and a second set-up, the
    second with the modules imported, as in a process that already ran one pass."""
    from bench.setup_probe import setup_times

    return min(setup_times(src, calib, n, t, clock=CLOCK))


def _env() -> dict:
    import torch

    return {**os.environ, **({"OMP_NUM_THREADS": "1"} if torch.get_num_threads() == 1 else {})}


def measure_startup(src: Path, calib: Path, n: int, t: int, rounds: int = 3) -> float:
    """What a fresh process pays once before its first layer beyond `setup_s`: setup_probe's set-up cold (the
    first executor: transformers' modeling imports, first-use initialization) minus warm, in a fresh process
    that has imported what the CLI imports. Fastest of `rounds` of them."""
    best = float("inf")
    for _ in range(rounds):
        r = measure_cmd([sys.executable, "-m", "bench.setup_probe", str(src), str(calib), str(n), str(t)], env=_env(),
                        cwd=REPO, check=True)
        best = min(best, float(r["stdout"].strip().splitlines()[-1]))
    return max(0.0, best)


def run_convert(src: Path, out: Path, calib: Path, recipe: str, n: int, t: int) -> dict:
    """`quantkit convert` in a fresh process, as a user runs it (its allocator settings, the modeling
    imports of its first executor): the conversion's own seconds (`--json`: `seconds`, from convert()'s
    start; with --cpu-time the main thread's CPU seconds of its timeline phases) and its peak RSS."""
    r = measure_cmd([sys.executable, "-m", "quantkit", "convert", str(src), str(out), "-r", recipe, "--dataset",
                     str(calib), "--num-samples", str(n), "--seq-len", str(t), "--overwrite", "--device", "cpu",
                     "--json"], env=_env(), check=True)
    res = last_json(r["stdout"])
    seconds = res["seconds"]
    if CLOCK is time.process_time:
        seconds = sum(res["timeline"]["ranks"][0]["phases_cpu"].values())
    return {"wall_s": round(seconds, 2), "seconds": res["seconds"], "peak_rss_bytes": res.get("peak_rss_bytes"),
            "process_wall_s": r["wall_s"]}


def paste_row(c) -> str:
    """The Python literal of a Throughput row, to paste into quantkit/plan/calibration.py."""
    d = c.to_json()
    lines = [f"{c.kind.upper()}_MEASURED = Throughput("]
    for k, v in d.items():
        if isinstance(v, float):
            v = float(f"{v:.4g}")
        if k == "notes":
            v = tuple(v)
        lines.append(f"    {k}={v!r},")
    lines.append(")")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench calib_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="whose constants to measure (cpu; cuda where one is available)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="2 layers, 8 samples: a quick run of the script itself")
    ap.add_argument("--no-awq", action="store_true", help="skip the AWQ conversion")
    ap.add_argument("--no-kv", action="store_true", help="skip the KV-scale conversion (fp8-kv)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="one thread, every time in CPU seconds of the process (time.process_time) instead of wall "
                         "seconds: a check of the model on a machine other jobs keep busy (file rates are then "
                         "not meaningful)")
    ap.add_argument("--workdir", default=None, help="the model and outputs (default: a temporary directory)")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    experts = BENCH["experts"]
    if a.quick:
        a.layers, a.num_samples = 2, 8
    if a.smoke:
        a.layers, a.num_samples, a.seq_len, a.no_awq, a.no_kv, experts = 1, 2, 16, True, True, 4
    run = Run("calib_cost", a, argv)
    from quantkit import allocator  # the conversions run in this process: tuned as the `quantkit` command,

    allocator.tune()  # before torch loads (allocator.THP_ENV is read at its first allocation)
    import torch

    from quantkit.plan.calibration import THROUGHPUT, CostOptions, calibration_cost
    from quantkit.plan.measure import machine_label, measure_rates
    global CLOCK
    if a.cpu_time:
        a.threads, CLOCK = 1, time.process_time
    if a.threads:
        torch.set_num_threads(a.threads)
    work = scratch_dir("qk-calib-cost-", a.workdir)

    def log(m):
        print(f"calib_cost: {m}", file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    if load0 > 0.5 * (os.cpu_count() or 1):
        log(f"load average {load0:.1f} on {os.cpu_count()} CPUs: other work is running, the figures will be low")
    # --smoke: a toy model and toy shapes for the rates (meaningless figures, seconds instead of minutes)
    shape = dict(hidden=64, moe_intermediate=32, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=32) if a.smoke else {}
    src = bench_moe(a.layers, experts, **shape)
    calib = token_rows(work / "calib.jsonl", a.num_samples, a.seq_len, BENCH["vocab"])
    consts = measure_rates(a.device, shape.get("hidden", BENCH["hidden"]),
                           shape.get("moe_intermediate", BENCH["moe_intermediate"]), work, log, clock=CLOCK)
    if a.device == "cpu":
        consts["setup_s"] = measure_setup(src, calib, a.num_samples, a.seq_len)
        log(f"setup {consts['setup_s']:.2f} s")
        consts["startup_s"] = measure_startup(src, calib, a.num_samples, a.seq_len, rounds=1 if a.smoke else 3)
        log(f"startup (a fresh process) {consts['startup_s']:.2f} s")
    else:
        consts["setup_s"] = THROUGHPUT["cuda"].setup_s
        consts["startup_s"] = THROUGHPUT["cuda"].startup_s
    kind = "cuda" if a.device.startswith("cuda") else "cpu"
    machine = machine_label(a.device)
    base = THROUGHPUT[kind]
    measured = replace(base, provenance="measured",
                       source=f"python -m bench calib_cost, {machine}, {time.strftime('%Y-%m-%d', time.gmtime())}, "
                              f"load average {load0:.1f} at the start"
                              + (", CPU seconds of one thread (--cpu-time)" if a.cpu_time else ""),
                       notes=("link_bytes_per_s: assumed, not measured",),
                       threads=torch.get_num_threads() if kind == "cpu" else 0,
                       **{k: v for k, v in consts.items() if not k.startswith("_")})

    runs = []
    recipes = (["int4-experts-gptq"] + ([] if a.no_awq else ["int4-experts-awq"])
               + ([] if a.no_kv else ["fp8-kv"]))
    if kind == "cpu":
        for recipe in recipes:
            log(f"convert {recipe}: {a.layers} layers, {a.num_samples} x {a.seq_len} tokens")
            got = run_convert(src, work / f"out-{recipe}", calib, recipe, a.num_samples, a.seq_len)
            row = {"recipe": recipe, "measured_s": got["wall_s"], "peak_rss_bytes": got["peak_rss_bytes"]}
            for label, table in (("predicted_s", measured), ("predicted_shipped_s", base)):
                p = calibration_cost(str(src), recipe, a.num_samples, a.seq_len,
                                     CostOptions(device="cpu", throughput=table))
                row[label] = round(p.total_seconds + p.convert_output_seconds, 2)
                if label == "predicted_s":
                    row["components"] = {k: round(v, 2) for k, v in p.seconds.items()}
                    row["components"]["convert_output"] = round(p.convert_output_seconds, 2)
                    row["predicted_host_ram_bytes"] = p.host_ram_bytes
            row["error"] = round(row["predicted_s"] / row["measured_s"] - 1, 3)
            row["within_target"] = abs(row["error"]) <= TARGET
            log(f"{recipe}: measured {row['measured_s']} s, predicted {row['predicted_s']} s "
                f"({row['error']:+.0%}), shipped constants {row['predicted_shipped_s']} s")
            runs.append(row)

    summary = {"constants": measured.to_json(), "points": {k: v for k, v in consts.items() if k.startswith("_")},
               "model": {"arch": "qwen3_moe", "layers": a.layers, **BENCH, "experts": experts},
               "calibration": {"num_samples": a.num_samples, "seq_len": a.seq_len}, "target": TARGET,
               "ok": all(r["within_target"] for r in runs), "machine_label": machine,
               "wall_s": round(time.perf_counter() - t_start, 1), "paste_row": paste_row(measured)}
    rows = [{k: v for k, v in r.items()} for r in runs] or [{"recipe": None, "note": "constants only (not the CPU)"}]
    for r in rows:
        if "error" in r:
            print(f"{r['recipe']}: measured {r['measured_s']} s, predicted {r['predicted_s']} s ({r['error']:+.1%}), "
                  f"shipped-table prediction {r['predicted_shipped_s']} s")
    run.write(rows, summary)
    print(paste_row(measured))
    return 0 if summary["ok"] or a.smoke else 1  # a smoke run checks that it runs: its figures mean nothing


if __name__ == "__main__":
    sys.exit(main())
