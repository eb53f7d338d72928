"""NVFP4 W4A4 against W4A16 (same weights) on tiny random-weight models: `quantkit convert` with the W4A16 and W4A4
recipes, then `quantkit verify --reference` (W4A4 measured as vLLM's FlashInfer backends run it: runtime/w4a4.py;
W4A16 beside it), the convert's wall time (W4A4 adds a calibration pass) and how many expert modules got the
layer-max input scale because no calibration token reached them. About 2 minutes on 2 loaded cores.

    PYTHONPATH=. .venv/bin/python bench/w4a4.py

Cases: qwen3_moe (hidden 256, 8 experts, top-2) from BF16, RTN; the tiny Kimi K2.5 wrapper with 15-level INT4
QAT experts (the reference is the INT4 model), RTN and GPTQ. Random weights: the figures say how the pieces
behave, not what a trained model loses.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from quantkit.convert import ConvertOptions, convert
from quantkit.testing import make_tiny_kimi_k25, make_tiny_model
from quantkit.verify import verify

CAL = dict(num_samples=16, seq_len=128)
EVAL = dict(num_samples=8, seq_len=128, generation_tokens=0)


def run(src: Path, out: Path, recipe: str) -> dict:
    t0 = time.perf_counter()
    convert(src, out, ConvertOptions(recipe=recipe, model_card=False, **CAL))
    secs = time.perf_counter() - t0
    m = json.loads((out / "quantkit_manifest.json").read_text())
    fallbacks = len((m.get("calibration") or {}).get("input_scale_fallbacks") or {})
    scales = sum(1 for n in m["tensors"] if n.endswith(".input_global_scale"))
    v = verify(out, reference=src, **EVAL).to_json()
    mt = v["metrics"]
    return {"recipe": recipe, "convert_s": round(secs, 1), "input_scales": scales, "layer_max_fallbacks": fallbacks,
            "kl": mt["kl_divergence"], "top1": mt["top1_agreement"], "kl_w4a16_same_weights": mt.get("kl_divergence_w4a16"),
            "top1_w4a16_same_weights": mt.get("top1_agreement_w4a16"), "passed_format": v["format"]["ok"]}


def main():
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases = [("qwen3_moe bf16", make_tiny_model("qwen3_moe", tmp / "q", hidden=256, experts=8),
                  ("nvfp4-experts", "nvfp4a4-experts")),
                 ("kimi_k25 int4-qat", make_tiny_kimi_k25(tmp / "k", int4_experts="qat"),
                  ("nvfp4-experts", "nvfp4a4-experts", "kimi-k2-nvfp4", "kimi-k2-nvfp4a4"))]
        for name, src, recipes in cases:
            for recipe in recipes:
                r = run(src, tmp / f"{src.name}-{recipe}", recipe)
                print(json.dumps({"model": name, **r}), flush=True)


if __name__ == "__main__":
    main()
