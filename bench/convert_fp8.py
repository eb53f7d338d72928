"""Peak memory of `quantkit convert` on a block-FP8 source (the streaming bound).

    python -m bench convert_fp8 [--size-gb 0.45] [--shards 4] [--recipe int4-experts-rtn] [--check] [--smoke]

Builds (once, cached under bench/.cache/) a block-FP8 checkpoint the way the DeepSeek-V3 / Kimi-K2
releases are made — every Linear but the router, embeddings and lm_head in float8_e4m3fn with float32
128x128 `weight_scale_inv` — from convert_rtn's synthetic BF16 qwen3_moe (Qwen3-30B-A3B widths,
random weights). Then runs `quantkit convert FP8 OUT --recipe R --json` as a subprocess and measures the
peak RSS of its process tree (polled every 20 ms, and the kernel's high-water mark of the process).

The FP8 experts are dequantized to BF16 on read and re-quantized to INT4; everything else passes through.
The streaming bound (docs/design.md): peak RSS <= largest source shard + 512 MiB, whatever the model's
size (the source is never dequantized as a whole: per tensor, in row strips). Prints the ratio
`rss_ratio_vs_bound` (target <= 1) and writes bench/results/convert_fp8.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.convert_rtn import SMOKE_ARCH, ARCH, make_checkpoint
from bench.harness import CACHE, MIB, Run, add_common_args, measure_cmd, shard_files, warm_cache

BOUND_SLACK = 512 * MIB
GEN_VERSION = 1


def make_fp8_checkpoint(size_gb: float, shards: int, arch: dict = ARCH) -> Path:
    from quantkit.testing import write_block_fp8_checkpoint

    bf16 = make_checkpoint(size_gb, shards, arch=arch)
    key = hashlib.sha256(f"{bf16.name}-{GEN_VERSION}".encode()).hexdigest()[:10]
    root = CACHE / f"fp8-{bf16.name}-{key}"
    stamp = root / ".complete.json"
    if stamp.is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    write_block_fp8_checkpoint(bf16, root)
    stamp.write_text(json.dumps({"from": str(bf16), "seconds": round(time.perf_counter() - t0, 1)}) + "\n")
    return root


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench convert_fp8", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.45, help="size of the BF16 model the FP8 one is made from")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--recipe", default="int4-experts-rtn")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--check", action="store_true", help="exit 1 if peak RSS exceeds the bound")
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    add_common_args(ap, repeat=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.size_gb, args.shards = 0.01, 2

    if args.make_only:
        print(make_fp8_checkpoint(args.size_gb, args.shards, SMOKE_ARCH if args.smoke else ARCH))
        return 0
    run = Run("convert_fp8", args, argv)
    # Generate in a child process: a child's ru_maxrss includes the RSS its parent had when it forked
    # (Linux keeps the high-water mark across exec), so this process must stay small.
    made = subprocess.run([sys.executable, "-m", "bench", "convert_fp8", "--make-only", "--size-gb", str(args.size_gb),
                           "--shards", str(args.shards), *(["--smoke"] if args.smoke else [])], check=True,
                          capture_output=True, text=True)
    src = Path(made.stdout.strip().splitlines()[-1])
    files = shard_files(src)
    sizes = [f.stat().st_size for f in files]
    total, largest = sum(sizes), max(sizes)
    bound = largest + BOUND_SLACK
    print(f"FP8 checkpoint: {src} ({len(files)} shards, {total / 1e6:.0f} MB, largest {largest / MIB:.0f} MiB)",
          file=sys.stderr)
    out = CACHE / "out-fp8"
    shutil.rmtree(out, ignore_errors=True)
    warm_cache(files)
    cmd = [sys.executable, "-m", "quantkit.cli", "convert", str(src), str(out), "--recipe", args.recipe,
           "--workers", str(args.workers), "--json"]
    print("running: " + " ".join(cmd), file=sys.stderr)
    r = measure_cmd(cmd, check=True)
    r["reported"] = json.loads(r.pop("stdout"))
    peak = max(r["peak_rss_bytes"], r["ru_maxrss_bytes"])
    ratio = peak / bound
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    print(f"input: {len(files)} block-FP8 shards, {total / 1e6:.0f} MB, largest {largest / MIB:.0f} MiB "
          f"-> bound {bound / MIB:.0f} MiB")
    print(f"convert --recipe {args.recipe}: {r['wall_s']:.2f} s wall, peak RSS {peak / MIB:.0f} MiB "
          f"(tree {r['peak_rss_bytes'] / MIB:.0f}, maxrss {r['ru_maxrss_bytes'] / MIB:.0f}); "
          f"{manifest['summary']['modules_quantized']} modules quantized, "
          f"{manifest['summary']['modules_passed_through']} passed through")
    for n in manifest["notes"]:
        print(f"  note: {n}")
    print(f"rss_ratio_vs_bound = {ratio:.3f}   (target <= 1: {'PASS' if ratio <= 1 else 'FAIL'})")
    row = {"recipe": args.recipe, "shards": len(files), "source_mb": round(total / 1e6), "largest_shard_mib":
           round(largest / MIB), "bound_mib": round(bound / MIB), "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
           "tree_rss_mib": round(r["peak_rss_bytes"] / MIB), "maxrss_mib": round(r["ru_maxrss_bytes"] / MIB),
           "rss_ratio_vs_bound": round(ratio, 3), "modules_quantized": manifest["summary"]["modules_quantized"],
           "modules_passed_through": manifest["summary"]["modules_passed_through"]}
    run.write([row], {"checkpoint": str(src), "shard_bytes": sizes, "convert": r})
    shutil.rmtree(out, ignore_errors=True)
    return 1 if args.check and ratio > 1 else 0
