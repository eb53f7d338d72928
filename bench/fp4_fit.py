"""Fitted FP4 scales against amax scales (quant/fp4.py `scale_search`): SQNR on a tiny Kimi K2.5-style
release (15-level INT4 QAT experts, converted by `quantkit convert` with nvfp4-experts / mxfp4-experts,
figures from the manifest) and on random weights (INT4 grids with 15 and 16 levels, Gaussian BF16),
overall = 10 log10(sum w^2 / sum err^2) over every matrix. A few seconds on 2 cores.

    python -m bench fp4_fit [--smoke]     # --smoke: random weights [2, 64, 256] instead of [8, 512, 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from bench.harness import Run, add_common_args, measure_fn

from quantkit.convert import ConvertOptions, convert
from quantkit.quant import fp4
from quantkit.testing import make_tiny_kimi_k25


def int4_grid(shape, levels, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*shape, generator=g) * 0.02).unflatten(-1, (-1, 32))
    s = (w.abs().amax(-1, keepdim=True) / levels).to(torch.bfloat16).float()
    lo = -levels if levels == 7 else -8
    return (torch.round(w / s).clamp(lo, levels) * s).flatten(-2).to(torch.bfloat16)


def db(signal, noise):
    return float(10 * torch.log10(signal.sum() / noise.sum()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fp4_fit", description=__doc__.splitlines()[0])
    add_common_args(ap, repeat=None)
    args = ap.parse_args(argv)
    run = Run("fp4_fit", args, argv)
    shape = (2, 64, 256) if args.smoke else (8, 512, 1024)
    rows = []
    print("tiny kimi_k25 (INT4 QAT experts, 15 levels): per-tensor mean and range of sqnr_db")
    with tempfile.TemporaryDirectory() as tmp:
        src = make_tiny_kimi_k25(Path(tmp) / "src", int4_experts="qat")
        for recipe in ("nvfp4-experts", "mxfp4-experts"):
            convert(src, Path(tmp) / recipe, ConvertOptions(recipe=recipe, model_card=False))
            man = json.loads((Path(tmp) / recipe / "quantkit_manifest.json").read_text())
            es = [e for n, e in man["tensors"].items() if n.endswith(".weight_packed")]
            fit = [e["sqnr_db"] for e in es]
            amax = [e.get("sqnr_amax_db", e["sqnr_db"]) for e in es]  # no amax figure: amax scales were used
            gain = [f - a for f, a in zip(fit, amax)]
            rows.append({"case": "tiny kimi_k25 INT4 QAT (per-tensor mean)", "format": recipe, "tensors": len(es),
                         "fitted_db": round(sum(fit) / len(fit), 2), "amax_db": round(sum(amax) / len(amax), 2),
                         "gain_db": round(sum(gain) / len(gain), 2), "gain_min_db": round(min(gain), 2),
                         "gain_max_db": round(max(gain), 2)})
            print(f"  {recipe}: {len(es)} tensors, fitted {rows[-1]['fitted_db']:.2f} dB, amax {rows[-1]['amax_db']:.2f} "
                  f"dB, gain mean {rows[-1]['gain_db']:+.2f} dB (min {min(gain):+.2f}, max {max(gain):+.2f})")
    print(f"random weights {list(shape)}, overall SQNR (fitted / amax, gain; seconds fitted / amax)")
    cases = {"INT4 15 levels (Kimi QAT)": int4_grid(shape, 7, 0),
             "INT4 16 levels (RTN [-8, 7])": int4_grid(shape, 7.5, 1),
             "Gaussian BF16": (torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 0.02)
             .to(torch.bfloat16)}
    for name, w in cases.items():
        for kind in ("nvfp4", "mxfp4"):
            a, ta = measure_fn(fp4.rtn_nvfp4, w) if kind == "nvfp4" else measure_fn(fp4.rtn_mxfp4, w)
            f, tf = measure_fn(fp4.rtn_nvfp4, w, None, "mse") if kind == "nvfp4" else measure_fn(fp4.rtn_mxfp4, w, "mse")
            fit, amax = db(f.signal, f.noise), db(a.signal, a.noise)
            rows.append({"case": f"random {name} (overall)", "format": kind, "fitted_db": round(fit, 2),
                         "amax_db": round(amax, 2), "gain_db": round(fit - amax, 2), "fitted_s": tf["wall_s"],
                         "amax_s": ta["wall_s"]})
            print(f"  {name:30s} {kind}: {fit:.2f} / {amax:.2f} dB, {fit - amax:+.2f} dB; "
                  f"{tf['wall_s']:.2f} / {ta['wall_s']:.2f} s")
    run.write(rows, {"random_shape": list(shape)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
