"""Benchmark `quantkit convert --recipe int4-experts-rtn` on a synthetic BF16 MoE checkpoint.

    .venv/bin/python bench/convert_rtn.py [--size-gb 4] [--shards 8] [--workers 1] [--repeat 1]
                                          [--threads N] [--skip-peer] [--check]

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
Results (with the machine) go to bench/results/convert_rtn.json. `--check` exits 1 if a target fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE = HERE / ".cache"
RESULTS = HERE / "results" / "convert_rtn.json"
MIB = 1 << 20
BOUND_SLACK = 512 * MIB
POLL_S = 0.02

# The expert targets of recipes/int4-experts-rtn.yaml, used for both tools.
EXPERT_TARGETS = [r"re:.*\.mlp\.experts\.\d+\.(gate|up|down)_proj$", r"re:.*\.block_sparse_moe\.experts\.\d+\.w[123]$"]
IGNORE = [r"re:.*shared_expert", r"re:.*\.mlp\.gate$", "lm_head"]

# Synthetic model: qwen3_moe with Qwen3-30B-A3B's hidden/expert widths, fewer experts and layers.
ARCH = dict(vocab_size=32768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=4)
GEN_VERSION = 1  # bump when the generator's output changes


# ---- synthetic checkpoint ----------------------------------------------------------------------------
def tensor_specs(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the qwen3_moe model, in module order (as HF shards them)."""
    a = ARCH
    h, hd, e, i = a["hidden_size"], a["head_dim"], a["num_experts"], a["moe_intermediate_size"]
    q, kv = a["num_attention_heads"] * hd, a["num_key_value_heads"] * hd
    specs = [("model.embed_tokens.weight", (a["vocab_size"], h))]
    for L in range(layers):
        p = f"model.layers.{L}"
        specs += [(f"{p}.input_layernorm.weight", (h,)),
                  (f"{p}.self_attn.q_proj.weight", (q, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                  (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, q)),
                  (f"{p}.self_attn.q_norm.weight", (hd,)), (f"{p}.self_attn.k_norm.weight", (hd,)),
                  (f"{p}.post_attention_layernorm.weight", (h,)), (f"{p}.mlp.gate.weight", (e, h))]
        for x in range(e):
            specs += [(f"{p}.mlp.experts.{x}.gate_proj.weight", (i, h)), (f"{p}.mlp.experts.{x}.up_proj.weight", (i, h)),
                      (f"{p}.mlp.experts.{x}.down_proj.weight", (h, i))]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (a["vocab_size"], h))]
    return specs


def nbytes(shape) -> int:
    n = 2  # bf16
    for s in shape:
        n *= s
    return n


def layers_for(size_bytes: int) -> int:
    layers = 1
    while sum(nbytes(s) for _, s in tensor_specs(layers)) < size_bytes:
        layers += 1
    return layers


def split_shards(specs, shards: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Contiguous runs of tensors, cut where the running total crosses k/shards of the whole."""
    total = sum(nbytes(s) for _, s in specs)
    out, cur, acc = [], [], 0
    for name, shape in specs:
        cur.append((name, shape))
        acc += nbytes(shape)
        if len(out) < shards - 1 and acc >= total * (len(out) + 1) / shards:
            out.append(cur)
            cur = []
    out.append(cur)
    if len(out) != shards or not all(out):
        raise SystemExit(f"cannot split {len(specs)} tensors into {shards} shards")
    return out


def make_checkpoint(size_gb: float, shards: int, seed: int = 0) -> Path:
    """Generate (or reuse) the synthetic checkpoint; returns its directory. Never holds more than one
    shard's tensors in memory: tensors are drawn per name from a seeded generator and each shard is
    written with safetensors directly (no model object)."""
    layers = layers_for(int(size_gb * 1e9))
    params = {"gen_version": GEN_VERSION, "arch": ARCH, "layers": layers, "shards": shards, "seed": seed}
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    root = CACHE / f"synth-qwen3moe-{layers}L-{shards}s-{key}"
    stamp = root / ".complete.json"
    if stamp.is_file():
        return root
    import torch
    import transformers
    from safetensors.torch import save_file

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    transformers.logging.set_verbosity_error()
    cfg = transformers.Qwen3MoeConfig(**ARCH, num_hidden_layers=layers, decoder_sparse_step=1, mlp_only_layers=[],
                                      tie_word_embeddings=False, max_position_embeddings=4096, dtype="bfloat16")
    cfg.save_pretrained(root)
    parts = split_shards(tensor_specs(layers), shards)
    weight_map, total = {}, 0
    t0 = time.perf_counter()
    for k, part in enumerate(parts):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for name, shape in part:
            if len(shape) == 1:
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * 2
        tmp = root / f".{fname}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, root / fname)
        print(f"  generated {fname} ({(root / fname).stat().st_size / 1e6:.0f} MB)", file=sys.stderr)
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    stamp.write_text(json.dumps({**params, "seconds": round(time.perf_counter() - t0, 1)}) + "\n")
    return root


def shard_files(root: Path) -> list[Path]:
    return sorted(root.glob("model-*.safetensors"))


# ---- measurement -------------------------------------------------------------------------------------
def tree_rss(proc: psutil.Process) -> int:
    total = 0
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return total


def run_measured(cmd: list[str], log: Path, env: dict | None = None, stdout_path: Path | None = None) -> dict:
    """Run `cmd`; return its wall seconds, the peak RSS of its process tree (RSS of the process and all
    its descendants summed, polled every POLL_S), the kernel's high-water mark for the process
    (ru_maxrss from wait4: the largest single process, catching spikes between polls), its CPU seconds,
    and the CPU seconds other processes on the machine used meanwhile (contention makes times noisy)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out_f = open(stdout_path, "wb") if stdout_path else subprocess.DEVNULL
    sys_cpu0 = psutil.cpu_times()
    with open(log, "wb") as err_f:
        t0 = time.perf_counter()
        popen = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, env=env)
        proc = psutil.Process(popen.pid)
        peak, samples, split = 0, 0, {}
        while True:
            pid, status, ru = os.wait4(popen.pid, os.WNOHANG)
            if pid:
                break
            peak = max(peak, tree_rss(proc))
            split = rss_split(popen.pid, split)
            samples += 1
            time.sleep(POLL_S)
        wall = time.perf_counter() - t0
    popen.returncode = os.waitstatus_to_exitcode(status)
    sys_cpu1 = psutil.cpu_times()
    if stdout_path:
        out_f.close()
    busy = sum(getattr(sys_cpu1, f) - getattr(sys_cpu0, f) for f in ("user", "nice", "system", "irq", "softirq", "steal")
               if hasattr(sys_cpu1, f))
    cpu = ru.ru_utime + ru.ru_stime
    res = {"cmd": cmd, "rc": popen.returncode, "wall_s": round(wall, 3), "peak_rss_bytes": peak,
           "rss_samples": samples, "ru_maxrss_bytes": ru.ru_maxrss * 1024, "cpu_s": round(cpu, 2),
           "other_cpu_s": round(max(0.0, busy - cpu), 2), "log": str(log), "rss_split": split}
    if stdout_path:
        res["stdout"] = stdout_path.read_text(errors="replace")
    return res


SPLIT_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def rss_split(pid: int, split: dict) -> dict:
    """What the process's resident memory is made of (Linux /proc/PID/status, the process itself, not its
    children): `peak_*` the largest polled value of each field, `at_peak_*` the fields at the sample where
    VmRSS peaked, `VmHWM` the kernel's own high-water mark (exact, also between polls). RssAnon is
    tensors and malloc arenas; RssFile is mapped files: shared libraries and source shards read through
    mmap, whose pages count as long as their mapping lives."""
    now = proc_status(pid, SPLIT_FIELDS)
    if not now:
        return split
    out = dict(split)
    for k, v in now.items():
        out[f"peak_{k}"] = max(out.get(f"peak_{k}", 0), v)
    if now.get("VmRSS", 0) >= out.get("at_peak_VmRSS", 0):
        out.update({f"at_peak_{k}": v for k, v in now.items()})
    return out


def proc_status(pid: int, fields) -> dict[str, int] | None:
    """The `fields` of /proc/PID/status in bytes (None: the process is gone). The one reader of it in bench/."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in fields:
            out[key] = int(rest.split()[0]) * 1024
    return out


def warm_cache(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def _wait_rusage(popen: subprocess.Popen):
    _, status, ru = os.wait4(popen.pid, 0)
    popen.returncode = os.waitstatus_to_exitcode(status)
    return ru


def settle(*dirs: Path) -> None:
    """Before each timed run: remove the tool's earlier output and flush dirty pages to disk, so that no
    run pays for the writeback of the previous one (quantkit fsyncs its shards before it finishes; cat and
    llm-compressor do not, and would leave their writes in flight)."""
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    os.sync()


def time_cat(files: list[Path], runs: int) -> dict:
    """`cat shards > one file` on the same disk: an untimed warm-up, then `runs` timed runs (the
    fastest is used, like the tools' runs)."""
    dst = CACHE / "cat-out.bin"
    cmd = ["cat", *map(str, files)]
    times, cpus = [], []
    try:
        for k in range(runs + 1):  # run 0 is the untimed warm-up
            dst.unlink(missing_ok=True)
            settle()
            with open(dst, "wb") as out:
                t0 = time.perf_counter()
                popen = subprocess.Popen(cmd, stdout=out)
                ru = _wait_rusage(popen)
                dt = time.perf_counter() - t0
            if popen.returncode:
                raise SystemExit(f"cat failed (rc {popen.returncode})")
            if k:
                times.append(round(dt, 3))
                cpus.append(round(ru.ru_utime + ru.ru_stime, 3))
    finally:
        dst.unlink(missing_ok=True)
    return {"cmd": f"cat <{len(files)} shards> > {dst}", "runs_s": times, "cpu_runs_s": cpus, "wall_s": min(times),
            "cpu_s": min(cpus)}


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


def machine() -> dict:
    """The machine, without importing torch (this process must stay small: see run_measured)."""
    import importlib.metadata as md

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        torch_version = None
    return {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cpu_model": model or platform.processor(),
            "mem_total_bytes": psutil.virtual_memory().total, "python": platform.python_version(),
            "torch": torch_version, "platform": platform.platform(), "quantkit_git": _git_state()}


def _git_state() -> str:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "quantkit"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _src_digest() -> str:
    """Short hash of quantkit's sources as they were when measured (the tree may be edited meanwhile)."""
    h = hashlib.sha256()
    for p in sorted((REPO / "quantkit").rglob("*.py")):
        h.update(p.relative_to(REPO).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]


def _best(runs: list[dict]) -> dict:
    """The fastest run's figures, with the largest peak RSS of all runs."""
    best = dict(min(runs, key=lambda r: r["wall_s"]))
    best["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)
    best["ru_maxrss_bytes"] = max(r["ru_maxrss_bytes"] for r in runs)
    best["runs_wall_s"] = [r["wall_s"] for r in runs]
    return best


# ---- main --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0, help="minimum checkpoint size in GB (1e9 bytes; default 4)")
    ap.add_argument("--shards", type=int, default=8, help="number of source shards (default 8)")
    ap.add_argument("--workers", type=int, default=1, help="quantkit --workers and llm-compressor max_workers (default 1)")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS for both tools (default: unset, each tool's own default)")
    ap.add_argument("--group-size", type=int, default=32, help="INT4 group size for both tools (default 32, quantkit's)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each tool, alternating; the fastest is used")
    ap.add_argument("--recipe", default=None,
                    help="a shipped RTN recipe instead of int4-experts-rtn (e.g. nvfp4-experts, mxfp4-experts: the "
                         "same streaming bound applies; the llm-compressor comparison is INT4's and is skipped)")
    ap.add_argument("--skip-peer", action="store_true", help="do not run llm-compressor")
    ap.add_argument("--peer-venv", type=Path, default=CACHE / "peer-venv", help="venv made by bench/setup_peers.sh")
    ap.add_argument("--quantkit", default=None, help="quantkit executable (default: the one next to this python, "
                                                      "else .venv/bin/quantkit)")
    ap.add_argument("--cat-runs", type=int, default=3, help="timed cat runs after the warm-up (the fastest is used)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the converted checkpoints under bench/.cache/")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.make_only:
        print(make_checkpoint(args.size_gb, args.shards))
        return 0

    qk_bin = args.quantkit or next((str(p) for p in (Path(sys.executable).parent / "quantkit", REPO / ".venv/bin/quantkit")
                                    if p.exists()), "quantkit")
    peer_py = args.peer_venv / "bin" / "python"
    if not args.skip_peer and not peer_py.exists():
        print(f"no peer venv at {args.peer_venv}: run bench/setup_peers.sh first, or pass --skip-peer", file=sys.stderr)
        return 2

    mach = machine()
    print(f"machine: {mach['cpu_count']} CPUs ({mach['cpu_model']}), {mach['mem_total_bytes'] / 2**30:.1f} GiB RAM",
          file=sys.stderr)
    # Generate in a child: a measured child's ru_maxrss starts at this process's RSS when it forks (Linux
    # keeps the high-water mark across exec), so this process never imports torch or holds tensors.
    made = subprocess.run([sys.executable, __file__, "--make-only", "--size-gb", str(args.size_gb),
                           "--shards", str(args.shards)], check=True, stdout=subprocess.PIPE, text=True)
    src = Path(made.stdout.strip().splitlines()[-1])
    files = shard_files(src)
    sizes = [f.stat().st_size for f in files]
    total, largest = sum(sizes), max(sizes)
    print(f"checkpoint: {src} ({len(files)} shards, {total / 1e9:.3f} GB, largest {largest / 1e6:.0f} MB)", file=sys.stderr)

    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    load0 = os.getloadavg()
    warm_cache(files)
    cat = time_cat(files, args.cat_runs)
    print(f"cat: {cat['runs_s']} s", file=sys.stderr)

    logs = CACHE / "logs"
    qk_out, llmc_out = CACHE / "out-quantkit", CACHE / "out-llmcompressor"
    recipe = args.recipe or recipe_for(args.group_size)
    if args.recipe and args.recipe != "int4-experts-rtn":
        args.skip_peer = True
    qk_py = Path(qk_bin).parent / "python"
    floor = None
    if qk_py.exists():  # what starting the tool costs before it reads a byte
        floor = run_measured([str(qk_py), "-c", "import quantkit.cli, quantkit.convert"], logs / "quantkit-import.stderr",
                             env=env)
    qk_cmd = [qk_bin, "convert", str(src), str(qk_out), "--recipe", recipe, "--workers", str(args.workers), "--json"]
    peer_cmd = [str(peer_py), "-c", PEER_SCRIPT, str(src), str(llmc_out), str(args.group_size), str(args.workers),
                json.dumps(EXPERT_TARGETS), json.dumps(IGNORE)]
    qk_runs, llmc_runs = [], []
    src_digest = _src_digest()
    for rep in range(args.repeat):
        settle(qk_out)
        warm_cache(files)
        print(f"[{rep + 1}/{args.repeat}] running: " + " ".join(qk_cmd), file=sys.stderr)
        r = run_measured(qk_cmd, logs / "quantkit.stderr", env=env, stdout_path=logs / "quantkit.stdout")
        if r["rc"] != 0:
            print(f"quantkit failed (rc {r['rc']}); see {r['log']}", file=sys.stderr)
            return 1
        r["reported"] = json.loads(r.pop("stdout"))
        qk_runs.append(r)
        print(f"  {r['wall_s']:.2f} s, cpu {r['cpu_s']:.1f} s, other processes {r['other_cpu_s']:.1f} cpu s", file=sys.stderr)
        if args.skip_peer:
            continue
        settle(llmc_out)
        warm_cache(files)
        print(f"[{rep + 1}/{args.repeat}] running: {peer_py} -c <model_free_ptq W4A16 group {args.group_size}> "
              f"{src} {llmc_out}", file=sys.stderr)
        r = run_measured(peer_cmd, logs / "llmcompressor.stderr", env=env, stdout_path=logs / "llmcompressor.stdout")
        if r["rc"] != 0:
            print(f"llm-compressor failed (rc {r['rc']}); see {r['log']}", file=sys.stderr)
            return 1
        r["cmd"] = r["cmd"][:2] + ["<PEER_SCRIPT>"] + r["cmd"][3:]
        r["reported"] = json.loads(r.pop("stdout").strip().splitlines()[-1])
        llmc_runs.append(r)
        print(f"  {r['wall_s']:.2f} s, cpu {r['cpu_s']:.1f} s, other processes {r['other_cpu_s']:.1f} cpu s", file=sys.stderr)
    load1 = os.getloadavg()
    qk = _best(qk_runs)
    llmc = _best(llmc_runs) if llmc_runs else None
    if llmc:
        llmc["agreement"] = compare_outputs(qk_out, llmc_out)

    bound = largest + BOUND_SLACK
    # the polled tree sum can miss a spike between two polls; the kernel's high-water mark of the main
    # process cannot (but sees one process only): the larger of the two is used
    qk_peak = max(qk["peak_rss_bytes"], qk["ru_maxrss_bytes"])
    ratios = {"rss_ratio_vs_bound": qk_peak / bound, "time_vs_cat": qk["wall_s"] / cat["wall_s"]}
    if llmc:
        ratios["speedup_vs_llmcompressor"] = llmc["wall_s"] / qk["wall_s"]
    targets = {"rss_ratio_vs_bound": ("<=", 1.0), "time_vs_cat": ("<=", 3.0), "speedup_vs_llmcompressor": (">=", 2.0)}
    passed = {k: (v <= targets[k][1] if targets[k][0] == "<=" else v >= targets[k][1]) for k, v in ratios.items()}

    # ---- report
    def row(name, r, note=""):
        if r is cat:
            print(f"{name:<24}{r['wall_s']:>8.2f}{total / r['wall_s'] / 1e9:>7.2f}{'-':>9}{'-':>9}{r['cpu_s']:>8.2f}"
                  f"{'-':>8}  {note}")
            return
        print(f"{name:<24}{r['wall_s']:>8.2f}{total / r['wall_s'] / 1e9:>7.2f}{r['peak_rss_bytes'] / MIB:>9.0f}"
              f"{r['ru_maxrss_bytes'] / MIB:>9.0f}{r['cpu_s']:>8.2f}{r['other_cpu_s']:>8.1f}  {note}")

    print()
    print(f"input: {len(files)} shards, {total / 1e9:.3f} GB, largest shard {largest / MIB:.0f} MiB "
          f"-> RSS bound {bound / MIB:.0f} MiB; group size {args.group_size}, workers {args.workers}, "
          f"OMP_NUM_THREADS {env.get('OMP_NUM_THREADS', 'unset')}, {args.repeat} run(s) each")
    print(f"machine: {mach['cpu_count']} CPUs, {mach['cpu_model']}, {mach['mem_total_bytes'] / 2**30:.1f} GiB RAM; "
          f"load avg {load0[0]:.1f} -> {load1[0]:.1f}; quantkit {mach['quantkit_git']} (src {src_digest})")
    print(f"{'':<24}{'wall s':>8}{'GB/s':>7}{'treeRSS':>9}{'maxrss':>9}{'cpu s':>8}{'other':>8}  (RSS in MiB)")
    row("cat (page cache warm)", cat, f"runs {cat['runs_s']}")
    rep = qk["reported"]
    row("quantkit convert", qk, f"runs {qk['runs_wall_s']}; self-reported {rep['seconds']:.2f} s, "
                                f"peak_rss_bytes {rep['peak_rss_bytes'] / MIB:.0f} MiB")
    if floor:
        print(f"{'  (its imports alone)':<24}{floor['wall_s']:>8.2f}{'':>7}{floor['peak_rss_bytes'] / MIB:>9.0f}"
              f"{floor['ru_maxrss_bytes'] / MIB:>9.0f}{floor['cpu_s']:>8.2f}{floor['other_cpu_s']:>8.1f}  "
              f"python -c 'import quantkit.cli, quantkit.convert'")
    if llmc:
        r = llmc["reported"]
        row(f"llmcompressor {r['llmcompressor']}", llmc, f"runs {llmc['runs_wall_s']}; model_free_ptq {r['ptq_s']:.2f} s "
                                                          f"+ imports {r['import_s']:.2f} s")
        ag = llmc["agreement"]
        print(f"outputs: {ag['quantized_modules_quantkit']} vs {ag['quantized_modules_llmcompressor']} modules quantized; "
              f"on {ag['modules_compared']} sampled modules {ag['int4_values_equal_frac']:.2%} of INT4 values and "
              f"{ag['scales_equal_frac']:.2%} of scales equal")
    print("treeRSS: polled sum over the process tree; maxrss: kernel high-water mark of the main process; "
          "other: CPU s other processes used meanwhile")
    if any(x and x["other_cpu_s"] > 0.1 * x["wall_s"] for x in (qk, llmc)):
        print("WARNING: other processes used the CPUs during a timed run: its wall time is inflated "
              "(rerun on an idle machine)")
    print()
    for k, v in ratios.items():
        op, lim = targets[k]
        print(f"{k} = {v:.3f}   (target {op} {lim:g}: {'PASS' if passed[k] else 'FAIL'})")
    info = {"time_vs_cat_self_reported": rep["seconds"] / cat["wall_s"]}
    if llmc:
        info["speedup_vs_llmcompressor_in_process"] = llmc["reported"]["ptq_s"] / rep["seconds"]
        info["cpu_ratio_llmcompressor_vs_quantkit"] = llmc["cpu_s"] / qk["cpu_s"]
    print("(for reference: " + ", ".join(f"{k} = {v:.3f}" for k, v in info.items()) + ")")

    doc = {"machine": mach, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "quantkit_src_digest": src_digest, "loadavg_before_after": [load0, load1],
           "checkpoint": {"path": str(src), "shards": len(files), "total_bytes": total, "largest_shard_bytes": largest,
                          "shard_bytes": sizes, "arch": "qwen3_moe", **ARCH,
                          "num_hidden_layers": json.loads((src / "config.json").read_text())["num_hidden_layers"]},
           "rss_bound_bytes": bound, "cat": cat, "quantkit_import_floor": floor, "quantkit": qk, "quantkit_runs": qk_runs,
           "llmcompressor": llmc, "llmcompressor_runs": llmc_runs, "ratios": ratios, "pass": passed, "info": info,
           "unix_time": int(time.time())}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"results: {args.results}")
    if not args.keep_outputs:
        shutil.rmtree(qk_out, ignore_errors=True)
        shutil.rmtree(llmc_out, ignore_errors=True)
    if recipe.endswith(".yaml"):
        os.unlink(recipe)
    return 1 if args.check and not all(passed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
