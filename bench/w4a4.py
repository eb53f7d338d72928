"""NVFP4 W4A4 against W4A16 (same weights) on tiny random-weight models: `quantkit convert` with the W4A16 and W4A4
recipes, then `quantkit verify --reference` (W4A4 measured as vLLM's FlashInfer backends run it: runtime/w4a4.py;
W4A16 beside it), the convert's wall time (W4A4 adds a calibration pass) and how many expert modules got the
layer-max input scale because no calibration token reached them. About 2 minutes on 2 loaded cores.

    python -m bench w4a4 [--trained STEPS] [--smoke]     # --smoke: the qwen3_moe case, W4A16 and W4A4 RTN

Cases: qwen3_moe (hidden 256, 8 experts, top-2) from BF16, RTN; the tiny Kimi K2.5 wrapper with 15-level INT4
QAT experts (the reference is the INT4 model), RTN and GPTQ. Random weights: the figures say how the pieces
behave, not what a trained model loses.

`--trained STEPS`: instead, the quality fixture (bench/fixture.py, a byte-level qwen3_moe trained on the stdlib's
sources; STEPS training steps, cached) made an INT4 release the way Kimi's look (int4-experts-rtn, then its
experts put on the 15-level grid: quantkit.tiny.kimi_int4_grid; a post-hoc stand-in for QAT), then NVFP4 W4A16
and W4A4, RTN and GPTQ, from that INT4 release: calibration on training text, KL against the INT4 model on
held-out text.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.harness import Run, add_common_args, measure_fn, verify_json

from quantkit.convert import ConvertOptions, convert
from quantkit.testing import make_tiny_kimi_k25, make_tiny_model

CAL = dict(num_samples=16, seq_len=128)
EVAL = dict(num_samples=8, seq_len=128, generation_tokens=0)


def run_case(src: Path, out: Path, recipe: str) -> dict:
    _, m = measure_fn(convert, src, out, ConvertOptions(recipe=recipe, model_card=False, **CAL))
    secs = m["wall_s"]
    m = json.loads((out / "quantkit_manifest.json").read_text())
    fallbacks = len((m.get("calibration") or {}).get("input_scale_fallbacks") or {})
    scales = sum(1 for n in m["tensors"] if n.endswith(".input_global_scale"))
    v = verify_json(out, reference=src, **EVAL)
    mt = v["metrics"]
    return {"recipe": recipe, "convert_s": round(secs, 1), "input_scales": scales, "layer_max_fallbacks": fallbacks,
            "kl": mt["kl_divergence"], "top1": mt["top1_agreement"], "kl_w4a16_same_weights": mt.get("kl_divergence_w4a16"),
            "top1_w4a16_same_weights": mt.get("top1_agreement_w4a16"), "passed_format": v["format"]["ok"]}


GPTQ = """
name: nvfp4{a}-experts-gptq
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']
    method: gptq
    scheme: {{num_bits: 4, type: float, symmetric: true, strategy: tensor_group{acts}}}
    options: {{damp: 0.01, actorder: true, block_size: 128, fallback: all_tokens}}
ignore: ['re:.*\\.mlp\\.gate$', 'lm_head']
"""


def trained(steps: int) -> list[dict]:
    from bench.fixture import FixtureSpec, get_fixture, stdlib_corpus

    from quantkit.match.recipe import parse_recipe
    from quantkit.tiny import kimi_int4_grid

    spec = FixtureSpec(steps=steps)
    fx = get_fixture(spec, log=lambda m: None)
    train, held = stdlib_corpus(spec.corpus_bytes)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def jsonl(name, data, n, length):  # n texts of `length` bytes (byte-level model: tokens are bytes)
            step = max(length, (len(data) - length) // n)
            rows = [data[i * step: i * step + length].decode("latin-1") for i in range(n)]
            (tmp / name).write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
            return str(tmp / name)

        cal, ev = jsonl("cal.jsonl", train, 64, 256), jsonl("eval.jsonl", held, 16, 256)
        int4 = tmp / "int4"
        convert(fx["model_dir"], int4, ConvertOptions(recipe="int4-experts-rtn", model_card=False))
        kimi_int4_grid(int4)
        recipes = {"nvfp4-experts": "nvfp4-experts", "nvfp4a4-experts": "nvfp4a4-experts",
                   "nvfp4-experts-gptq": parse_recipe(GPTQ.format(a="", acts="")),
                   "nvfp4a4-experts-gptq": parse_recipe(GPTQ.format(a="a4", acts=", activations: nvfp4"))}
        for name, recipe in recipes.items():
            out = tmp / name
            _, m = measure_fn(convert, int4, out, ConvertOptions(recipe=recipe, model_card=False, dataset=cal,
                                                                 num_samples=64, seq_len=256))
            secs = m["wall_s"]
            v = verify_json(out, reference=int4, dataset=ev, num_samples=16, seq_len=256, generation_tokens=0)
            mt = v["metrics"]
            row = {"model": f"trained fixture ({steps} steps, final loss {fx['final_loss']:.3f}), INT4 15-level "
                            "experts", "recipe": name, "convert_s": round(secs, 1), "kl": mt["kl_divergence"],
                   "top1": mt["top1_agreement"], "ppl_int4": mt["perplexity_reference"],
                   "ppl": mt["perplexity_quantized"], "kl_w4a16_same_weights": mt.get("kl_divergence_w4a16")}
            if "a4" in name:  # the same checkpoint as vLLM's CUTLASS backend runs it: each expert its own scale
                import functools

                import quantkit.verify.numerics as num

                real = num.install_w4a4
                num.install_w4a4 = functools.partial(real, scales="expert")
                try:
                    v2 = verify_json(out, reference=int4, dataset=ev, num_samples=16, seq_len=256,
                                     generation_tokens=0)
                finally:
                    num.install_w4a4 = real
                row["kl_per_expert_scales"] = v2["metrics"]["kl_divergence"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench w4a4", description=__doc__.splitlines()[0])
    ap.add_argument("--trained", type=int, default=None, metavar="STEPS",
                    help="the quality fixture trained STEPS steps, as a Kimi-style INT4 release")
    add_common_args(ap, repeat=None)
    args = ap.parse_args(argv)
    run = Run("w4a4", args, argv)
    if args.trained:
        run.write(trained(args.trained), tag=f"trained{args.trained}")
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases = [("qwen3_moe bf16", make_tiny_model("qwen3_moe", tmp / "q", hidden=256, experts=8),
                  ("nvfp4-experts", "nvfp4a4-experts"))]
        if not args.smoke:
            cases.append(("kimi_k25 int4-qat", make_tiny_kimi_k25(tmp / "k", int4_experts="qat"),
                          ("nvfp4-experts", "nvfp4a4-experts", "kimi-k2-nvfp4", "kimi-k2-nvfp4a4")))
        for name, src, recipes in cases:
            for recipe in recipes:
                rows.append({"model": name, **run_case(src, tmp / f"{src.name}-{recipe}", recipe)})
                print(json.dumps(rows[-1]), flush=True)
    run.write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
