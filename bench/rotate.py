"""The residual rotation (recipe `rotate: {kind: hadamard}`) against none, side by side on the trained quality
fixture: NVFP4 W4A4 GPTQ, NVFP4 W4A16, MXFP4 W4A16 (RTN, the shipped recipes) and INT4 W4A16 GPTQ
(int4-experts-gptq), each converted with and without the rotation from the same BF16 fixture on the same
calibration tokens, then `quantkit verify --reference` on held-out text: next-token KL, top-1, the convert's wall
time and peak RSS (`quantkit convert --json` in a process of its own, its RSS polled); then convert time and peak RSS on a
0.6 GB synthetic qwen3_moe (hidden 2048), RTN with and without the rotation. About 5 minutes on 2 loaded cores.

    python -m bench rotate [--seed S] [--smoke]     # --smoke: the 5-step fixture, INT4 RTN only (seconds)

The fixture is bench/fixture.py's NORMTOPK (a byte-level qwen3_moe, hidden 128: one 128-wide Hadamard block,
trained norms whose gains the rotation folds into the readers). Calibration: 64 x 256 bytes of training text;
evaluation: 16 x 256 held-out bytes. Each row's `ratio_kl` and `ratio_convert_s` compare it with the same recipe
unrotated; the RTN recipes run a second seed too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.harness import Run, add_common_args, mib, run_quantkit, verify_json


ROTATE = "rotate: {{kind: hadamard, seed: {seed}}}\n"
# NVFP4 W4A4 with GPTQ: bench/w4a4.py's --trained recipe
NVFP4A4_GPTQ = """
name: nvfp4a4-experts-gptq
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']
    method: gptq
    scheme: {num_bits: 4, type: float, symmetric: true, strategy: tensor_group, activations: nvfp4}
    options: {damp: 0.01, actorder: true, block_size: 128, fallback: all_tokens}
ignore: ['re:.*\\.mlp\\.gate$', 'lm_head']
"""


def recipes(smoke: bool) -> dict[str, str]:
    """Recipe name -> its YAML text (shipped recipes read as shipped)."""
    from quantkit.match.recipe import load_recipe

    if smoke:
        return {"int4-experts-rtn": load_recipe("int4-experts-rtn").text}
    return {"nvfp4a4-experts-gptq": NVFP4A4_GPTQ, "nvfp4-experts": load_recipe("nvfp4-experts").text,
            "mxfp4-experts": load_recipe("mxfp4-experts").text,
            "int4-experts-gptq": load_recipe("int4-experts-gptq").text}


def streamed(tmp: Path, seed: int, smoke: bool) -> list[dict]:
    """Convert time and peak RSS where the weights are large enough to matter: bench/convert_rtn.py's synthetic
    qwen3_moe (Qwen3-30B-A3B's widths, hidden 2048: one 2048-wide block; 0.6 GB, two shards), int4-experts-rtn
    with and without the rotation and the rotation alone, each the best of two runs."""
    from bench.convert_rtn import SMOKE_ARCH, make_checkpoint

    from quantkit.match.recipe import load_recipe

    src = make_checkpoint(0.01, 2, arch=SMOKE_ARCH) if smoke else make_checkpoint(0.5, 2)
    rtn = load_recipe("int4-experts-rtn").text
    cases = {"int4-experts-rtn": rtn, "int4-experts-rtn + rotate": ROTATE.format(seed=seed) + rtn,
             "rotate only": ROTATE.format(seed=seed)}
    rows, base = [], None
    for name, text in cases.items():
        yaml = tmp / f"streamed-{len(rows)}.yaml"
        yaml.write_text(text)
        runs = []
        for _ in range(2):
            out = tmp / "streamed-out"
            doc, m = run_quantkit(["convert", src, out, "--recipe", yaml, "--overwrite"])
            runs.append({**doc, "peak_rss_bytes": m["peak_rss_bytes"]})
        best = min(runs, key=lambda d: d["seconds"])
        row = {"recipe": name, "rotation": "hadamard seed %d" % seed if "rotate" in name else "none",
               "model": f"synthetic qwen3_moe {src.name}", "convert_s": best["seconds"],
               "peak_rss_mib": mib(max(d["peak_rss_bytes"] for d in runs)),
               "source_mib": mib(best["bytes_read"])}
        if base is None:
            base = row
        else:
            row["ratio_convert_s"] = round(row["convert_s"] / base["convert_s"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench rotate", description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="the rotation's seed (its random signs)")
    add_common_args(ap, repeat=None)
    args = ap.parse_args(argv)
    run = Run("rotate", args, argv)

    from bench.fixture import NORMTOPK, TINY, get_fixture, stdlib_corpus
    from quantkit.match.recipe import parse_recipe

    spec = TINY if args.smoke else NORMTOPK
    fx = get_fixture(spec, log=lambda m: print(m, file=sys.stderr))
    train, held = stdlib_corpus(spec.corpus_bytes)
    n_cal, n_eval, length = (8, 4, 128) if args.smoke else (64, 16, 256)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qk-bench-rotate-") as tmp:
        tmp = Path(tmp)

        def jsonl(name, data, n):  # n texts of `length` bytes (a byte-level model: tokens are bytes)
            step = max(length, (len(data) - length) // n)
            texts = [data[i * step: i * step + length].decode("latin-1") for i in range(n)]
            (tmp / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
            return str(tmp / name)

        cal, ev = jsonl("cal.jsonl", train, n_cal), jsonl("eval.jsonl", held, n_eval)
        src = Path(fx["model_dir"])
        for name, text in recipes(args.smoke).items():
            base = None
            # the RTN recipes (seconds each) also with a second seed: how much the seed alone moves the KL
            seeds = [None, args.seed] + ([args.seed + 1] if "gptq" not in name and not args.smoke else [])
            for seed in seeds:
                rotated = seed is not None
                recipe = parse_recipe((ROTATE.format(seed=seed) if rotated else "") + text, name)
                out = tmp / f"{name}-{'rot%d' % seed if rotated else 'plain'}"
                yaml = tmp / f"{out.name}.yaml"
                yaml.write_text(recipe.text)
                # in a process of its own: its peak RSS is the convert's alone (convert --json reports it)
                doc, m = run_quantkit(["convert", src, out, "--recipe", yaml, "--dataset", cal, "--num-samples",
                                       n_cal, "--seq-len", length])
                v = verify_json(out, reference=src, dataset=ev, num_samples=n_eval, seq_len=length,
                                generation_tokens=0)
                mt = v["metrics"]
                row = {"recipe": name, "rotation": f"hadamard seed {seed}" if rotated else "none",
                       "kl": mt["kl_divergence"], "top1": mt["top1_agreement"], "ppl_ref": mt["perplexity_reference"],
                       "ppl": mt["perplexity_quantized"], "convert_s": doc["seconds"],
                       "peak_rss_mib": mib(m["peak_rss_bytes"]), "passed": v["passed"]}
                if base is None:
                    base = row
                else:
                    row["ratio_kl"] = round(row["kl"] / base["kl"], 3) if base["kl"] else None
                    row["ratio_convert_s"] = round(row["convert_s"] / base["convert_s"], 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
        rows += streamed(tmp, args.seed, args.smoke)
    model = f"fixture {spec.key} ({spec.steps} steps, final loss {fx['final_loss']:.3f}, hidden {spec.hidden})"
    run.write(rows, summary={"model": model, "calibration": f"{n_cal} x {length} training bytes",
                             "evaluation": f"{n_eval} x {length} held-out bytes"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
