"""Peak memory of `quantkit convert` on a block-FP8 source (the streaming bound).

    .venv/bin/python bench/convert_fp8.py [--size-gb 0.45] [--shards 4] [--recipe int4-experts-rtn] [--check]

Builds (once, cached under bench/.cache/) a block-FP8 checkpoint the way the DeepSeek-V3 / Kimi-K2
releases are made — every Linear but the router, embeddings and lm_head in float8_e4m3fn with float32
128x128 `weight_scale_inv` — from bench/convert_rtn.py's synthetic BF16 qwen3_moe (Qwen3-30B-A3B widths,
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from convert_rtn import CACHE, MIB, machine, make_checkpoint, run_measured, shard_files, warm_cache  # noqa: E402

RESULTS = HERE / "results" / "convert_fp8.json"
BOUND_SLACK = 512 * MIB
GEN_VERSION = 1


def make_fp8_checkpoint(size_gb: float, shards: int) -> Path:
    from quantkit.testing import write_block_fp8_checkpoint

    bf16 = make_checkpoint(size_gb, shards)
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.45, help="size of the BF16 model the FP8 one is made from")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--recipe", default="int4-experts-rtn")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--check", action="store_true", help="exit 1 if peak RSS exceeds the bound")
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.make_only:
        print(make_fp8_checkpoint(args.size_gb, args.shards))
        return 0
    # Generate in a child process: a child's ru_maxrss includes the RSS its parent had when it forked
    # (Linux keeps the high-water mark across exec), so this process must stay small.
    made = subprocess.run([sys.executable, __file__, "--make-only", "--size-gb", str(args.size_gb),
                           "--shards", str(args.shards)], check=True, capture_output=True, text=True)
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
    logs = CACHE / "logs"
    r = run_measured(cmd, logs / "convert_fp8.stderr", stdout_path=logs / "convert_fp8.stdout")
    if r["rc"] != 0:
        print(f"convert failed (rc {r['rc']}); see {r['log']}", file=sys.stderr)
        return 1
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
    doc = {"machine": machine(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "checkpoint": {"path": str(src), "shards": len(files), "total_bytes": total, "largest_shard_bytes": largest,
                          "shard_bytes": sizes},
           "rss_bound_bytes": bound, "convert": r, "peak_rss_bytes": peak, "rss_ratio_vs_bound": ratio,
           "unix_time": int(time.time())}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"results: {args.results}")
    shutil.rmtree(out, ignore_errors=True)
    return 1 if args.check and ratio > 1 else 0


if __name__ == "__main__":
    sys.exit(main())
