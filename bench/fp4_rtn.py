"""FP4 RTN against INT4 RTN, fused kernel against torch path, side by side in one run.

    python -m bench fp4_rtn [--size-gb 0.5] [--shards 2] [--repeat 3] [--skip-convert] [--smoke]

1. Per tensor, in this process: one layer's stacked expert weights of convert_rtn's synthetic
   qwen3_moe ([32, 768, 2048] bf16, random N(0, 0.02), 100 MB), quantized by INT4 RTN (group 32,
   packed), NVFP4 RTN (global scale per expert included) and MXFP4 RTN, each with the fused numba
   kernel and with the torch path (`native=False`), on one thread (torch and kernel). Also NVFP4 with
   fitted scales (`scale_search: mse`, the default for INT4 sources), kernel and torch. The fastest of
   --repeat runs, as MB/s of bf16 input. The kernel's output is checked equal to the torch path's.
2. `quantkit convert` of the synthetic checkpoint (>= --size-gb, bench/.cache/) as subprocesses with
   int4-experts-rtn, nvfp4-experts and mxfp4-experts, the FP4 ones with QUANTKIT_NATIVE=1 and 0, beside
   `cat` of the same shards; rounds interleaved, the fastest of --repeat per case. Wall time includes
   interpreter start and imports, as a user sees it. Output shards with and without the kernel are
   compared by sha256.

Timings on a shared machine are noisy: every case runs in the same invocation, interleaved, and the
other processes' CPU seconds during each convert are recorded. Results: bench/results/fp4_rtn.json.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

from bench.convert_rtn import ARCH, SMOKE_ARCH, make_checkpoint
from bench.harness import CACHE, Run, add_common_args, measure_cmd, settle, shard_files, time_cat, warm_cache


def per_tensor(repeat: int, shape=(32, 768, 2048)) -> list[dict]:
    import torch

    from quantkit.quant import fp4, int4

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)  # [E, N, K]
    mb = w.numel() * 2 / 1e6
    cases = {
        "int4 g32 kernel": lambda: int4.rtn(w, 4, 32, True, pack=True),
        "int4 g32 torch": lambda: int4.rtn(w, 4, 32, True, pack=True, native=False),
        "nvfp4 kernel": lambda: fp4.rtn_nvfp4(w),
        "nvfp4 torch": lambda: fp4.rtn_nvfp4(w, native=False),
        "mxfp4 kernel": lambda: fp4.rtn_mxfp4(w),
        "mxfp4 torch": lambda: fp4.rtn_mxfp4(w, native=False),
        "nvfp4 mse kernel": lambda: fp4.rtn_nvfp4(w, scale_search="mse"),
        "nvfp4 mse torch": lambda: fp4.rtn_nvfp4(w, scale_search="mse", native=False),
    }
    out = {name: {"case": name, "runs_s": []} for name in cases}
    results = {}
    with int4.native_threads(1):
        for name, fn in cases.items():  # warm-up (numba loads its cache) and the outputs to compare
            results[name] = fn()
        for _ in range(repeat):
            for name, fn in cases.items():
                if name.endswith("mse torch") and out[name]["runs_s"]:
                    continue  # slow: one timed run
                t0 = time.perf_counter()
                fn()
                out[name]["runs_s"].append(round(time.perf_counter() - t0, 4))
    for fmt in ("int4 g32", "nvfp4", "mxfp4", "nvfp4 mse"):
        a, b = results[f"{fmt} kernel"], results[f"{fmt} torch"]
        same = torch.equal(a.q, b.q) if fmt.startswith("int4") else (
            torch.equal(a.packed, b.packed) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8)))
        out[f"{fmt} kernel"]["identical_to_torch"] = same
    for r in out.values():
        r["best_s"] = min(r["runs_s"])
        r["mb_per_s"] = round(mb / r["best_s"], 1)
    return list(out.values())


def _tree_hash(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.glob("*.safetensors")):
        h.update(p.name.encode())
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:16]


def converts(size_gb: float, shards: int, repeat: int, arch: dict = ARCH, smoke: bool = False) -> dict:
    src = make_checkpoint(size_gb, shards, arch=arch)
    files = shard_files(src)
    warm_cache(files)
    cases = [("int4-experts-rtn", "1"), ("nvfp4-experts", "1"), ("nvfp4-experts", "0"),
             ("mxfp4-experts", "1"), ("mxfp4-experts", "0")]
    if smoke:  # the kernel and the torch path once each
        cases = [("nvfp4-experts", "1"), ("nvfp4-experts", "0")]
    runs = {f"{r} native={n}": [] for r, n in cases}
    hashes = {}
    work = CACHE / "fp4_rtn"
    cat = time_cat(files, 2)
    for k in range(repeat):
        for recipe, native in cases:
            key = f"{recipe} native={native}"
            out = work / key.replace(" ", "_").replace("=", "")
            settle(out)
            cmd = [sys.executable, "-m", "quantkit.cli", "convert", str(src), str(out), "--recipe", recipe, "--json"]
            r = measure_cmd(cmd, env={**os.environ, "QUANTKIT_NATIVE": native}, check=True)
            runs[key].append({k2: r[k2] for k2 in ("wall_s", "cpu_s", "other_cpu_s", "peak_rss_bytes")})
            hashes[key] = _tree_hash(out)
    table = []
    for key, rs in runs.items():
        best = min(rs, key=lambda x: x["wall_s"])
        table.append({"case": key, **best, "runs_wall_s": [x["wall_s"] for x in rs], "tree_hash": hashes[key],
                      "x_cat": round(best["wall_s"] / cat["wall_s"], 2)})
    same = {fmt: hashes[f"{fmt} native=1"] == hashes[f"{fmt} native=0"] for fmt in ("nvfp4-experts", "mxfp4-experts")
            if f"{fmt} native=0" in hashes}
    size = sum(f.stat().st_size for f in files)
    return {"source": str(src), "source_bytes": size, "cat": cat, "converts": table, "kernel_same_bytes": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fp4_rtn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.5, help="synthetic checkpoint size (default 0.5: one layer)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--skip-convert", action="store_true", help="per-tensor figures only")
    add_common_args(ap, repeat=3)
    args = ap.parse_args(argv)
    shape, arch = (32, 768, 2048), ARCH
    if args.smoke:
        shape, arch, args.size_gb, args.repeat = (4, 64, 256), SMOKE_ARCH, 0.01, 1
    run = Run("fp4_rtn", args, argv)
    rows = [{"part": "per tensor", **r} for r in per_tensor(args.repeat, shape)]
    print(f"per tensor: {list(shape)} bf16, 1 thread, best of {args.repeat}")
    for r in rows:
        same = "" if "identical_to_torch" not in r else f"  identical to torch: {r['identical_to_torch']}"
        print(f"  {r['case']:<18} {r['best_s']:8.3f} s {r['mb_per_s']:8.1f} MB/s{same}")
    summary = {"per_tensor_shape": list(shape)}
    if not args.skip_convert:
        c = converts(args.size_gb, args.shards, args.repeat, arch, args.smoke)
        print(f"convert: {c['source_bytes'] / 1e9:.2f} GB source, cat {c['cat']['wall_s']:.2f} s, best of {args.repeat}")
        for r in c["converts"]:
            print(f"  {r['case']:<28} {r['wall_s']:7.2f} s  {r['x_cat']:5.2f}x cat  cpu {r['cpu_s']:6.1f} s  "
                  f"others' cpu {r['other_cpu_s']:6.1f} s  {r['runs_wall_s']}")
        print(f"  same shard bytes with and without the kernel: {c['kernel_same_bytes']}")
        rows += [{"part": "convert", **r} for r in c.pop("converts")]
        summary.update(c)
    run.write(rows, summary)
    return 0
