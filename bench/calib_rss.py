"""What the calibrated pass's resident memory is made of, as the model gets deeper: a GPTQ convert of the
bench MoE at several depths, its /proc/PID/status sampled every few milliseconds.

    .venv/bin/python bench/calib_rss.py                       # 2 and 8 layers, 64 experts, 16 x 256 tokens
    .venv/bin/python bench/calib_rss.py --layers 2 4 8 --experts 64 --env QUANTKIT_X=1

Peak RSS alone (`ru_maxrss`, what convert reports) does not say what the pages are. Linux splits RSS into
anonymous memory (RssAnon: tensors, allocator arenas), file-backed pages mapped into the process (RssFile:
the source shards quantkit reads through mmap, shared libraries) and shared memory (RssShmem). A pass that
holds one layer at a time should have flat RssAnon in depth; RssFile grows with depth if source pages that
were read stay mapped. Per run this prints the high-water mark of each part (sampled, so a short spike can
be missed; VmHWM is the kernel's exact total) and the part's value at the sample where the total peaked.
Writes bench/results/calib_rss.json and .md (or under --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from calib_dist import CACHE, RECIPE, _dataset, _source  # noqa: E402
from convert_rtn import SPLIT_FIELDS, proc_status  # noqa: E402

FIELDS = SPLIT_FIELDS


def status(pid: int) -> dict[str, int] | None:
    return proc_status(pid, FIELDS)


def traced(cmd: list[str], env: dict, period: float, timeout: int) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {k: 0 for k in FIELDS}
    at_peak: dict[str, int] = {}
    trace = []
    while p.poll() is None:
        s = status(p.pid)
        if s:
            for k, v in s.items():
                peak[k] = max(peak[k], v)
            if s.get("VmRSS", 0) >= at_peak.get("VmRSS", 0):
                at_peak = s
            trace.append((round(time.perf_counter() - t0, 3), s.get("RssAnon", 0), s.get("RssFile", 0)))
        if time.perf_counter() - t0 > timeout:
            p.kill()
            raise SystemExit(f"timed out: {cmd}")
        time.sleep(period)
    out, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
    start = out.find("{")
    res = json.loads(out[start:]) if start >= 0 else {}
    return {"wall_s": round(time.perf_counter() - t0, 2), "peak_rss_bytes": res.get("peak_rss_bytes"),
            "peak": peak, "at_peak": at_peak, "samples": len(trace), "trace": trace[:: max(1, len(trace) // 400)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--experts", type=int, nargs="+", default=[64])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--period", type=float, default=0.005)
    ap.add_argument("--env", nargs="*", default=[], help="KEY=VALUE set for the convert")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--timeout", type=int, default=3600)
    a = ap.parse_args(argv)
    work = CACHE / "calib-rss-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.update(kv.split("=", 1) for kv in a.env)
    rows = []
    for experts in a.experts:
        for layers in a.layers:
            src = _source(layers, experts)
            vocab = json.loads((src / "config.json").read_text())["vocab_size"]
            data = _dataset(work / "data.jsonl", a.samples, a.seq_len, vocab)
            out = work / f"out-{layers}-{experts}"
            cmd = [sys.executable, "-m", "quantkit", "convert", str(src), str(out), "-r", RECIPE, "--dataset",
                   str(data), "--num-samples", str(a.samples), "--seq-len", str(a.seq_len), "--overwrite", "--json"]
            r = traced(cmd, env, a.period, a.timeout)
            src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
            rows.append({"layers": layers, "experts": experts, "source_bytes": src_bytes, **r})
            mib = lambda b: f"{(b or 0) / 2**20:.0f}"  # noqa: E731
            print(f"{layers} layers x {experts} experts: source {mib(src_bytes)} MiB, VmHWM {mib(r['peak']['VmHWM'])},"
                  f" peak anon {mib(r['peak']['RssAnon'])}, peak file {mib(r['peak']['RssFile'])}; at the total's"
                  f" peak anon {mib(r['at_peak'].get('RssAnon'))} file {mib(r['at_peak'].get('RssFile'))}"
                  f" ({r['wall_s']} s)", file=sys.stderr, flush=True)
            shutil.rmtree(out, ignore_errors=True)
    a.out.mkdir(parents=True, exist_ok=True)
    mib = lambda b: f"{(b or 0) / 2**20:.0f}"  # noqa: E731
    md = ["| layers | experts | source (MiB) | VmHWM (MiB) | peak RssAnon | peak RssFile | anon at peak | file at peak | wall (s) |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['layers']} | {r['experts']} | {mib(r['source_bytes'])} | {mib(r['peak']['VmHWM'])} | "
                  f"{mib(r['peak']['RssAnon'])} | {mib(r['peak']['RssFile'])} | {mib(r['at_peak'].get('RssAnon'))} | "
                  f"{mib(r['at_peak'].get('RssFile'))} | {r['wall_s']} |")
    (a.out / "calib_rss.md").write_text("\n".join(md) + "\n")
    (a.out / "calib_rss.json").write_text(json.dumps({"env": a.env, "rows": rows}, indent=1) + "\n")
    print("\n".join(md), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
