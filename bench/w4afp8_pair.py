"""GLM-on-Hopper numerics on a *trained* model, from one run: W4AFP8 as served, the same INT4 weights run
W4A16, and an FP8-prefill / INT4-decode pair, each against the BF16 source.

    python -m bench w4afp8_pair [--recipe int4-experts-w4afp8-gptq] [--num-samples 8]
    python -m bench w4afp8_pair --smoke     # a 256-wide fixture trained 5 steps, 4 windows (the bench's logic)

The model is bench/fixture.py's 256-wide fixture (`--wide`: hidden and expert width 256, the smallest that
vLLM's W4AFP8 MoE kernels take), trained on the standard library's sources and cached. Two commands, as a
user runs them:

1. `quantkit convert SRC DEC --recipe R --pair fp8-prefill --dataset calib.jsonl`: the decode checkpoint
   (W4AFP8 experts) and the FP8 prefill checkpoint from one streamed pass, one set of calibrated KV scales
   written to both;
2. `quantkit verify DEC --pair DEC-prefill --reference SRC --dataset heldout.txt --json`: stage 3 measures DEC
   as vLLM's W4A8 MoE kernel computes it (FP8 group scales, per-token FP8 activations) with the same weights
   run W4A16 beside it; the pair stage prefills with the FP8 model into the paged FP8 KV pool and decodes
   with DEC reading those pages (teacher forced), beside each model alone.

Prints one table and writes bench/results/w4afp8_pair.json (both commands' --json and wall times).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from bench.fixture import TINY, WIDE, get_fixture
from bench.harness import Run, add_common_args, id_rows, run_quantkit, scratch_dir
from bench.quality import windows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench w4afp8_pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="int4-experts-w4afp8-gptq", help="the decode checkpoint's recipe")
    ap.add_argument("--calib-samples", type=int, default=64, help="calibration windows of --seq-len tokens")
    ap.add_argument("--num-samples", type=int, default=8, help="held-out windows verify measures")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--work", default=None, help="keep the checkpoints here (default: a temporary directory)")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    spec = WIDE
    if a.smoke:
        spec, a.calib_samples, a.num_samples, a.seq_len = replace(TINY, hidden=256, moe_intermediate=256), 4, 2, 64
    run = Run("w4afp8_pair", a, argv)
    fx = get_fixture(spec)
    src = Path(fx["model_dir"])
    train, held = torch.load(fx["train_tokens"]), torch.load(fx["heldout_tokens"])
    work = scratch_dir("qk-w4afp8-pair-", a.work)
    calib = work / "calib.jsonl"
    id_rows(calib, windows(train, a.seq_len, a.calib_samples, seed=2))
    heldout = work / "heldout.txt"  # byte-level vocabulary: verify reads the text's bytes as token ids
    heldout.write_bytes(bytes(held[:200_000].tolist()))
    dec, pre = work / "dec", work / "dec-prefill"

    conv, conv_m = run_quantkit(["convert", str(src), str(dec), "--recipe", a.recipe, "--pair", "fp8-prefill",
                         "--pair-out", str(pre), "--dataset", str(calib), "--num-samples", str(a.calib_samples),
                         "--seq-len", str(a.seq_len), "--overwrite"])
    print(f"convert ({a.recipe} --pair fp8-prefill): {conv_m['wall_s']:.1f} s", flush=True)
    ver, ver_m = run_quantkit(["verify", str(dec), "--pair", str(pre), "--reference", str(src), "--dataset", str(heldout),
                       "--num-samples", str(a.num_samples), "--seq-len", str(a.seq_len)])
    print(f"verify --pair --reference: {ver_m['wall_s']:.1f} s", flush=True)
    kv = [(dec / "model-kv-scales.safetensors"), (pre / "model-kv-scales.safetensors")]
    same_kv = kv[0].read_bytes() == kv[1].read_bytes()

    m, pm = ver["metrics"], ver["pair"]["metrics"]
    rows = [
        ("W4AFP8 as served (stage 3)", m["kl_divergence"], m["top1_agreement"], None),
        ("W4A16, same INT4 weights (stage 3)", m["kl_divergence_w4a16"], m["top1_agreement_w4a16"], None),
        ("pair: FP8 prefill -> W4AFP8 decode, FP8 KV", pm["pair"]["kl_divergence"], pm["pair"]["top1_agreement"],
         pm["pair"].get("generation_agreement")),
        ("decode model alone (W4AFP8, FP8 KV)", pm["decode"]["kl_divergence"], pm["decode"]["top1_agreement"],
         pm["decode"].get("generation_agreement")),
        ("prefill model alone (FP8, FP8 KV)", pm["prefill"]["kl_divergence"], pm["prefill"]["top1_agreement"],
         pm["prefill"].get("generation_agreement")),
    ]
    print(f"\nfixture: {src} (final training loss {fx['final_loss']:.3f}); {a.num_samples} held-out "
          f"windows of {a.seq_len} tokens; pair positions {pm['positions']}")
    print("| model | KL vs BF16 | top-1 vs BF16 | greedy agreement |\n|---|---|---|---|")
    for name, kl, top1, gen in rows:
        print(f"| {name} | {kl:.3e} | {top1:.2%} | {'-' if gen is None else f'{gen:.1%}'} |")
    print(f"\npair vs decode alone: KL {pm['pair']['kl_vs_decode']:.3e}, top-1 {pm['pair']['top1_vs_decode']:.2%}")
    print(f"W4AFP8 / W4A16 KL: {m['kl_divergence'] / m['kl_divergence_w4a16']:.3f}x; "
          f"KV-scale files byte-identical: {same_kv}")
    run.write([{"model": name, "kl_vs_bf16": kl, "top1_vs_bf16": top1, "greedy_agreement": gen}
               for name, kl, top1, gen in rows],
              {"fixture": {k: str(v) for k, v in fx.items()}, "recipe": a.recipe, "kv_scales_identical": same_kv,
               "convert": {**conv_m, "json": conv}, "verify": {**ver_m, "json": ver}})
    if not same_kv:
        sys.exit("the pair's KV-scale files differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
