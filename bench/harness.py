"""The one harness every benchmark in bench/ runs on.

- measuring: `measure_cmd` runs a command as a subprocess and `measure_fn` calls a function in this process;
  both return wall seconds, CPU seconds, peak RSS and the load average before and after (a shared machine
  inflates wall times: the load says how much else ran);
- the machine, described once (`machine()`): CPU model and the flags that decide kernels (avx2, avx512f,
  avx512_bf16, amx_tile, ...), cores, memory, Python and torch versions;
- scratch directories (`scratch_dir`), removed at exit unless the user names one;
- synthetic inputs shared by several benches: the streamed qwen3_moe BF16 checkpoint (`synth_qwen3moe`), the
  bench MoE built with quantkit.tiny (`bench_moe`), random token rows (`token_rows`) and a GPTQ convert of the
  bench MoE on one or more ranks (`run_convert`);
- common arguments (`add_common_args`: --out, --repeat, --smoke) and `Skip` for a bench whose requirement
  (a peer venv, a GPU, llama.cpp, vLLM) is absent;
- results: one JSON schema for every bench (`record`, checked by `validate`, written by `write_result`).

Nothing here imports torch at module level: a measured child's ru_maxrss starts from the RSS of the process
that forks it, so the measuring process stays small.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
CACHE = BENCH_DIR / ".cache"
RESULTS = BENCH_DIR / "results"
MIB = 1 << 20
SCHEMA = 1
POLL_S = 0.02


class Skip(Exception):
    """Raised by a bench when something it needs is absent (a peer venv, a GPU, llama.cpp, vLLM): the reason."""


# ---- the machine ---------------------------------------------------------------------------------------
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8", "fma", "f16c")
_MACHINE: dict | None = None


def machine() -> dict:
    """This machine, described once per process (no torch import: its version is read from its metadata)."""
    global _MACHINE
    if _MACHINE is None:
        import importlib.metadata as md

        model, flags = "", set()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                key, _, val = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = val.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(val.split())
        except OSError:
            pass
        mem = 0
        try:
            mem = int(next(line for line in Path("/proc/meminfo").read_text().splitlines()
                           if line.startswith("MemTotal")).split()[1]) * 1024
        except (OSError, StopIteration):
            pass
        try:
            torch_version = md.version("torch")
        except md.PackageNotFoundError:
            torch_version = None
        _MACHINE = {"cpu_model": model or platform.processor(), "cpu_count": os.cpu_count(),
                    "affinity": len(os.sched_getaffinity(0)), "cpu_flags": sorted(f for f in FLAGS if f in flags),
                    "mem_total_bytes": mem, "python": platform.python_version(), "torch": torch_version,
                    "platform": platform.platform()}
    return dict(_MACHINE)


def machine_line(m: dict) -> str:
    return (f"{m['cpu_model']}, {m['cpu_count']} CPUs ({', '.join(m['cpu_flags']) or 'no listed flags'}), "
            f"{m['mem_total_bytes'] / 2**30:.0f} GiB, Python {m['python']}, torch {m['torch']}")


def git_state() -> tuple[str, bool]:
    """(HEAD's sha, whether tracked files other than bench/results/ differ from it)."""
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        # results are data, not the code that made them: a bench run after another one is still clean
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--",
                                     ".", ":(exclude)bench/results"], capture_output=True, text=True).stdout.strip())
        return sha, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True


# ---- scratch directories -------------------------------------------------------------------------------
def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like an error, so atexit handlers run


def scratch_dir(prefix: str, keep: str | Path | None = None) -> Path:
    """`keep` if given (made if missing, never removed), else a new temporary directory removed when the process
    ends, whether the run finishes, raises, is interrupted (Ctrl-C) or is terminated (SIGTERM)."""
    if keep:
        path = Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return path


# ---- measuring -----------------------------------------------------------------------------------------
SPLIT_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def proc_status(pid: int | str, fields=SPLIT_FIELDS) -> dict[str, int] | None:
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


def _children(pid: int) -> list[int]:
    """Every descendant of `pid`, from /proc/PID/task/*/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = [int(x) for x in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def tree_rss(pid: int) -> int:
    """RSS of `pid` and all its descendants, summed (bytes)."""
    total = 0
    for p in [pid, *_children(pid)]:
        s = proc_status(p, ("VmRSS",))
        total += (s or {}).get("VmRSS", 0)
    return total


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat)."""
    try:
        vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    busy = sum(vals[:3]) + sum(vals[5:8])  # user nice system, irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _kill_group(popen: subprocess.Popen, wait: bool = True) -> None:
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except OSError:
        pass
    if wait:
        popen.wait()


def measure_cmd(cmd: list[str], *, env: dict | None = None, cwd: str | Path | None = None,
                stdout: Path | None = None, stderr: Path | None = None, timeout: float | None = None,
                poll_s: float = POLL_S, split: bool = False, trace: bool = False, check: bool = False) -> dict:
    """Run `cmd` and measure it: wall seconds, CPU seconds (its own and its children's, from wait4), the peak RSS
    of its process tree (every process's VmRSS summed, polled every `poll_s`), the kernel's high-water mark of
    the main process (ru_maxrss: catches spikes between polls, one process only), the CPU seconds the other
    processes of the machine used meanwhile, and the load average before and after.

    stdout / stderr go to those files when given, else are captured (their text in the result; stderr's last
    4000 characters). `split`: also what the main process's RSS is made of (/proc/PID/status: `peak_*` the
    largest polled value of each of SPLIT_FIELDS, `at_peak_*` the fields where VmRSS peaked); `trace`: the
    (seconds, RssAnon, RssFile) samples, thinned to 400. `check`: a non-zero exit raises SystemExit."""
    load0, busy0 = _load(), _busy_cpu_s()
    out_f = open(stdout, "wb") if stdout else subprocess.PIPE
    err_f = open(stderr, "wb") if stderr else subprocess.PIPE
    out_tmp = None if stdout else tempfile.TemporaryFile()
    err_tmp = None if stderr else tempfile.TemporaryFile()
    t0 = time.perf_counter()
    try:
        # its own process group: a timeout, an error or Ctrl-C here ends the command with all its descendants
        popen = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out_f if stdout else out_tmp,
                                 stderr=err_f if stderr else err_tmp, process_group=0)
        peak, samples, parts, samples_trace, timed_out = 0, 0, {}, [], False
        while True:
            try:
                pid, status, ru = os.wait4(popen.pid, os.WNOHANG)
            except BaseException:
                _kill_group(popen)
                raise
            if pid:
                break
            peak = max(peak, tree_rss(popen.pid))
            if split or trace:
                now = proc_status(popen.pid)
                if now:
                    for k, v in now.items():
                        parts[f"peak_{k}"] = max(parts.get(f"peak_{k}", 0), v)
                    if now.get("VmRSS", 0) >= parts.get("at_peak_VmRSS", 0):
                        parts.update({f"at_peak_{k}": v for k, v in now.items()})
                    if trace:
                        samples_trace.append((round(time.perf_counter() - t0, 3), now.get("RssAnon", 0),
                                              now.get("RssFile", 0)))
            samples += 1
            if timeout and time.perf_counter() - t0 > timeout and not timed_out:
                timed_out = True
                _kill_group(popen, wait=False)
            try:
                time.sleep(poll_s)
            except BaseException:
                _kill_group(popen)
                raise
        wall = time.perf_counter() - t0
    finally:
        for f in (out_f, err_f):
            if f is not subprocess.PIPE:
                f.close()
    popen.returncode = os.waitstatus_to_exitcode(status)
    cpu = ru.ru_utime + ru.ru_stime
    res = {"cmd": [str(c) for c in cmd], "rc": popen.returncode, "wall_s": round(wall, 3), "cpu_s": round(cpu, 2),
           "peak_rss_bytes": peak, "ru_maxrss_bytes": ru.ru_maxrss * 1024, "rss_samples": samples,
           "other_cpu_s": round(max(0.0, _busy_cpu_s() - busy0 - cpu), 2), "loadavg_before": load0,
           "loadavg_after": _load(), "timed_out": timed_out}
    if split or trace:
        res["rss_split"] = parts
    if trace:
        res["trace"] = samples_trace[:: max(1, len(samples_trace) // 400)]
    for key, tmp in (("stdout", out_tmp), ("stderr", err_tmp)):
        if tmp is not None:
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            tmp.close()
            res[key] = text if key == "stdout" else text[-4000:]
    if check and (res["rc"] != 0 or timed_out):
        why = "timed out" if timed_out else f"exit status {res['rc']}"
        raise SystemExit(f"{' '.join(res['cmd'][:6])} ... failed ({why}):\n{res.get('stderr', '')}")
    return res


def last_json(text: str) -> dict:
    """The JSON object a command printed: from its first '{' (a pretty-printed document) or its last line."""
    text = text.strip()
    try:
        return json.loads(text[text.find("{"):]) if "{" in text else {}
    except json.JSONDecodeError:
        return json.loads(text.splitlines()[-1])


def measure_fn(fn, *args, **kwargs) -> tuple[object, dict]:
    """Call fn(*args, **kwargs) in this process: (its result, {wall_s, cpu_s (this process, all threads),
    peak_rss_bytes (VmHWM after the call), rss_added_bytes (that peak above the RSS before the call: VmHWM is
    reset first, None where the kernel does not allow it), other_cpu_s (the CPU seconds the machine's other
    processes used meanwhile), the load average before and after})."""
    load0 = _load()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    base = (proc_status("self", ("VmRSS",)) or {}).get("VmRSS", 0)
    b0, t0, c0 = _busy_cpu_s(), time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    wall, cpu, busy = time.perf_counter() - t0, time.process_time() - c0, _busy_cpu_s() - b0
    hwm = (proc_status("self", ("VmHWM",)) or {}).get("VmHWM", 0)
    return out, {"wall_s": round(wall, 6), "cpu_s": round(cpu, 6), "peak_rss_bytes": hwm,
                 "rss_added_bytes": hwm - base if reset else None, "other_cpu_s": round(max(0.0, busy - cpu), 3),
                 "loadavg_before": load0, "loadavg_after": _load()}


def best_of(runs: list[dict]) -> dict:
    """The fastest run's figures, with the largest peak RSS of all runs and every run's wall time."""
    best = dict(min(runs, key=lambda r: r["wall_s"]))
    for k in ("peak_rss_bytes", "ru_maxrss_bytes"):
        if all(k in r for r in runs):
            best[k] = max(r[k] for r in runs)
    best["runs_wall_s"] = [r["wall_s"] for r in runs]
    return best


def warm_cache(files) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def settle(*dirs: Path) -> None:
    """Before a timed run: remove the earlier output and flush dirty pages, so that no run pays for the
    writeback of the one before."""
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    os.sync()


def time_cat(files: list[Path], runs: int, dst: Path | None = None, durable: bool = False) -> dict:
    """`cat shards > one file` on the same disk (`durable`: then fsync it): an untimed warm-up, then `runs`
    timed runs, the fastest used."""
    dst = dst or CACHE / "cat-out.bin"
    dst.parent.mkdir(parents=True, exist_ok=True)
    times, cpus = [], []
    try:
        for k in range(runs + 1):
            dst.unlink(missing_ok=True)
            settle()
            with open(dst, "wb") as out:
                t0 = time.perf_counter()
                popen = subprocess.Popen(["cat", *map(str, files)], stdout=out)
                _, status, ru = os.wait4(popen.pid, 0)
                if durable:
                    os.fsync(out.fileno())
                dt = time.perf_counter() - t0
            if os.waitstatus_to_exitcode(status):
                raise SystemExit("cat failed")
            if k:
                times.append(round(dt, 3))
                cpus.append(round(ru.ru_utime + ru.ru_stime, 3))
    finally:
        dst.unlink(missing_ok=True)
    return {"cmd": f"cat <{len(files)} shards> > {dst}" + (" + fsync" if durable else ""), "runs_s": times,
            "cpu_runs_s": cpus, "wall_s": min(times), "cpu_s": min(cpus)}


def quantkit_bin() -> str:
    """The quantkit executable next to this Python (else on PATH)."""
    p = Path(sys.executable).parent / "quantkit"
    return str(p) if p.exists() else "quantkit"


# ---- synthetic inputs ----------------------------------------------------------------------------------
def qwen3moe_specs(arch: dict, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a qwen3_moe model of `arch`'s widths, in module order."""
    h, hd, e, i = arch["hidden_size"], arch["head_dim"], arch["num_experts"], arch["moe_intermediate_size"]
    q, kv = arch["num_attention_heads"] * hd, arch["num_key_value_heads"] * hd
    specs = [("model.embed_tokens.weight", (arch["vocab_size"], h))]
    for L in range(layers):
        p = f"model.layers.{L}"
        specs += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.self_attn.q_proj.weight", (q, h)),
                  (f"{p}.self_attn.k_proj.weight", (kv, h)), (f"{p}.self_attn.v_proj.weight", (kv, h)),
                  (f"{p}.self_attn.o_proj.weight", (h, q)), (f"{p}.self_attn.q_norm.weight", (hd,)),
                  (f"{p}.self_attn.k_norm.weight", (hd,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                  (f"{p}.mlp.gate.weight", (e, h))]
        for x in range(e):
            specs += [(f"{p}.mlp.experts.{x}.gate_proj.weight", (i, h)), (f"{p}.mlp.experts.{x}.up_proj.weight", (i, h)),
                      (f"{p}.mlp.experts.{x}.down_proj.weight", (h, i))]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (arch["vocab_size"], h))]
    return specs


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _split_by_size(specs, shards: int) -> list[list]:
    """Contiguous runs of tensors, cut where the running total crosses k/shards of the whole."""
    total = sum(numel(s) for _, s in specs)
    out, cur, acc = [], [], 0
    for name, shape in specs:
        cur.append((name, shape))
        acc += numel(shape)
        if len(out) < shards - 1 and acc >= total * (len(out) + 1) / shards:
            out.append(cur)
            cur = []
    out.append(cur)
    if len(out) != shards or not all(out):
        raise SystemExit(f"cannot split {len(specs)} tensors into {shards} shards")
    return out


def _split_by_layer(specs) -> list[list]:
    """One shard for the embeddings, norm and head, then one per decoder layer."""
    groups: dict[str, list] = {}
    for name, shape in specs:
        part = name.split(".")[2] if name.startswith("model.layers.") else "other"
        groups.setdefault(part, []).append((name, shape))
    return [groups[p] for p in sorted(groups, key=lambda p: (p != "other", int(p) if p.isdigit() else -1))]


def synth_qwen3moe(arch: dict, layers: int, prefix: str, shards: int | None = None, seed: int = 0,
                   key_params: dict | None = None) -> Path:
    """A qwen3_moe checkpoint of random BF16 weights (N(0, 0.02), norms 1) generated once and cached under
    bench/.cache/: `shards` shards cut by size, or (None) one per decoder layer. Tensors are drawn per name from
    seeded generators and written shard by shard, never the whole model in memory."""
    params = key_params or {"arch": arch, "layers": layers, "shards": shards, "seed": seed}
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    root = CACHE / f"{prefix}-{key}"
    stamp = root / ".complete.json"
    if stamp.is_file():
        return root
    import torch
    import transformers
    from safetensors.torch import save_file

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    transformers.logging.set_verbosity_error()
    transformers.Qwen3MoeConfig(**arch, num_hidden_layers=layers, decoder_sparse_step=1, mlp_only_layers=[],
                                tie_word_embeddings=False, max_position_embeddings=4096,
                                dtype="bfloat16").save_pretrained(root)
    specs = qwen3moe_specs(arch, layers)
    parts = _split_by_size(specs, shards) if shards else _split_by_layer(specs)
    weight_map, total, t0 = {}, 0, time.perf_counter()
    for k, part in enumerate(parts):
        fname = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
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
        save_file(tensors, str(root / f".{fname}.tmp"), metadata={"format": "pt"})
        os.replace(root / f".{fname}.tmp", root / fname)
        print(f"  generated {fname} ({(root / fname).stat().st_size / 1e6:.0f} MB)", file=sys.stderr)
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    stamp.write_text(json.dumps({**params, "seconds": round(time.perf_counter() - t0, 1)}) + "\n")
    return root


def shard_files(root: Path) -> list[Path]:
    return sorted(root.glob("model-*.safetensors"))


# The bench MoE (the calibration issues' model): qwen3_moe, hidden 512, 32 routed experts of width 256, top-4,
# 8 query / 4 KV heads of 64, vocab 4096, random BF16 weights, built with quantkit.tiny.make_tiny_model.
BENCH_MOE = dict(hidden=512, experts=32, moe_intermediate=256, vocab=4096, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, num_experts_per_tok=4, intermediate_size=1024)
GPTQ_RECIPE = "int4-experts-gptq"


def bench_moe(layers: int, experts: int = BENCH_MOE["experts"], **over) -> Path:
    """The bench MoE with `layers` decoder layers and `experts` routed experts, built once and cached."""
    from quantkit.tiny import make_tiny_model

    spec = {**BENCH_MOE, "experts": experts, **over}
    key = hashlib.sha256(json.dumps({"layers": layers, **spec}, sort_keys=True).encode()).hexdigest()[:12]
    d = CACHE / f"calib-dist-{key}" / "src"
    if not (d / "config.json").is_file():
        shutil.rmtree(d, ignore_errors=True)
        make_tiny_model("qwen3_moe", d, layers=layers, max_shard_size="200MB", **spec)
    return d


def token_rows(path: Path, samples: int, seq_len: int, vocab: int, seed: int = 0) -> Path:
    """`samples` rows of `seq_len` seeded random token ids, written as an `input_ids` JSONL file."""
    import random

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(seq_len)]}) + "\n"
                            for _ in range(samples)))
    return path


def id_rows(path: Path, rows) -> Path:
    """Rows of token ids (tensors or lists) written as an `input_ids` JSONL file."""
    path.write_text("".join(json.dumps({"input_ids": r.tolist() if hasattr(r, "tolist") else list(r)}) + "\n"
                            for r in rows))
    return path


def run_convert(n: int, src: Path, out: Path, data: Path, samples: int, seq_len: int, timeout: int,
                torchrun_one: bool = False, extra: tuple[str, ...] = (), recipe: str = GPTQ_RECIPE,
                env: dict | None = None, **measure) -> dict:
    """`quantkit convert -r recipe` of `src` on `n` ranks (1: a plain process unless `torchrun_one`; more:
    torchrun, gloo), one thread per rank, measured; its --json document is the result's `reported`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "QUANTKIT_DIST_TIMEOUT": str(timeout),
           **(env or {})}
    args = ["convert", str(src), str(out), "-r", recipe, "--dataset", str(data), "--num-samples", str(samples),
            "--seq-len", str(seq_len), "--overwrite", "--json", *extra]
    if n == 1 and not torchrun_one:
        cmd = [sys.executable, "-m", "quantkit", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               "-m", "quantkit", *args]
    r = measure_cmd(cmd, env=env, timeout=timeout, check=True, **measure)
    r["reported"] = last_json(r.pop("stdout"))
    return r


def run_quantkit(args: list[str], **measure) -> tuple[dict, dict]:
    """`python -m quantkit ARGS --json`, measured: (its JSON document, the measurement). A failure stops the bench."""
    r = measure_cmd([sys.executable, "-m", "quantkit", *map(str, args), "--json"], check=True, **measure)
    return last_json(r.pop("stdout")), r


def verify_json(qmodel, **kw) -> dict:
    """quantkit's `verify` of `qmodel` as JSON, `kw` being VerifyOptions' fields (reference, dataset, num_samples,
    seq_len, generation_tokens, ...): through VerifyOptions where verify takes one, else as keywords (older trees)."""
    import inspect

    from quantkit import verify as v

    if "opts" in inspect.signature(v.verify).parameters:
        return v.verify(qmodel, v.VerifyOptions(**kw)).to_json()
    return v.verify(qmodel, **kw).to_json()


PEER_PYTHON = CACHE / "peer-venv" / "bin" / "python"  # bench/setup_peers.sh's venv (llm-compressor)


def peer_available(python: Path) -> tuple[bool, str]:
    """Whether `python` (a peer venv's) imports llm-compressor and datasets: (True, its version) or (False, why)."""
    if not Path(python).is_file():
        return False, f"{python} does not exist (the peer venv is not set up yet: bench/setup_peers.sh)"
    r = subprocess.run([str(python), "-c", "import llmcompressor, datasets; print(llmcompressor.__version__)"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"{python} cannot import llmcompressor: {r.stderr.strip().splitlines()[-1:]}"
    return True, r.stdout.strip().splitlines()[-1]


def vllm_load_check(python: str, out) -> dict:
    """vLLM's own loader on checkpoint `out` (bench/vllm_check.py run by `python`, a vLLM 0.33.0 venv's): whether
    it put every tensor into a parameter (`accepted`), and how many it dropped or left unwritten."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    r = subprocess.run([python, str(REPO / "bench" / "vllm_check.py"), str(out)], capture_output=True, text=True,
                       env=env, timeout=1800)
    try:
        doc = last_json(r.stdout)
    except (json.JSONDecodeError, IndexError):
        doc = {}
    return {"rc": r.returncode, "accepted": r.returncode == 0 and doc.get("accepted") is not False,
            "dropped": len(doc.get("dropped") or []), "unwritten": len(doc.get("unwritten") or []),
            "error": None if r.returncode == 0 else (doc.get("error") or r.stderr[-400:])}


def llamacpp_run_gguf(gguf, reference, checkpoint, **kw) -> dict:
    """quantkit's run of a GGUF in llama.cpp (quantkit.verify.llamacpp_run.run_gguf), `kw` being VerifyOptions'
    fields (dataset, num_samples, seq_len, generation_tokens)."""
    import inspect

    try:
        from quantkit.verify.llamacpp_run import run_gguf
    except ImportError:  # before the engine runners moved beside verify
        from quantkit.engine.llamacpp_run import run_gguf
    if "opts" in inspect.signature(run_gguf).parameters:
        from quantkit.verify import VerifyOptions

        return run_gguf(gguf, reference, checkpoint, VerifyOptions(**kw))
    return run_gguf(gguf, reference, checkpoint, **kw)


# ---- arguments -----------------------------------------------------------------------------------------
def add_common_args(ap: argparse.ArgumentParser, repeat: int | None = 1) -> argparse.ArgumentParser:
    """--out (where the result JSON goes), --smoke (the bench's tiny case: seconds), and --repeat unless the
    bench has none (`repeat=None`)."""
    ap.add_argument("--out", type=Path, default=None,
                    help="directory for the result JSON (default bench/results; with --smoke a temporary one)")
    ap.add_argument("--smoke", action="store_true", help="the bench's tiny case: checks the bench runs (seconds)")
    if repeat is not None:
        ap.add_argument("--repeat", type=int, default=repeat, help=f"runs of each case (default {repeat})")
    return ap


# ---- results -------------------------------------------------------------------------------------------
MACHINE_KEYS = {"cpu_model": str, "cpu_count": int, "cpu_flags": list, "mem_total_bytes": int, "python": str}
RECORD_KEYS = {"schema": int, "bench": str, "commit": str, "dirty": bool, "date": str, "machine": dict,
               "command": list, "params": dict, "rows": list, "loadavg": dict}
OPTIONAL_KEYS = {"summary": dict, "smoke": bool, "tag": str}


def _plain(x):
    """JSON-ready: paths as strings, tuples as lists, dict keys as strings."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, float) and x != x:
        return None
    return x


class Run:
    """One bench run: made at the start (the load average then), turned into a record at the end."""

    def __init__(self, bench: str, args: argparse.Namespace | dict | None = None, argv: list[str] | None = None):
        self.bench = bench
        self.params = _plain({k: v for k, v in (vars(args) if isinstance(args, argparse.Namespace) else args or {})
                              .items() if k != "out"})
        self.smoke = bool(self.params.get("smoke"))
        self.command = ["python", "-m", "bench", bench, *(sys.argv[1:] if argv is None else argv)]
        self.load_start = _load()
        self.out = getattr(args, "out", None) if isinstance(args, argparse.Namespace) else None

    def record(self, rows: list[dict], summary: dict | None = None, tag: str | None = None) -> dict:
        sha, dirty = git_state()
        doc = {"schema": SCHEMA, "bench": self.bench, "commit": sha, "dirty": dirty,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "machine": machine(), "command": self.command, "params": self.params, "rows": _plain(rows),
               "loadavg": {"start": self.load_start, "end": _load()}}
        if summary is not None:
            doc["summary"] = _plain(summary)
        if self.smoke:
            doc["smoke"] = True
        if tag:
            doc["tag"] = tag
        validate(doc)
        return doc

    def write(self, rows: list[dict], summary: dict | None = None, tag: str | None = None) -> Path:
        """Record and write bench/results/NAME[-TAG].json (or under --out; a smoke run under a temporary
        directory unless --out says where)."""
        doc = self.record(rows, summary, tag)
        out = Path(self.out) if self.out else (scratch_dir("qk-bench-smoke-") if self.smoke else RESULTS)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{self.bench}{'-' + tag if tag else ''}.json"
        path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        print(f"{self.bench}: results in {path}", file=sys.stderr)
        return path


def validate(doc) -> None:
    """Raise ValueError naming every way `doc` is not a bench result of this schema."""
    errs = []
    if not isinstance(doc, dict):
        raise ValueError("a result is a JSON object")
    for k, t in RECORD_KEYS.items():
        if k not in doc:
            errs.append(f"missing {k!r}")
        elif not isinstance(doc[k], t) or (t is int and isinstance(doc[k], bool)):
            errs.append(f"{k!r} is not a {t.__name__}")
    for k, t in OPTIONAL_KEYS.items():
        if k in doc and not isinstance(doc[k], t):
            errs.append(f"{k!r} is not a {t.__name__}")
    extra = set(doc) - set(RECORD_KEYS) - set(OPTIONAL_KEYS)
    if extra:
        errs.append(f"unknown keys {sorted(extra)}")
    if doc.get("schema") != SCHEMA:
        errs.append(f"schema is {doc.get('schema')!r}, not {SCHEMA}")
    if isinstance(doc.get("bench"), str) and not re.fullmatch(r"[a-z0-9_]+", doc["bench"]):
        errs.append(f"bench name {doc['bench']!r}")
    if isinstance(doc.get("commit"), str) and not re.fullmatch(r"[0-9a-f]{40}|unknown", doc["commit"]):
        errs.append(f"commit {doc['commit']!r} is not a sha")
    if isinstance(doc.get("date"), str):
        try:
            datetime.datetime.strptime(doc["date"], "%Y-%m-%dT%H:%M:%SZ")
        except ValueError:
            errs.append(f"date {doc['date']!r} is not YYYY-MM-DDTHH:MM:SSZ")
    if isinstance(doc.get("machine"), dict):
        for k, t in MACHINE_KEYS.items():
            if not isinstance(doc["machine"].get(k), t):
                errs.append(f"machine[{k!r}] missing or not a {t.__name__}")
    if isinstance(doc.get("command"), list) and not all(isinstance(c, str) for c in doc["command"]):
        errs.append("command is not a list of strings")
    if isinstance(doc.get("rows"), list):
        if not doc["rows"]:
            errs.append("no rows")
        if not all(isinstance(r, dict) for r in doc["rows"]):
            errs.append("a row is not an object")
    if isinstance(doc.get("loadavg"), dict) and set(doc["loadavg"]) != {"start", "end"}:
        errs.append("loadavg is not {start, end}")
    try:
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as e:
        errs.append(f"not plain JSON: {e}")
    if errs:
        raise ValueError(f"{doc.get('bench', '?')}: " + "; ".join(errs))


def load_result(path: Path) -> dict:
    doc = json.loads(Path(path).read_text())
    validate(doc)
    return doc


def mib(b) -> float | None:
    return None if b is None else round(b / MIB, 1)
