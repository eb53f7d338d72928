"""Quality of INT4 expert quantization on a *trained* tiny MoE (bench/fixture.py): held-out perplexity and
mean next-token KL(bf16 || quantized) for BF16, RTN, GPTQ and AWQ at group 32 and 128, all through the real
pipeline (`quantkit convert` with a recipe, then transformers loading the written checkpoint).

Optionally, side by side on the same model, the same calibration tokens and the same targets,
llm-compressor's `oneshot` GPTQ (W4A16, same group size) run in a separate venv (`--peer-python`):
wall time and the same metrics.

    python bench/quality.py [--groups 32 128] [--num-samples 64] [--eval-windows 2048] [--fp4 nvfp4 mxfp4]
                            [--peer-python bench/.cache/peer-venv/bin/python]

`--fp4`: NVFP4 / MXFP4 experts (RTN and GPTQ; each format has its own group) beside the INT4 rows, and with
the peer, llm-compressor's NVFP4A16 preset on the same targets.

Evaluation: non-overlapping 128-token windows of the held-out split (2048 of them by default, ~260k
tokens; 0 = all), computed in float32. Besides perplexity and KL(bf16 || q), each row reports the exact
split of its NLL change into KL + `cross` (see `evaluate`) and the standard error of that change, so
that a perplexity difference can be told from noise. Writes bench/results/quality.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture import FixtureSpec, get_fixture  # noqa: E402

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
TARGETS = ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']


# FP4 "groups": the format names its own group (NVFP4: 16 values, FP8 scale, FP32 global; MXFP4: 32, E8M0)
FP4_SCHEMES = {"nvfp4": "{num_bits: 4, type: float, symmetric: true, strategy: tensor_group}",
               "mxfp4": "{num_bits: 4, type: float, symmetric: true, strategy: group}"}


def recipe_yaml(method: str, group: int | str) -> str:
    """`method` rtn, gptq or awq; "rtn-mse" is RTN with `scale_search: mse` (each group's clipping searched),
    "gptq-mse" GPTQ with `observer: mse` (each group's scale searched against the Hessian-weighted error)."""
    base, _, search = method.partition("-")
    opts = {"gptq": "    options: {damp: 0.01, actorder: true, block_size: 128}\n", "awq": "    options: {n_grid: 20}\n",
            "rtn": ""}[base]
    if base == "gptq" and search:
        opts, search = opts.replace("}", f", observer: {search}}}"), ""
    scheme = FP4_SCHEMES.get(str(group)) or (f"{{num_bits: 4, type: int, symmetric: true, strategy: group, "
                                             f"group_size: {group}}}")
    if search:
        scheme = scheme[:-1] + f", scale_search: {search}}}"
    return (f"name: bench-{method}-g{group}\ngroups:\n  experts:\n    targets: {json.dumps(TARGETS)}\n"
            f"    method: {base}\n    scheme: {scheme}\n{opts}ignore: ['re:.*\\.mlp\\.gate$', 'lm_head']\n")


def windows(tokens: torch.Tensor, seq_len: int, n: int, seed: int) -> torch.Tensor:
    """n windows of seq_len tokens at seeded random offsets (they may overlap): the calibration samples."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (n,), generator=g)
    return torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])


def heldout_windows(tokens: torch.Tensor, seq_len: int, n: int, seed: int) -> torch.Tensor:
    """n distinct non-overlapping windows of the held-out split in seeded order (n = 0 or more than there
    are: all of them)."""
    total = len(tokens) // seq_len
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    take = order if n <= 0 else order[:n]
    return torch.stack([tokens[s * seq_len:(s + 1) * seq_len] for s in take.tolist()])


EVAL_BATCH = 32


@torch.no_grad()
def evaluate(model_dir, eval_ids: torch.Tensor, ref: dict | None = None, src=None):
    """Held-out metrics of the checkpoint in model_dir, computed in float32 (the stored weights are exact in
    it; bf16 arithmetic would add its own rounding noise to every comparison).

    With `ref` (the BF16 model's evaluation) also: KL(bf16 || q) per token, and the exact split of the
    change in mean NLL into KL + `cross`, where cross = E[(p_bf16 - onehot(y)) . (log q - log p_bf16)]: the
    part of the NLL change that comes from the direction of the perturbation relative to the reference's
    own errors. For a model trained to a minimum of its loss this term vanishes to first order; for an
    undertrained one it can dominate perplexity differences. `dnll_se`: standard error of the mean NLL
    change over windows. `src`: the BF16 checkpoint, for outputs transformers cannot load as written."""
    from quantkit.testing import load_model
    from quantkit.verify.numerics import load_dequantized, transformers_cannot_load

    if src is not None and transformers_cannot_load(Path(model_dir)):
        # NVFP4 routed experts: transformers drops their global scales on load, so the BF16 model gets the
        # dequantized weights (what verify does; compressed-tensors' decompressor agrees bit for bit)
        model = load_dequantized(Path(src), Path(model_dir), torch.device("cpu"), torch.float32)
    else:
        model = load_model(model_dir, torch.float32).eval()
    nll_w, kl_w, lps = [], [], []
    for j, i in enumerate(range(0, len(eval_ids), EVAL_BATCH)):
        x = eval_ids[i:i + EVAL_BATCH]
        lp = F.log_softmax(model(x).logits.float()[:, :-1], -1)
        nll_w.append(-lp.gather(-1, x[:, 1:, None])[..., 0].mean(1))
        if ref is None:
            lps.append(lp)
        else:
            r = ref["logprobs"][j]
            kl_w.append((r.exp() * (r - lp)).sum(-1).mean(1))
    nll = torch.cat(nll_w).double()
    out = {"perplexity": float(nll.mean().exp()), "kl": 0.0, "cross": 0.0, "dnll_se": 0.0}
    if ref is not None:
        dn = nll - ref["nll"]
        kl = float(torch.cat(kl_w).double().mean())
        out.update(kl=kl, cross=float(dn.mean()) - kl, dnll_se=float(dn.std() / len(dn) ** 0.5))
        return out, None
    return out, {"logprobs": lps, "nll": nll}


def run_quantkit(src, out, method, group, calib_file, num_samples, seq_len):
    from quantkit.convert import ConvertOptions, convert
    from quantkit.match.recipe import parse_recipe

    r = parse_recipe(recipe_yaml(method, group))
    t0 = time.perf_counter()
    convert(src, out, ConvertOptions(recipe=r, overwrite=True, dataset=str(calib_file), num_samples=num_samples,
                                     seq_len=seq_len))
    return time.perf_counter() - t0


PEER = textwrap.dedent("""
    import json, sys, time, torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    src, out, calib, group, seq_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    rows = [json.loads(l) for l in open(calib)]
    ds = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows],
                            "attention_mask": [[1] * len(r["input_ids"]) for r in rows]})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    scheme = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                          "group_size": group}, "targets": ["Linear"]}
    mod = GPTQModifier(config_groups={"group_0": scheme},
                       ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"], dampening_frac=0.01,
                       actorder="static", block_size=128)
    oneshot(model=model, dataset=ds, recipe=[mod], max_seq_length=seq_len, num_calibration_samples=len(rows))
    model.save_pretrained(out, save_compressed=True)
    print(json.dumps({"seconds": time.perf_counter() - t0}))
""")

# llm-compressor's NVFP4 weights-only preset (its NVFP4 examples' QuantizationModifier: min-max scales,
# one global scale per matrix, fused gate/up global scales made equal), on the same targets
PEER_NVFP4 = textwrap.dedent("""
    import json, sys, time, torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    src, out, calib, seq_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rows = [json.loads(l) for l in open(calib)]
    ds = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows],
                            "attention_mask": [[1] * len(r["input_ids"]) for r in rows]})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    mod = QuantizationModifier(targets="Linear", scheme="NVFP4A16",
                               ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"])
    oneshot(model=model, dataset=ds, recipe=[mod], max_seq_length=seq_len, num_calibration_samples=len(rows))
    model.save_pretrained(out, save_compressed=True)
    print(json.dumps({"seconds": time.perf_counter() - t0}))
""")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--methods", nargs="+", default=["rtn", "gptq", "awq"],
                    help="rtn, gptq, awq, rtn-mse (RTN with scale_search: mse) or gptq-mse (GPTQ, observer: mse)")
    ap.add_argument("--fixture-steps", type=int, default=None,
                    help="train the fixture for this many steps instead of FixtureSpec's (a cheaper, less trained model)")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--calib-seed", type=int, default=2, help="seed of the calibration windows")
    ap.add_argument("--eval-windows", type=int, default=2048,
                    help="non-overlapping held-out windows to evaluate on (0: the whole held-out split)")
    ap.add_argument("--peer-python", default=None, help="python of a venv with llmcompressor installed")
    ap.add_argument("--fp4", nargs="*", default=[], choices=["nvfp4", "mxfp4"],
                    help="also these FP4 formats (RTN and GPTQ), beside the INT4 groups; with --peer-python, "
                         "llm-compressor's NVFP4 too")
    a = ap.parse_args()

    fx = get_fixture(FixtureSpec() if a.fixture_steps is None else FixtureSpec(steps=a.fixture_steps))
    src = Path(fx["model_dir"])
    train, held = torch.load(fx["train_tokens"]), torch.load(fx["heldout_tokens"])
    eval_ids = heldout_windows(held, a.seq_len, a.eval_windows, seed=1)
    calib_ids = windows(train, a.seq_len, a.num_samples, seed=a.calib_seed)
    work = Path(tempfile.mkdtemp(prefix="qk-quality-"))
    calib_file = work / "calib.jsonl"
    calib_file.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in calib_ids))

    rows = []
    base, ref_lp = evaluate(src, eval_ids)
    rows.append({"method": "bf16", "group": None, **base, "seconds": None})
    print(f"bf16: ppl {base['perplexity']:.4f}", flush=True)
    for group in list(a.groups) + list(a.fp4):
        for method in (a.methods if group not in FP4_SCHEMES else [m for m in a.methods if m != "awq"]):
            out = work / f"{method}-g{group}"
            secs = run_quantkit(src, out, method, group, calib_file, a.num_samples, a.seq_len)
            m, _ = evaluate(out, eval_ids, ref_lp, src)
            rows.append({"method": method, "group": group, **m, "seconds": round(secs, 2), "tool": "quantkit"})
            print(f"quantkit {method} g{group}: ppl {m['perplexity']:.4f} kl {m['kl']:.3e} cross {m['cross']:+.3e} "
                  f"({secs:.1f}s)", flush=True)
        if a.peer_python and group == "nvfp4":
            out = work / "llmc-nvfp4"
            script = work / "peer_nvfp4.py"
            script.write_text(PEER_NVFP4)
            t0 = time.perf_counter()
            p = subprocess.run([a.peer_python, str(script), str(src), str(out), str(calib_file), str(a.seq_len)],
                               capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                print("llm-compressor NVFP4 failed:\n" + p.stderr[-3000:], file=sys.stderr)
                continue
            inner = json.loads(p.stdout.strip().splitlines()[-1])["seconds"]
            m, _ = evaluate(out, eval_ids, ref_lp, src)
            rows.append({"method": "rtn", "group": group, **m, "seconds": round(inner, 2),
                         "process_seconds": round(wall, 2), "tool": "llm-compressor"})
            print(f"llm-compressor nvfp4: ppl {m['perplexity']:.4f} kl {m['kl']:.3e} ({inner:.1f}s)", flush=True)
        if a.peer_python and group not in FP4_SCHEMES:
            out = work / f"llmc-gptq-g{group}"
            script = work / "peer.py"
            script.write_text(PEER)
            t0 = time.perf_counter()
            p = subprocess.run([a.peer_python, str(script), str(src), str(out), str(calib_file), str(group),
                                str(a.seq_len)], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                print("llm-compressor failed:\n" + p.stderr[-3000:], file=sys.stderr)
                continue
            inner = json.loads(p.stdout.strip().splitlines()[-1])["seconds"]
            m, _ = evaluate(out, eval_ids, ref_lp, src)
            rows.append({"method": "gptq", "group": group, **m, "seconds": round(inner, 2),
                         "process_seconds": round(wall, 2), "tool": "llm-compressor"})
            print(f"llm-compressor gptq g{group}: ppl {m['perplexity']:.4f} kl {m['kl']:.3e} cross {m['cross']:+.3e} "
                  f"({inner:.1f}s)", flush=True)

    summary = {}
    for group in a.fp4:
        by = {(r.get("tool"), r["method"]): r for r in rows if r["group"] == group}
        rtn_r, gptq_r, peer = by.get(("quantkit", "rtn")), by.get(("quantkit", "gptq")), by.get(("llm-compressor", "rtn"))
        s = {}
        if rtn_r and gptq_r and rtn_r["kl"]:
            s["gptq_kl_vs_rtn"] = gptq_r["kl"] / rtn_r["kl"]
            s["gptq_target_met"] = s["gptq_kl_vs_rtn"] <= 0.8  # the issue's target: GPTQ KL <= 0.8x RTN's
        if peer and rtn_r:
            s["rtn_kl_vs_llmcompressor"] = rtn_r["kl"] / peer["kl"] if peer["kl"] else None
        if peer and gptq_r:
            s["gptq_kl_vs_llmcompressor"] = gptq_r["kl"] / peer["kl"] if peer["kl"] else None
        summary[group] = s
    for group in a.groups:
        by = {(r.get("tool"), r["method"]): r for r in rows if r["group"] == group}
        rtn_r, gptq_r, awq_r = by.get(("quantkit", "rtn")), by.get(("quantkit", "gptq")), by.get(("quantkit", "awq"))
        s = {}
        if rtn_r:
            gap = rtn_r["perplexity"] - base["perplexity"]
            for name, r in (("gptq", gptq_r), ("awq", awq_r)):
                if r:
                    s[f"{name}_ppl_gap_closed"] = (rtn_r["perplexity"] - r["perplexity"]) / gap if gap > 0 else None
                    s[f"{name}_kl_vs_rtn"] = r["kl"] / rtn_r["kl"] if rtn_r["kl"] else None
        peer = by.get(("llm-compressor", "gptq"))
        if peer and gptq_r:
            s["time_vs_llmcompressor"] = gptq_r["seconds"] / peer["seconds"]
            s["ppl_vs_llmcompressor"] = gptq_r["perplexity"] / peer["perplexity"]
        # the issue's targets: at group 128 each method closes >= 30% of RTN's gap to BF16; at group 32
        # neither is worse than RTN; GPTQ within 0.5x llm-compressor's time and 1.01x its perplexity
        if rtn_r:
            for name, r in (("gptq", gptq_r), ("awq", awq_r)):
                if r is None:
                    continue
                closed = s.get(f"{name}_ppl_gap_closed")
                s[f"{name}_target_met"] = (closed is not None and closed >= 0.3) if group == 128 else (
                    r["perplexity"] <= rtn_r["perplexity"])
        if "time_vs_llmcompressor" in s:
            s["llmcompressor_target_met"] = s["time_vs_llmcompressor"] <= 0.5 and s["ppl_vs_llmcompressor"] <= 1.01
        summary[f"g{group}"] = s
    doc = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
           "fixture": {k: v for k, v in fx.items() if k not in ("model_dir", "train_tokens", "heldout_tokens")},
           "settings": vars(a), "rows": rows, "summary": summary}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quality.json").write_text(json.dumps(doc, indent=2))
    print("\n| tool | method | group | perplexity | KL(bf16 \\|\\| q) | cross | dNLL s.e. | seconds |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.get('tool', '-')} | {r['method']} | {r['group'] or '-'} | {r['perplexity']:.4f} | "
              f"{r['kl']:.3e} | {r['cross']:+.2e} | {r['dnll_se']:.1e} | "
              f"{r['seconds'] if r['seconds'] is not None else '-'} |")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
