"""How GPTQ's cost grows with the model: wall time and peak RSS of a single-process GPTQ convert for 2/4/8
layers x 16/32/64 routed experts, one run each, side by side.

    python -m bench calib_growth                 # 16 x 256 calibration tokens
    python -m bench calib_growth --layers 2 4 --experts 16 32 --samples 8
    python -m bench calib_growth --layers 2 8 --experts 64 --compute-dtypes float32 bfloat16

The models are the bench MoE (bench.harness.bench_moe (qwen3_moe, hidden 512, experts of width 256, top-4, random
BF16 weights) with the layer and expert counts varied; the calibration and the command are calib_dist's
world size 1 (`python -m quantkit convert -r int4-experts-gptq`, one thread). What should hold: wall time
about linear in layers x experts (the statistics and solves are per expert and layer; the forwards grow
with the routed tokens, which do not change with the expert count), and peak RSS flat in the layer count
(the pass holds one layer at a time) and growing with the experts of one layer.
Writes bench/results/calib_growth.json (or under --out) and prints the markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from bench.calib_dist import RECIPE, convert_row
from bench.harness import BENCH_MOE, CACHE, Run, add_common_args, bench_moe, token_rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench calib_growth", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--experts", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--compute-dtypes", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                    help="convert --compute-dtype, each model once per value")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.layers, a.experts, a.samples, a.seq_len = [1, 2], [4], 2, 16
    run = Run("calib_growth", a, argv)
    work = CACHE / "calib-growth-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = token_rows(work / "tokens.jsonl", a.samples, a.seq_len, BENCH_MOE["vocab"])
    rows = []
    for e in a.experts:
        for n in a.layers:
            src = bench_moe(n, e)
            for dt in a.compute_dtypes:
                r = convert_row(1, src, work / "out", data, a.samples, a.seq_len, a.timeout,
                                extra=("--compute-dtype", dt))
                r = {"layers": n, "experts": e, "compute_dtype": dt, "wall_s": r["wall_s"], "convert_s": r["convert_s"],
                     "peak_rss_mib": round(r["peak_rss_bytes"] / 2 ** 20)}
                rows.append(r)
                print(f"{n} layers x {e} experts, {dt}: {r['wall_s']} s wall, {r['convert_s']} s convert, "
                      f"peak RSS {r['peak_rss_mib']} MiB", file=sys.stderr)
    for r in rows:
        same = [x for x in rows if x["compute_dtype"] == r["compute_dtype"]]
        base = min(same, key=lambda x: x["layers"] * x["experts"])
        unit = base["convert_s"] / (base["layers"] * base["experts"])
        r["convert_s_per_layer_expert"] = round(r["convert_s"] / (r["layers"] * r["experts"]), 4)
        r["vs_linear"] = round(r["convert_s"] / (unit * r["layers"] * r["experts"]), 3)
    shutil.rmtree(work, ignore_errors=True)
    run.write(rows, {"model": {"arch": "qwen3_moe", **{k: v for k, v in BENCH_MOE.items() if k != "experts"}},
                     "recipe": RECIPE, "calibration": {"samples": a.samples, "seq_len": a.seq_len}, "threads": 1})
    print(f"GPTQ convert ({RECIPE}), one process, one thread; {a.samples} x {a.seq_len} tokens")
    for r in rows:
        print("  ".join(f"{k} {v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
