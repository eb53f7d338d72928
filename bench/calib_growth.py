"""How GPTQ's cost grows with the model: wall time and peak RSS of a single-process GPTQ convert for 2/4/8
layers x 16/32/64 routed experts, one run each, side by side.

    .venv/bin/python bench/calib_growth.py                 # 16 x 256 calibration tokens
    .venv/bin/python bench/calib_growth.py --layers 2 4 --experts 16 32 --samples 8
    .venv/bin/python bench/calib_growth.py --layers 2 8 --experts 64 --compute-dtypes float32 bfloat16

The models are bench/calib_dist.py's bench MoE (qwen3_moe, hidden 512, experts of width 256, top-4, random
BF16 weights) with the layer and expert counts varied; the calibration and the command are calib_dist.py's
world size 1 (`python -m quantkit convert -r int4-experts-gptq`, one thread). What should hold: wall time
about linear in layers x experts (the statistics and solves are per expert and layer; the forwards grow
with the routed tokens, which do not change with the expert count), and peak RSS flat in the layer count
(the pass holds one layer at a time) and growing with the experts of one layer.
Writes bench/results/calib_growth.json and .md (or under --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from calib_dist import BENCH, CACHE, RECIPE, _dataset, _run, _source  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--experts", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--compute-dtypes", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                    help="convert --compute-dtype, each model once per value")
    a = ap.parse_args(argv)
    work = CACHE / "calib-growth-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = _dataset(work / "tokens.jsonl", a.samples, a.seq_len, BENCH["vocab"])
    rows = []
    for e in a.experts:
        for n in a.layers:
            src = _source(n, e)
            for dt in a.compute_dtypes:
                r = _run(1, src, work / "out", data, a.samples, a.seq_len, a.timeout, extra=("--compute-dtype", dt))
                r = {"layers": n, "experts": e, "compute_dtype": dt, **r}
                rows.append(r)
                print(f"{n} layers x {e} experts, {dt}: {r['wall_s']} s wall, {r['convert_s']} s convert, "
                      f"peak RSS {r['peak_rss_bytes'] / 2 ** 20:.0f} MiB", file=sys.stderr)
    for r in rows:
        same = [x for x in rows if x["compute_dtype"] == r["compute_dtype"]]
        base = min(same, key=lambda x: x["layers"] * x["experts"])
        unit = base["convert_s"] / (base["layers"] * base["experts"])
        r["convert_s_per_layer_expert"] = round(r["convert_s"] / (r["layers"] * r["experts"]), 4)
        r["vs_linear"] = round(r["convert_s"] / (unit * r["layers"] * r["experts"]), 3)
    doc = {"model": {"arch": "qwen3_moe", **{k: v for k, v in BENCH.items() if k != "experts"}}, "recipe": RECIPE,
           "calibration": {"samples": a.samples, "seq_len": a.seq_len}, "threads": 1, "cpus": os.cpu_count(),
           "runs": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "calib_growth.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"GPTQ convert ({RECIPE}), one process, one thread; {a.samples} x {a.seq_len} tokens; hidden "
             f"{BENCH['hidden']}, experts of width {BENCH['moe_intermediate']}, top-{BENCH['num_experts_per_tok']}.", "",
             "| layers | experts | compute dtype | wall (s) | convert (s) | convert s per layer x expert | "
             "vs linear from the smallest | peak RSS (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['experts']} | {r['compute_dtype']} | {r['wall_s']} | {r['convert_s']} | "
                     f"{r['convert_s_per_layer_expert']} | {r['vs_linear']}x | {r['peak_rss_bytes'] / 2 ** 20:.0f} |")
    table = "\n".join(lines)
    (a.out / "calib_growth.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
