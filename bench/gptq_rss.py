"""Peak memory of `quantkit convert --recipe int4-experts-gptq` on an 8-layer MoE, against the issue's bound.

    python -m bench gptq_rss [--layers 8] [--num-samples 4] [--seq-len 128] [--check] [--smoke]

Input: the random-weight BF16 qwen3_moe checkpoint of calibrate_kv (hidden 1024, 32 experts of
width 512, top-4; one shard per layer; generated once and cached in bench/.cache/).

It runs `quantkit convert SRC OUT --recipe int4-experts-gptq --num-samples N --seq-len T --json` as a
subprocess and records wall time, CPU time and peak RSS (the kernel's high-water mark from wait4 and the
process-tree RSS polled every 20 ms), then compares the peak with the bound the issue sets:

    two layers' weights (float32, the compute dtype)
  + the Hessians of one layer (float32: per expert H x H for gate/up and I x I for down, plus one H x H
    over all tokens)
  + the activations (inputs and outputs of one layer: 2 x tokens x hidden x 4 B)
  + 500 MB

It also measures a subprocess that only imports quantkit's calibration modules and builds the meta model
(the fixed cost of Python + torch + transformers, which the 500 MB has to cover). Results go to
bench/results/gptq_rss.json; `--check` exits 1 if the peak exceeds the bound.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from bench.calibrate_kv import ARCH, BASELINE_SCRIPT, MB, SLACK, layer_weight_bytes, make_checkpoint
from bench.convert_rtn import SMOKE_ARCH
from bench.harness import CACHE, Run, add_common_args, measure_cmd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gptq_rss", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--check", action="store_true", help="exit 1 if the peak RSS exceeds the bound")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    arch = ARCH
    if a.smoke:
        arch, a.layers, a.num_samples, a.seq_len = SMOKE_ARCH, 1, 2, 32
    run = Run("gptq_rss", a, argv)

    root = make_checkpoint(a.layers, arch=arch)
    work = CACHE / "gptq_rss"
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)

    h, i, e = arch["hidden_size"], arch["moe_intermediate_size"], arch["num_experts"]
    layer_bytes = layer_weight_bytes(arch)
    hessian_bytes = 4 * (e * (h * h + i * i) + h * h)
    tokens = a.num_samples * a.seq_len
    act_bytes = 2 * tokens * h * 4
    bound = 2 * layer_bytes + hessian_bytes + act_bytes + SLACK

    py = sys.executable
    base = measure_cmd([py, "-c", BASELINE_SCRIPT.format(model=str(root))], check=True)
    cmd = [py, "-m", "quantkit.cli", "convert", str(root), str(out), "--recipe", "int4-experts-gptq",
           "--num-samples", str(a.num_samples), "--seq-len", str(a.seq_len), "--json"]
    qk = measure_cmd(cmd, check=True)
    reported = json.loads(qk.pop("stdout"))
    peak = max(qk["peak_rss_bytes"], qk["ru_maxrss_bytes"])
    base_peak = max(base["peak_rss_bytes"], base["ru_maxrss_bytes"])
    row = {"layers": a.layers, "tokens": tokens, "wall_s": qk["wall_s"], "cpu_s": qk["cpu_s"],
           "seconds_reported": reported["seconds"], "peak_rss_mb": round(peak / MB),
           "imports_alone_mb": round(base_peak / MB), "bound_mb": round(bound / MB), "rss_vs_bound": round(peak / bound, 3)}
    print(f"gptq convert: {qk['wall_s']} s wall ({qk['cpu_s']} CPU s, load {qk['loadavg_before'][0]} -> "
          f"{qk['loadavg_after'][0]}), peak RSS {peak / MB:.0f} MB (imports + meta model alone: {base_peak / MB:.0f} MB); "
          f"bound {bound / MB:.0f} MB = 2 x {layer_bytes / MB:.0f} (layers) + {hessian_bytes / MB:.0f} (Hessians) + "
          f"{act_bytes / MB:.0f} (activations) + {SLACK / MB:.0f} -> {row['rss_vs_bound']:.2f} of the bound",
          file=sys.stderr)
    run.write([row], {"model": {"dir": str(root), "arch": arch, "layers": a.layers,
                                "disk_bytes": sum(p.stat().st_size for p in root.glob("*.safetensors"))},
                      "bound": {"bytes": bound, "layer_weights_x2": 2 * layer_bytes, "hessians": hessian_bytes,
                                "activations": act_bytes, "slack": SLACK,
                                "formula": "2 x layer weights (fp32) + one layer's Hessians (fp32) + 2 x tokens x hidden "
                                           "x 4 B + 500 MB"},
                      "convert": qk, "imports_alone": base})
    shutil.rmtree(out, ignore_errors=True)
    return 1 if a.check and peak > bound else 0


if __name__ == "__main__":
    sys.exit(main())
