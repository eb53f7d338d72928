"""Fitted FP4 scales against amax scales (quant/fp4.py `scale_search`): SQNR on a tiny Kimi K2.5-style
release (15-level INT4 QAT experts, converted by `quantkit convert` with nvfp4-experts / mxfp4-experts,
figures from the manifest) and on random weights (INT4 grids with 15 and 16 levels, Gaussian BF16),
overall = 10 log10(sum w^2 / sum err^2) over every matrix. A few seconds on 2 cores.

    PYTHONPATH=. .venv/bin/python bench/fp4_fit.py
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

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


def main():
    print("tiny kimi_k25 (INT4 QAT experts, 15 levels): per-tensor mean and range of sqnr_db")
    with tempfile.TemporaryDirectory() as tmp:
        src = make_tiny_kimi_k25(Path(tmp) / "src", int4_experts="qat")
        for recipe in ("nvfp4-experts", "mxfp4-experts"):
            convert(src, Path(tmp) / recipe, ConvertOptions(recipe=recipe, model_card=False))
            man = json.loads((Path(tmp) / recipe / "quantkit_manifest.json").read_text())
            es = [e for n, e in man["tensors"].items() if n.endswith(".weight_packed")]
            fit = [e["sqnr_db"] for e in es]
            amax = [e["sqnr_amax_db"] for e in es]
            gain = [f - a for f, a in zip(fit, amax)]
            print(f"  {recipe}: {len(es)} tensors, fitted {sum(fit) / len(fit):.2f} dB, amax {sum(amax) / len(amax):.2f} dB, "
                  f"gain mean {sum(gain) / len(gain):+.2f} dB (min {min(gain):+.2f}, max {max(gain):+.2f})")
    print("random weights [8, 512, 1024], overall SQNR (fitted / amax, gain; seconds fitted / amax)")
    cases = {"INT4 15 levels (Kimi QAT)": int4_grid((8, 512, 1024), 7, 0),
             "INT4 16 levels (RTN [-8, 7])": int4_grid((8, 512, 1024), 7.5, 1),
             "Gaussian BF16": (torch.randn(8, 512, 1024, generator=torch.Generator().manual_seed(2)) * 0.02)
             .to(torch.bfloat16)}
    for name, w in cases.items():
        for kind in ("nvfp4", "mxfp4"):
            t0 = time.perf_counter()
            a = fp4.rtn_nvfp4(w) if kind == "nvfp4" else fp4.rtn_mxfp4(w)
            t1 = time.perf_counter()
            f = fp4.rtn_nvfp4(w, None, "mse") if kind == "nvfp4" else fp4.rtn_mxfp4(w, "mse")
            t2 = time.perf_counter()
            print(f"  {name:30s} {kind}: {db(f.signal, f.noise):.2f} / {db(a.signal, a.noise):.2f} dB, "
                  f"{db(f.signal, f.noise) - db(a.signal, a.noise):+.2f} dB; {t2 - t1:.2f} / {t1 - t0:.2f} s")


if __name__ == "__main__":
    main()
