"""Benchmark `quantkit convert --recipe int4-experts-rtn` on a synthetic BF16 MoE checkpoint.

    python -m bench convert_rtn [--size-gb 4] [--shards 8] [--workers 1] [--repeat 1]
                                [--threads N] [--skip-peer] [--check] [--smoke]

In one run, on one input (a qwen3_moe checkpoint of random BF16 weights, >= --size-gb GB in --shards
shards, generated once and cached under bench/.cache/), it measures:

1. `cat` of the source shards into one file on the same disk, page cache warm (one untimed run
   first, then the fastest of `--cat-runs` timed runs): the cost of just moving the bytes;
2. `quantkit convert SRC OUT --recipe ... --json` as a subprocess: wall time, CPU time, and peak
   RSS: the RSS of its process tree (the process and all its descendants, summed) polled every
   ~20 ms, and the kernel's high-water mark of the process (ru_maxrss from wait4); plus the
   `seconds` and `peak_rss_bytes` the tool reports itself;
3. llm-compressor's `model_free_ptq` with the W4A16 preset (INT4 symmetric, weights only), its group
   size set to quantkit's (32), on the same expert targets, as a subprocess in the peer venv made by
   bench/setup_peers.sh (llm-compressor is not a quantkit dependency), measured the same way.

and prints three ratios (the issue's targets):

    rss_ratio_vs_bound       = quantkit peak RSS / (largest source shard + 512 MiB)   pass <= 1
    time_vs_cat              = quantkit wall s / cat wall s                          pass <= 3
    speedup_vs_llmcompressor = llm-compressor wall s / quantkit wall s               pass >= 2

Wall times are of the whole command (interpreter start and imports included), as a user sees them;
with --repeat N each tool runs N times (alternating) and the fastest run counts, the largest RSS.
The CPU seconds other processes used during each timed run are recorded: on a shared machine they
inflate wall times (and torch's OpenMP threads suffer most), so the table warns when they are large.
Results go to bench/results/convert_rtn.json (the harness schema; `--tag T`: convert_rtn-T.json). `--check` exits 1 if a target fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import (CACHE, MIB, REPO, Run, Skip, add_common_args, best_of, machine, measure_cmd, settle,
                           shard_files, synth_qwen3moe, time_cat, warm_cache)

BOUND_SLACK = 512 * MIB

# The expert targets of recipes/int4-experts-rtn.yaml, used for both tools.
EXPERT_TARGETS = [r"re:.*\.mlp\.experts\.\d+\.(gate|up|down)_proj$", r"re:.*\.block_sparse_moe\.experts\.\d+\.w[123]$"]
IGNORE = [r"re:.*shared_expert", r"re:.*\.mlp\.gate$", "lm_head"]

# Synthetic model: qwen3_moe with Qwen3-30B-A3B's hidden/expert widths, fewer experts and layers.
ARCH = dict(vocab_size=32768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=4)
# --smoke: the same model at toy widths (a few MB)
SMOKE_ARCH = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2)
GEN_VERSION = 1  # bump when the generator's output changes


def layers_for(size_bytes: int, arch: dict = ARCH) -> int:
    from bench.harness import numel, qwen3moe_specs

    layers = 1
    while 2 * sum(numel(s) for _, s in qwen3moe_specs(arch, layers)) < size_bytes:
        layers += 1
    return layers


def make_checkpoint(size_gb: float, shards: int, seed: int = 0, arch: dict = ARCH) -> Path:
    """The synthetic checkpoint (>= size_gb GB in `shards` shards), generated once and cached."""
    layers = layers_for(int(size_gb * 1e9), arch)
    params = {"gen_version": GEN_VERSION, "arch": arch, "layers": layers, "shards": shards, "seed": seed}
    return synth_qwen3moe(arch, layers, f"synth-qwen3moe-{layers}L-{shards}s", shards=shards, seed=seed,
                          key_params=params)


def recipe_for(group_size: int) -> str:
    """The shipped recipe for group 32; for another group size, a temporary copy of it (same targets)."""
    if group_size == 32:
        return "int4-experts-rtn"
    text = (REPO / "recipes" / "int4-experts-rtn.yaml").read_text()
    text, n = re.subn(r"group_size: 32\b", f"group_size: {group_size}", text)
    text = text.replace("name: int4-experts-rtn", f"name: int4-experts-rtn-g{group_size}")
    if n != 1:
        raise SystemExit("recipes/int4-experts-rtn.yaml changed shape; update recipe_for() in bench/convert_rtn.py")
    fd, path = tempfile.mkstemp(prefix=f"int4-experts-rtn-g{group_size}-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


# llm-compressor side: the W4A16 preset (INT4, symmetric, group 128, static min-max weights, BF16 scales)
# with group_size replaced by ours, on the same expert targets; CPU, `max_workers` shard threads.
PEER_SCRIPT = r"""
import json, os, sys, time
t0 = time.perf_counter()
os.environ.setdefault("TQDM_DISABLE", "1")
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
from llmcompressor import model_free_ptq
import importlib.metadata as md
src, out, group_size, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
targets, ignore = json.loads(sys.argv[5]), json.loads(sys.argv[6])
preset = preset_name_to_scheme("W4A16", targets)
weights = QuantizationArgs(**{**preset.weights.model_dump(), "group_size": group_size})
scheme = QuantizationScheme(targets=targets, weights=weights)
t1 = time.perf_counter()
model_free_ptq(model_stub=src, save_directory=out, scheme=scheme, ignore=ignore, max_workers=workers, device="cpu")
t2 = time.perf_counter()
print(json.dumps({"import_s": round(t1 - t0, 3), "ptq_s": round(t2 - t1, 3), "llmcompressor": md.version("llmcompressor"),
                  "compressed_tensors": md.version("compressed-tensors"), "torch": md.version("torch"),
                  "weights": weights.model_dump(mode="json")}))
"""


def compare_outputs(qk_out: Path, llmc_out: Path, n: int = 6) -> dict:
    """Check both tools did the same work: quantized module counts, and on a few sampled expert modules
    the fraction of equal INT4 values and equal scales. (llm-compressor divides by the scale in BF16,
    quantkit in FP32, so about 1% of values differ by one step at rounding ties.)"""
    import torch
    from safetensors import safe_open

    def wmap(d):
        return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]

    def nibbles(p):
        return (p.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF

    a, b = wmap(qk_out), wmap(llmc_out)
    packed_a = sorted(k for k in a if k.endswith(".weight_packed"))
    packed_b = sorted(k for k in b if k.endswith(".weight_packed"))
    common = sorted(set(packed_a) & set(packed_b))
    sample = common[:: max(1, len(common) // n)][:n]
    same_q = total_q = same_s = total_s = 0
    for name in sample:
        mod = name[: -len(".weight_packed")]
        got = []
        for d, m in ((qk_out, a), (llmc_out, b)):
            with safe_open(str(d / m[name]), "pt") as f:
                got.append((f.get_tensor(name), f.get_tensor(mod + ".weight_scale")))
        (qa, sa), (qb, sb) = got
        total_q += qa.numel() * 8
        total_s += sa.numel()
        if qa.shape == qb.shape:
            same_q += int((nibbles(qa) == nibbles(qb)).sum())
        if sa.shape == sb.shape:
            same_s += int((sa.float() == sb.float()).sum())
    return {"quantized_modules_quantkit": len(packed_a), "quantized_modules_llmcompressor": len(packed_b),
            "modules_compared": len(sample), "int4_values_equal_frac": round(same_q / max(total_q, 1), 6),
            "scales_equal_frac": round(same_s / max(total_s, 1), 6)}


def _row(tool: str, r: dict, total: int, note: str = "") -> dict:
    return {"tool": tool, "wall_s": r["wall_s"], "gb_per_s": round(total / r["wall_s"] / 1e9, 3),
            "tree_rss_mib": round(r["peak_rss_bytes"] / MIB) if "peak_rss_bytes" in r else None,
            "maxrss_mib": round(r["ru_maxrss_bytes"] / MIB) if "ru_maxrss_bytes" in r else None,
            "cpu_s": r["cpu_s"], "other_cpu_s": r.get("other_cpu_s"), "runs_wall_s": r.get("runs_wall_s", r.get("runs_s")),
            "note": note}


# ---- main --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench convert_rtn", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0, help="minimum checkpoint size in GB (1e9 bytes; default 4)")
    ap.add_argument("--shards", type=int, default=8, help="number of source shards (default 8)")
    ap.add_argument("--workers", type=int, default=1, help="quantkit --workers and llm-compressor max_workers (default 1)")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS for both tools (default: unset, each tool's own default)")
    ap.add_argument("--group-size", type=int, default=32, help="INT4 group size for both tools (default 32, quantkit's)")
    ap.add_argument("--recipe", default=None,
                    help="a shipped RTN recipe instead of int4-experts-rtn (e.g. nvfp4-experts, mxfp4-experts: the "
                         "same streaming bound applies; the llm-compressor comparison is INT4's and is skipped)")
    ap.add_argument("--skip-peer", action="store_true", help="do not run llm-compressor")
    ap.add_argument("--peer-venv", type=Path, default=CACHE / "peer-venv", help="venv made by bench/setup_peers.sh")
    ap.add_argument("--quantkit", default=None, help="quantkit executable (default: the one next to this python)")
    ap.add_argument("--cat-runs", type=int, default=3, help="timed cat runs after the warm-up (the fastest is used)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the converted checkpoints under bench/.cache/")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--tag", default=None, help="result file bench/results/convert_rtn-TAG.json")
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.size_gb, args.shards, args.cat_runs, args.skip_peer = 0.01, 2, 1, True

    if args.make_only:
        print(make_checkpoint(args.size_gb, args.shards, arch=SMOKE_ARCH if args.smoke else ARCH))
        return 0
    run = Run("convert_rtn", args, argv)
    qk_bin = args.quantkit or next((str(p) for p in (Path(sys.executable).parent / "quantkit", REPO / ".venv/bin/quantkit")
                                    if p.exists()), "quantkit")
    peer_py = args.peer_venv / "bin" / "python"
    if not args.skip_peer and not peer_py.exists():
        raise Skip(f"no peer venv at {args.peer_venv}: run bench/setup_peers.sh first, or pass --skip-peer")
    mach = machine()
    # Generate in a child: a measured child's ru_maxrss starts at this process's RSS when it forks (Linux
    # keeps the high-water mark across exec), so this process never imports torch or holds tensors.
    made = subprocess.run([sys.executable, "-m", "bench", "convert_rtn", "--make-only", "--size-gb", str(args.size_gb),
                           "--shards", str(args.shards), *(["--smoke"] if args.smoke else [])], check=True,
                          stdout=subprocess.PIPE, text=True)
    src = Path(made.stdout.strip().splitlines()[-1])
    files = shard_files(src)
    sizes = [f.stat().st_size for f in files]
    total, largest = sum(sizes), max(sizes)
    print(f"checkpoint: {src} ({len(files)} shards, {total / 1e9:.3f} GB, largest {largest / 1e6:.0f} MB)", file=sys.stderr)

    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    warm_cache(files)
    cat = time_cat(files, args.cat_runs)
    print(f"cat: {cat['runs_s']} s", file=sys.stderr)

    qk_out, llmc_out = CACHE / "out-quantkit", CACHE / "out-llmcompressor"
    recipe = args.recipe or recipe_for(args.group_size)
    if args.recipe and args.recipe != "int4-experts-rtn":
        args.skip_peer = True
    qk_py = Path(qk_bin).parent / "python"
    floor = None
    if qk_py.exists():  # what starting the tool costs before it reads a byte
        floor = measure_cmd([str(qk_py), "-c", "import quantkit.cli, quantkit.convert"], env=env)
    qk_cmd = [qk_bin, "convert", str(src), str(qk_out), "--recipe", recipe, "--workers", str(args.workers), "--json"]
    peer_cmd = [str(peer_py), "-c", PEER_SCRIPT, str(src), str(llmc_out), str(args.group_size), str(args.workers),
                json.dumps(EXPERT_TARGETS), json.dumps(IGNORE)]
    qk_runs, llmc_runs = [], []
    for rep in range(args.repeat):
        settle(qk_out)
        warm_cache(files)
        print(f"[{rep + 1}/{args.repeat}] running: " + " ".join(qk_cmd), file=sys.stderr)
        r = measure_cmd(qk_cmd, env=env, check=True, split=True)
        r["reported"] = json.loads(r.pop("stdout"))
        qk_runs.append(r)
        print(f"  {r['wall_s']:.2f} s, cpu {r['cpu_s']:.1f} s, other processes {r['other_cpu_s']:.1f} cpu s", file=sys.stderr)
        if args.skip_peer:
            continue
        settle(llmc_out)
        warm_cache(files)
        print(f"[{rep + 1}/{args.repeat}] running: {peer_py} -c <model_free_ptq W4A16 group {args.group_size}>",
              file=sys.stderr)
        r = measure_cmd(peer_cmd, env=env, check=True)
        r["cmd"] = r["cmd"][:2] + ["<PEER_SCRIPT>"] + r["cmd"][3:]
        r["reported"] = json.loads(r.pop("stdout").strip().splitlines()[-1])
        llmc_runs.append(r)
    qk = best_of(qk_runs)
    llmc = best_of(llmc_runs) if llmc_runs else None
    if llmc:
        llmc["agreement"] = compare_outputs(qk_out, llmc_out)

    bound = largest + BOUND_SLACK
    # the polled tree sum can miss a spike between two polls; the kernel's high-water mark of the main
    # process cannot (but sees one process only): the larger of the two is used
    qk_peak = max(qk["peak_rss_bytes"], qk["ru_maxrss_bytes"])
    ratios = {"rss_ratio_vs_bound": round(qk_peak / bound, 4), "time_vs_cat": round(qk["wall_s"] / cat["wall_s"], 3)}
    if llmc:
        ratios["speedup_vs_llmcompressor"] = round(llmc["wall_s"] / qk["wall_s"], 3)
    targets = {"rss_ratio_vs_bound": ("<=", 1.0), "time_vs_cat": ("<=", 3.0), "speedup_vs_llmcompressor": (">=", 2.0)}
    passed = {k: (v <= targets[k][1] if targets[k][0] == "<=" else v >= targets[k][1]) for k, v in ratios.items()}

    rep = qk["reported"]
    rows = [_row("cat (page cache warm)", cat, total),
            _row("quantkit convert", qk, total, f"self-reported {rep['seconds']:.2f} s, "
                                                f"{rep['peak_rss_bytes'] / MIB:.0f} MiB")]
    if floor:
        rows.append(_row("quantkit imports alone", floor, total, "python -c 'import quantkit.cli, quantkit.convert'"))
    if llmc:
        r = llmc["reported"]
        rows.append(_row(f"llmcompressor {r['llmcompressor']}", llmc, total,
                         f"model_free_ptq {r['ptq_s']:.2f} s + imports {r['import_s']:.2f} s"))
    print(f"\ninput: {len(files)} shards, {total / 1e9:.3f} GB, largest shard {largest / MIB:.0f} MiB "
          f"-> RSS bound {bound / MIB:.0f} MiB; group size {args.group_size}, workers {args.workers}, "
          f"{args.repeat} run(s) each; {mach['cpu_count']} CPUs, {mach['cpu_model']}")
    print(f"{'':<28}{'wall s':>8}{'GB/s':>7}{'treeRSS':>9}{'maxrss':>9}{'cpu s':>8}{'other':>8}  (RSS in MiB)")
    for r in rows:
        print(f"{r['tool']:<28}{r['wall_s']:>8.2f}{r['gb_per_s']:>7.2f}{r['tree_rss_mib'] or '-':>9}"
              f"{r['maxrss_mib'] or '-':>9}{r['cpu_s']:>8.2f}{r['other_cpu_s'] if r['other_cpu_s'] is not None else '-':>8}"
              f"  {r['note']}")
    if llmc:
        ag = llmc["agreement"]
        print(f"outputs: {ag['quantized_modules_quantkit']} vs {ag['quantized_modules_llmcompressor']} modules quantized; "
              f"on {ag['modules_compared']} sampled modules {ag['int4_values_equal_frac']:.2%} of INT4 values and "
              f"{ag['scales_equal_frac']:.2%} of scales equal")
    if any(x and x["other_cpu_s"] > 0.1 * x["wall_s"] for x in (qk, llmc)):
        print("WARNING: other processes used the CPUs during a timed run: its wall time is inflated")
    for k, v in ratios.items():
        op, lim = targets[k]
        print(f"{k} = {v:.3f}   (target {op} {lim:g}: {'PASS' if passed[k] else 'FAIL'})")
    info = {"time_vs_cat_self_reported": round(rep["seconds"] / cat["wall_s"], 3)}
    if llmc:
        info["speedup_vs_llmcompressor_in_process"] = round(llmc["reported"]["ptq_s"] / rep["seconds"], 3)
        info["cpu_ratio_llmcompressor_vs_quantkit"] = round(llmc["cpu_s"] / qk["cpu_s"], 3)
    summary = {"shards": len(files), "total_bytes": total, "largest_shard_bytes": largest, "rss_bound_bytes": bound,
               "num_hidden_layers": json.loads((src / "config.json").read_text())["num_hidden_layers"], **ratios,
               **{f"pass_{k}": v for k, v in passed.items()}, **info, "quantkit": qk, "quantkit_import_floor": floor,
               "llmcompressor": llmc, "cat": cat}
    run.write(rows, summary, tag=args.tag)
    if not args.keep_outputs:
        shutil.rmtree(qk_out, ignore_errors=True)
        shutil.rmtree(llmc_out, ignore_errors=True)
    if recipe.endswith(".yaml"):
        os.unlink(recipe)
    return 1 if args.check and not all(passed.values()) else 0
