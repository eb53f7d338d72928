"""GPTQ against RTN with a small calibration set on tiny random MoE models (quantkit.testing.make_tiny_model,
8 routed experts, top-2): the held-out next-token KL(source || quantized) of the shipped recipes
`int4-experts-gptq` and `int4-experts-rtn` (group 32), and their ratio.

    python -m bench small_calib [--archs deepseek_v3 glm_moe_dsa] [--samples 16 128] [--seq-len 64]
                                [--recipes int4-experts-rtn int4-experts-gptq] [--seeds 0]
                                [--calib text|random] [--eval text|random] [--calib-random N]
    python -m bench small_calib --smoke   # qwen3_moe, 4 samples x 32 tokens, 8 evaluation windows

Tokens: the shipped calibration set's text as UTF-8 bytes (the tiny models have no tokenizer), one stream;
calibration windows are drawn (seeded) from its first 80%, the evaluation windows are the non-overlapping
windows of the last 20%. Both are written as pre-tokenized rows, so every recipe sees the same tokens.
With few tokens per expert (16 x 64 tokens, 8 experts, top-2: ~256 routed tokens per expert for an input
width of 128), a plain GPTQ over-fits its Hessian and can do worse than RTN (issue 30); the held-out
check of calib/gptq_pass.py is what keeps it from doing so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import REPO, Run, add_common_args, id_rows, measure_fn, scratch_dir

ROOT = REPO


def token_stream(vocab: int) -> torch.Tensor:
    lines = (ROOT / "quantkit/data/calibration/default.jsonl").read_text(encoding="utf-8").splitlines()
    data = b"\n\n".join(json.loads(l)["text"].encode("utf-8") for l in lines if l.strip())
    return torch.tensor(list(data), dtype=torch.long) % vocab


@torch.no_grad()
def logprobs(model_dir, ids: torch.Tensor, src=None) -> torch.Tensor:
    """Next-token log-probabilities; an output transformers cannot load as written (asymmetric or NVFP4
    experts) is measured as the source model `src` with its dequantized weights, as quality.py does."""
    from quantkit.testing import load_model
    from quantkit.verify.numerics import load_dequantized, transformers_cannot_load

    if src is not None and transformers_cannot_load(Path(model_dir)):
        model = load_dequantized(Path(src), Path(model_dir), torch.device("cpu"), torch.float32).eval()
    else:
        model = load_model(model_dir, torch.float32).eval()
    return torch.cat([F.log_softmax(model(ids[i:i + 16]).logits.float()[:, :-1], -1) for i in range(0, len(ids), 16)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench small_calib", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=["deepseek_v3", "glm_moe_dsa"])
    ap.add_argument("--samples", type=int, nargs="+", default=[16])
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--recipes", nargs="+", default=["int4-experts-rtn", "int4-experts-gptq"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="model seeds")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--eval", choices=["text", "random"], default="text",
                    help="held-out windows: the last 20%% of the text, or uniformly random tokens of the vocabulary")
    ap.add_argument("--calib", choices=["text", "random"], default="text")
    ap.add_argument("--calib-random", type=int, default=0,
                    help="rows of uniformly random token ids appended to the calibration set")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.archs, a.samples, a.seq_len, a.eval_windows = ["qwen3_moe"], [4], 32, 8
    run = Run("small_calib", a, argv)

    from quantkit.convert import ConvertOptions, convert
    from quantkit.testing import make_tiny_model, quiet_transformers

    quiet_transformers()
    work = scratch_dir("qk-small-calib-")
    rows = []
    for arch in a.archs:
        for seed in a.seeds:
            src = make_tiny_model(arch, work / f"{arch}-{seed}", seed=seed, experts=8)
            vocab = json.loads((src / "config.json").read_text())["vocab_size"]
            stream = token_stream(vocab)
            cut = int(len(stream) * 0.8)
            held = stream[cut:]
            n_eval = min(a.eval_windows, len(held) // a.seq_len)
            eval_ids = held[: n_eval * a.seq_len].reshape(n_eval, a.seq_len)
            if a.eval == "random":
                eval_ids = torch.randint(0, vocab, (a.eval_windows, a.seq_len), generator=torch.Generator().manual_seed(5))
            ref = logprobs(src, eval_ids)
            for n in a.samples:
                g = torch.Generator().manual_seed(1)
                starts = torch.randint(0, cut - a.seq_len, (n,), generator=g).tolist()
                calib = work / f"calib-{n}.jsonl"
                rows_c = [stream[s:s + a.seq_len] for s in starts]
                if a.calib == "random":
                    rows_c = list(torch.randint(0, vocab, (n, a.seq_len), generator=g))
                if a.calib_random:
                    rows_c += list(torch.randint(0, vocab, (a.calib_random, a.seq_len),
                                                 generator=torch.Generator().manual_seed(3)))
                id_rows(calib, rows_c)
                kls = {}
                for recipe in a.recipes:
                    out = work / f"{arch}-{seed}-{n}-{recipe}"
                    _, m = measure_fn(convert, src, out, ConvertOptions(
                        recipe=recipe, overwrite=True, dataset=str(calib), num_samples=len(rows_c), seq_len=a.seq_len,
                        model_card=False))
                    secs = m["wall_s"]
                    lp = logprobs(out, eval_ids, src)
                    kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
                    kls[recipe] = kl
                    methods = {}
                    man = json.loads((out / "quantkit_manifest.json").read_text()) \
                        if (out / "quantkit_manifest.json").is_file() else {}
                    for name, m in (man.get("tensors") or {}).items():
                        if name.endswith(".weight_packed") and "method" in m:
                            methods[m["method"]] = methods.get(m["method"], 0) + 1
                    rows.append({"arch": arch, "seed": seed, "samples": n, "recipe": recipe, "kl": kl,
                                 "seconds": round(secs, 2), "methods": methods})
                    print(f"{arch} seed {seed} {n}x{a.seq_len} {recipe}: KL {kl:.4e} ({secs:.1f}s) {methods}",
                          flush=True)
                base = kls.get("int4-experts-rtn")
                for recipe, kl in kls.items():
                    if base and recipe != "int4-experts-rtn":
                        print(f"  {recipe} / rtn = {kl / base:.3f}", flush=True)
    run.write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
