"""`plan --fit` on a trained model: at three byte budgets between all-INT4 and all-FP8, the chosen per-layer mix
against every uniform mix of the same candidate schemes, each converted and measured on held-out text, side by
side in one run; and whether the predicted loss (the sum of the units' one-at-a-time KLs) ranks them as measured.

    python -m bench fit [--calib-samples 32] [--num-samples 32] [--seq-len 128] [--vllm PY]
    python -m bench fit --smoke      # the 2-layer fixture trained for seconds: the bench's logic, not its figures

The model is bench/fixture.py's NORMTOPK fixture (qwen3_moe, 4 layers, 8 experts, top-2, hidden 128, trained on
the standard library's sources). Commands, as a user runs them:

1. `quantkit plan SRC --fit chosen-B.yaml --weights-gib B --kv-dtype bf16 --dataset calib.jsonl`: for each budget
   B (the first run measures the sensitivity table: one convert per scheme plus a KL per unit and scheme;
   the next two read it from the cache);
2. `quantkit convert SRC OUT --recipe R --dataset calib.jsonl` for each chosen recipe and each uniform mix
   (routed experts: keep / fp8-block / int4-g128-gptq / int4-g32-gptq / nvfp4 / mxfp4; dense Linears: keep /
   fp8-block; the uniform recipes written by quantkit.plan.mix, as `plan --fit` writes its own);
3. `quantkit verify OUT --reference SRC --dataset heldout.jsonl`: KL(source || output) on held-out windows;
   `bytes_exact`: the output's tensor bytes (its safetensors headers) equal what plan's arithmetic predicted.
With `--vllm PY` (a vLLM 0.33.0 venv's python), each chosen output also goes through bench/vllm_check.py (vLLM's
own loader: every tensor into a parameter).

The budgets: lo = bytes of all-INT4 (routed int4-g32-gptq, dense kept: the shipped int4-experts-gptq; `--low
int4-fp8`: dense fp8-block, as the glm recipe splits it), hi = bytes of all-FP8 (routed and dense fp8-block:
fp8-prefill's split); B = lo + f (hi - lo) for f in --fractions. KV dtype bf16 throughout (verify does not simulate an FP8
KV cache; the weights are what is chosen here).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from bench.fixture import NORMTOPK, TINY, get_fixture
from bench.harness import Run, add_common_args, id_rows, run_quantkit, scratch_dir, vllm_load_check
from bench.quality import heldout_windows, windows

from quantkit.arch import parse_config
from quantkit.plan import _tensor_shapes_from_checkpoint as headers
from quantkit.plan import mix
from quantkit.read.checkpoint import Checkpoint

GIB = 1 << 30


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def uniform_text(src: Path, routed: str, dense: str, calib: dict) -> tuple[str, list]:
    """The recipe of one uniform mix, as plan --fit writes a mix (quantkit.plan.mix), and its units."""
    t = headers(src)
    spec = parse_config(Checkpoint.open(src).config)
    units = mix.units(t, spec)
    rows = [(u, routed if u.kind == mix.ROUTED_KIND else dense, 0, 0.0) for u in units]
    return mix.chosen_recipe_text(f"uniform-{routed}-{dense}", rows, False, calib, ["a uniform mix (bench/fit.py)"]), units


def measure(src: Path, out: Path, recipe: Path, calib: Path, heldout: Path, a) -> dict:
    conv, cm = run_quantkit(["convert", src, out, "--recipe", recipe, "--dataset", calib, "--num-samples",
                             a.calib_samples, "--seq-len", a.seq_len, "--overwrite"])
    ver, vm = run_quantkit(["verify", out, "--reference", src, "--dataset", heldout, "--num-samples", a.num_samples,
                            "--seq-len", a.seq_len, "--no-save"])
    written = Checkpoint.open(out)  # the tensors' bytes as the output's safetensors headers give them
    return {"kl": ver["metrics"]["kl_divergence"], "top1": ver["metrics"]["top1_agreement"],
            "tensor_bytes": sum(i.nbytes for s in written.shards for i in s.tensors.values()),
            "bytes_written": conv["bytes_written"], "convert_s": round(cm["wall_s"], 1),
            "verify_s": round(vm["wall_s"], 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib-samples", type=int, default=32, help="calibration windows (sensitivity and GPTQ)")
    ap.add_argument("--num-samples", type=int, default=32, help="held-out windows verify measures")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--fractions", default="0.25,0.5,0.75", help="budgets between all-INT4 and all-FP8")
    ap.add_argument("--low", choices=("int4", "int4-fp8"), default="int4",
                    help="the all-INT4 end: routed INT4 g32 with the rest as it is, or with the dense Linears FP8")
    ap.add_argument("--vllm", default=None, help="a vLLM 0.33.0 venv's python: vLLM's loader on each chosen output")
    ap.add_argument("--work", default=None, help="keep the checkpoints here (default: a temporary directory)")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    spec = NORMTOPK
    if a.smoke:
        spec, a.calib_samples, a.num_samples, a.seq_len = TINY, 4, 2, 64
    run = Run("fit", a, argv)
    fx = get_fixture(spec)
    src = Path(fx["model_dir"])
    train, held = torch.load(fx["train_tokens"]), torch.load(fx["heldout_tokens"])
    work = scratch_dir("qk-fit-", a.work)
    calib, heldout = work / "calib.jsonl", work / "heldout.jsonl"
    id_rows(calib, windows(train, a.seq_len, a.calib_samples, seed=2))
    id_rows(heldout, heldout_windows(held, a.seq_len, a.num_samples, seed=3))
    cal = {"dataset": str(calib), "num_samples": a.calib_samples, "seq_len": a.seq_len}

    # the budgets, from the units' exact bytes
    t = headers(src)
    sp = parse_config(Checkpoint.open(src).config)
    units = mix.units(t, sp)
    ub, fixed, _ = mix.unit_bytes(t, sp, units, mix.CHOICES)

    def total(routed: str, dense: str) -> int:
        return fixed + sum(d[routed if k == mix.ROUTED_KIND else dense] for (_, k), d in ub.items())

    # all-INT4: the shipped int4-experts-gptq (routed experts INT4 g32, the rest as it is); --low int4-fp8: its
    # dense Linears in FP8 too (the glm recipe's split), a lower end where only 4-bit mixes fit
    lo = total("int4-g32-gptq", "fp8-block" if a.low == "int4-fp8" else mix.KEEP)
    hi = total("fp8-block", "fp8-block")
    fractions = [float(f) for f in a.fractions.split(",")]
    budgets = [lo + f * (hi - lo) for f in fractions]
    print(f"fixture {src}: all-INT4 {lo:,} B, all-FP8 {hi:,} B; budgets {[int(b) for b in budgets]}", flush=True)

    cache = work / "fit-cache"
    env_cache = {"XDG_CACHE_HOME": str(cache)}
    chosen, loss_table = [], None
    for f, b in zip(fractions, budgets):
        y = work / f"chosen-{f}.yaml"
        doc, m = run_quantkit(["plan", src, "--fit", y, "--gpus", "1", "--weights-gib", repr(b / GIB), "--kv-dtype",
                               "bf16", "--dataset", calib, "--num-samples", a.calib_samples, "--seq-len", a.seq_len],
                              env={**os.environ, **env_cache})
        fitd = doc["fit"]
        loss_table = {(u["layer"], u["kind"]): {c: o["loss"] for c, o in u["options"].items()} for u in fitd["units"]}
        chosen.append({"fraction": f, "budget": int(b), "recipe": y, "plan_s": round(m["wall_s"], 1),
                       "predicted": fitd["predicted_loss"], "weights_bytes": fitd["weights_bytes"],
                       "mix": {f"{u['layer']}.{u['kind']}": u["choice"] for u in fitd["units"]}})
        print(f"plan --fit at {f:.2f}: {m['wall_s']:.1f} s, predicted {fitd['predicted_loss']:.3e}, "
              f"{fitd['weights_bytes']:,} B of {int(b):,}", flush=True)

    rows = []
    for c in chosen:
        r = measure(src, work / f"chosen-{c['fraction']}", c["recipe"], calib, heldout, a)
        if a.vllm:
            r["vllm"] = vllm_load_check(a.vllm, work / f"chosen-{c['fraction']}")
        rows.append({"candidate": f"chosen@{c['fraction']:.2f}", "kind": "chosen", "budget": c["budget"],
                     "bytes": c["weights_bytes"], "predicted": c["predicted"], "mix": c["mix"], **r,
                     "bytes_exact": r["tensor_bytes"] == c["weights_bytes"]})
        print(f"chosen@{c['fraction']:.2f}: KL {r['kl']:.3e} (predicted {c['predicted']:.3e})", flush=True)
    routed_choices = [c.name for c in mix.CHOICES if mix.ROUTED_KIND in c.kinds]
    dense_choices = [c.name for c in mix.CHOICES if mix.DENSE_KIND in c.kinds]
    for rc in routed_choices:
        for dc in dense_choices:
            if rc == dc == mix.KEEP:
                continue
            text, _ = uniform_text(src, rc, dc, cal)
            y = work / f"uniform-{rc}-{dc}.yaml"
            y.write_text(text)
            r = measure(src, work / f"uniform-{rc}-{dc}", y, calib, heldout, a)
            pred = sum(d[rc if k == mix.ROUTED_KIND else dc] for (_, k), d in loss_table.items())
            rows.append({"candidate": f"uniform {rc} / {dc}", "kind": "uniform", "bytes": total(rc, dc),
                         "predicted": pred, **r, "bytes_exact": r["tensor_bytes"] == total(rc, dc)})
            print(f"uniform {rc}/{dc}: KL {r['kl']:.3e} (predicted {pred:.3e}), {total(rc, dc):,} B", flush=True)

    summary = {"fixture": {k: str(v) for k, v in fx.items()}, "all_int4_bytes": lo, "all_fp8_bytes": hi, "low": a.low,
               "budgets": []}
    print("\n| budget | chosen KL | best uniform that fits | its KL | ratio |\n|---|---|---|---|---|")
    for row in (r for r in rows if r["kind"] == "chosen"):
        fits = [u for u in rows if u["kind"] == "uniform" and u["bytes"] <= row["budget"]]
        best = min(fits, key=lambda u: u["kl"]) if fits else None
        ratio = row["kl"] / best["kl"] if best else None
        summary["budgets"].append({"budget": row["budget"], "chosen_kl": row["kl"],
                                   "best_uniform": best and best["candidate"], "best_uniform_kl": best and best["kl"],
                                   "ratio": ratio})
        print(f"| {row['budget']:,} B | {row['kl']:.3e} | {best['candidate'] if best else '-'} | "
              f"{best['kl'] if best else float('nan'):.3e} | {ratio if ratio else float('nan'):.3f} |")
    rho = spearman([r["predicted"] for r in rows], [r["kl"] for r in rows])
    summary["spearman_predicted_vs_measured"] = rho
    summary["bytes_exact"] = all(r["bytes_exact"] for r in rows)
    print(f"\nSpearman(predicted, measured) over {len(rows)} candidates: {rho:.3f}")
    for r in rows:
        r.pop("recipe", None)
    run.write(rows, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
