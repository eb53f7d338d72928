"""What the calibrated pass's resident memory is made of, as the model gets deeper: a GPTQ convert of the
bench MoE at several depths, its /proc/PID/status sampled every few milliseconds.

    python -m bench calib_rss                       # 2 and 8 layers, 64 experts, 16 x 256 tokens
    python -m bench calib_rss --layers 2 4 8 --experts 64 --env QUANTKIT_X=1

Peak RSS alone (`ru_maxrss`, what convert reports) does not say what the pages are. Linux splits RSS into
anonymous memory (RssAnon: tensors, allocator arenas), file-backed pages mapped into the process (RssFile:
the source shards quantkit reads through mmap, shared libraries) and shared memory (RssShmem). A pass that
holds one layer at a time should have flat RssAnon in depth; RssFile grows with depth if source pages that
were read stay mapped. Per run this prints the high-water mark of each part (sampled, so a short spike can
be missed; VmHWM is the kernel's exact total) and the part's value at the sample where the total peaked.
Writes bench/results/calib_rss.json (or under --out).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from bench.calib_dist import RECIPE
from bench.harness import CACHE, Run, add_common_args, bench_moe, run_convert, token_rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench calib_rss", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--experts", type=int, nargs="+", default=[64])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--period", type=float, default=0.005)
    ap.add_argument("--env", nargs="*", default=[], help="KEY=VALUE set for the convert")
    ap.add_argument("--timeout", type=int, default=3600)
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.layers, a.experts, a.samples, a.seq_len = [1], [4], 2, 16
    run = Run("calib_rss", a, argv)
    work = CACHE / "calib-rss-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(kv.split("=", 1) for kv in a.env)
    rows = []
    mib = lambda b: round((b or 0) / 2**20)  # noqa: E731
    for experts in a.experts:
        for layers in a.layers:
            src = bench_moe(layers, experts)
            vocab = json.loads((src / "config.json").read_text())["vocab_size"]
            data = token_rows(work / "data.jsonl", a.samples, a.seq_len, vocab)
            out = work / f"out-{layers}-{experts}"
            r = run_convert(1, src, out, data, a.samples, a.seq_len, a.timeout, env=env, recipe=RECIPE,
                            poll_s=a.period, split=True)
            s = r["rss_split"]
            src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
            row = {"layers": layers, "experts": experts, "source_mib": mib(src_bytes), "vmhwm_mib": mib(s.get("peak_VmHWM")),
                   "peak_anon_mib": mib(s.get("peak_RssAnon")), "peak_file_mib": mib(s.get("peak_RssFile")),
                   "anon_at_peak_mib": mib(s.get("at_peak_RssAnon")), "file_at_peak_mib": mib(s.get("at_peak_RssFile")),
                   "wall_s": r["wall_s"], "samples": r["rss_samples"]}
            rows.append(row)
            print("  ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr, flush=True)
            shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    run.write(rows, {"env": a.env})
    return 0


if __name__ == "__main__":
    sys.exit(main())
