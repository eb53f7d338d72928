"""Peak memory of `quantkit convert --recipe int4-experts-gptq` on an 8-layer MoE, against the issue's bound.

    .venv/bin/python bench/gptq_rss.py [--layers 8] [--num-samples 4] [--seq-len 128] [--check]

Input: the random-weight BF16 qwen3_moe checkpoint of bench/calibrate_kv.py (hidden 1024, 32 experts of
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
import os
import platform
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrate_kv import (ARCH, BASELINE_SCRIPT, CACHE, MB, REPO, SLACK, make_checkpoint, numel,  # noqa: E402
                          run_measured, tensor_specs)

RESULTS = Path(__file__).resolve().parent / "results" / "gptq_rss.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--check", action="store_true", help="exit 1 if the peak RSS exceeds the bound")
    a = ap.parse_args(argv)

    root = make_checkpoint(a.layers)
    work = CACHE / "gptq_rss"
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)

    h, i, e = ARCH["hidden_size"], ARCH["moe_intermediate_size"], ARCH["num_experts"]
    layer_bytes = 4 * sum(numel(s) for n, s in tensor_specs(1) if n.startswith("model.layers.0."))
    hessian_bytes = 4 * (e * (h * h + i * i) + h * h)
    tokens = a.num_samples * a.seq_len
    act_bytes = 2 * tokens * h * 4
    bound = 2 * layer_bytes + hessian_bytes + act_bytes + SLACK

    py = sys.executable
    base = run_measured([py, "-c", BASELINE_SCRIPT.format(repo=str(REPO), model=str(root))],
                        work / "baseline.err", work / "baseline.out")
    cmd = [py, "-m", "quantkit.cli", "convert", str(root), str(out), "--recipe", "int4-experts-gptq",
           "--num-samples", str(a.num_samples), "--seq-len", str(a.seq_len), "--json"]
    env_cmd = ["env", f"PYTHONPATH={REPO}"] + cmd
    qk = run_measured(env_cmd, work / "convert.err", work / "convert.out")
    if qk["rc"] != 0:
        raise SystemExit(f"convert failed (rc {qk['rc']}), see {qk['log']}")
    reported = json.loads((work / "convert.out").read_text())
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "command": " ".join(cmd),
        "model": {"dir": str(root), "arch": ARCH, "layers": a.layers,
                  "disk_bytes": sum(p.stat().st_size for p in root.glob("*.safetensors"))},
        "bound": {"bytes": bound, "layer_weights_x2": 2 * layer_bytes, "hessians": hessian_bytes,
                  "activations": act_bytes, "slack": SLACK,
                  "formula": "2 x layer weights (fp32) + one layer's Hessians (fp32) + 2 x tokens x hidden x 4 B "
                             "+ 500 MB"},
        "quantkit": {**qk, "seconds_reported": reported["seconds"], "rss_vs_bound": round(qk["peak_rss_bytes"] / bound, 3),
                     "import_baseline_rss_bytes": base["peak_rss_bytes"]},
    }
    print(f"gptq convert: {qk['wall_s']} s wall ({qk['cpu_s']} CPU s, load {qk['loadavg_1min']}), peak RSS "
          f"{qk['peak_rss_bytes'] / MB:.0f} MB (imports + meta model alone: {base['peak_rss_bytes'] / MB:.0f} MB); "
          f"bound {bound / MB:.0f} MB = 2 x {layer_bytes / MB:.0f} (layers) + {hessian_bytes / MB:.0f} (Hessians) + "
          f"{act_bytes / MB:.0f} (activations) + {SLACK / MB:.0f} -> {result['quantkit']['rss_vs_bound']:.2f} of the bound",
          file=sys.stderr)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    return 1 if a.check and qk["peak_rss_bytes"] > bound else 0


if __name__ == "__main__":
    sys.exit(main())
