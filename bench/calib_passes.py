"""GPTQ and AWQ wall time side by side, on the quality fixture's model and recipes (bench/quality.py), for one
or more source trees of quantkit in the same run (e.g. before and after a change).

    python -m bench calib_passes                              # this tree, --groups 32 --repeat 3
    python -m bench calib_passes --trees /tmp/qk-before .     # two trees, rounds interleaved
    python -m bench calib_passes --bench-moe --repeat 2       # the 32-expert bench MoE instead
    python -m bench calib_passes --smoke                      # the random fixture-shaped model, 4 x 32 tokens, once

The model: the trained quality fixture (bench/fixture.py) when it is cached, else (`--random`, or when it is
not) a random-weight qwen3_moe of the fixture's exact shape (hidden 128, 4 layers, 8 experts top-2 of width 128,
4 / 2 heads of 32, vocab 256) built with quantkit.testing, cached in bench/.cache/. Calibration: 64 windows of
128 tokens (the fixture's training windows with bench/quality.py's seed; random ids for the random model),
written as pre-tokenized rows. `--bench-moe`: the bench MoE (bench.harness.bench_moe instead random weights, 8 layers,
32 experts of width 256, hidden 512, top-4), with 16 x 256 random token ids unless --num-samples / --seq-len
say otherwise. Each conversion is quantkit's `convert()` with bench/quality.py's recipe for the method and
group (routed experts only), timed as bench/quality.py times it: the whole call. The worker process applies
the command's allocator settings (quantkit/allocator.py) before it imports torch, as `quantkit convert` does.

A round runs, for each tree in turn, one fresh process (quantkit imported from the tree, bench from this one) that converts once with RTN
and builds the calibration executor once (imports and first-touch costs, untimed), then each method in turn. `--repeat` rounds. The table gives
every wall time, the CPU time of the fastest and the ratio of each method's fastest to the first method's
(`--methods`, default gptq awq: the issue's target, AWQ within 2x of GPTQ). A method may name the pass's
compute dtype after an `@` (`gptq@bfloat16`: `convert --compute-dtype bfloat16`; none: the default). `other` is the CPU (in cores)
other processes used during a run: on a shared machine it inflates wall times. Results go to bench/results/calib_passes.json
(calib_passes-bench_moe.json with --bench-moe; `--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.harness import (BENCH_DIR, BENCH_MOE, Run, add_common_args, bench_moe, id_rows, last_json, measure_cmd,
                           measure_fn, scratch_dir, token_rows)


def _cpu_total() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # busy seconds of every core (idle, iowait out)


def model_and_rows(random: bool, num_samples: int, seq_len: int, work: Path,
                   moe: bool = False) -> tuple[Path, Path, str]:
    import torch

    from bench.fixture import CACHE, FixtureSpec
    from bench.quality import windows

    rows = work / "calib.jsonl"
    if moe:
        src = bench_moe(8)
        token_rows(rows, num_samples, seq_len, BENCH_MOE["vocab"])
        return src, rows, (f"the bench MoE ({src.parent.name}: 8 layers, {BENCH_MOE['experts']} experts, "
                           f"hidden {BENCH_MOE['hidden']}, random weights)")
    spec = FixtureSpec()
    done = CACHE / f"fixture-{spec.key}" / "fixture.json"
    if not random and done.is_file():
        train = torch.load(done.parent / "train.pt")
        ids = windows(train, seq_len, num_samples, seed=2)
        id_rows(rows, ids)
        return done.parent / "model", rows, f"the quality fixture ({done.parent.name}, trained)"
    from quantkit.tiny import make_tiny_model

    src = CACHE / f"fixture-shaped-random-{spec.key}"
    if not (src / "config.json").exists():
        make_tiny_model("qwen3_moe", src, layers=spec.layers, hidden=spec.hidden, experts=spec.experts,
                        moe_intermediate=spec.moe_intermediate, vocab=256, max_shard_size="2MB",
                        num_experts_per_tok=spec.top_k, num_attention_heads=spec.heads,
                        num_key_value_heads=spec.kv_heads, head_dim=spec.hidden // spec.heads)
    token_rows(rows, num_samples, seq_len, 256, seed=2)
    return src, rows, "a random-weight qwen3_moe of the fixture's shape (the trained fixture is not cached)"


def worker(a) -> int:
    """One round for one tree: RTN (untimed), then GPTQ and AWQ per group; one JSON line on stdout."""
    try:
        from quantkit import allocator  # before torch, as the command does

        allocator.tune()
    except ImportError:  # a tree from before the allocator settings
        pass
    import quantkit
    import torch
    from quantkit.convert import ConvertOptions, convert

    from bench.quality import method_options

    work = Path(a.work)

    def run(method: str, group: int) -> dict:
        o0 = _cpu_total()
        _, m = measure_fn(convert, a.model, work / f"out-{os.getpid()}-{method.replace('@', '-')}-{group}",
                          ConvertOptions(overwrite=True, dataset=a.rows, num_samples=a.num_samples, seq_len=a.seq_len,
                                         model_card=False, **method_options(method, group)))
        return {"wall_s": m["wall_s"], "cpu_s": m["cpu_s"],
                "other_cores": round(max(0.0, _cpu_total() - o0 - m["cpu_s"]) / m["wall_s"], 2)}

    run("rtn", a.groups[0])  # (RTN calibrates nothing: the dtype does not matter)
    # ... nor imports the calibrated pass: its modules and the model's transformers modeling (the executor's
    # meta model), ~2.5 s that would otherwise fall on the first method timed
    import importlib

    for mod in ("quantkit.calib.spool", "quantkit.calib.gptq_pass", "quantkit.calib.awq_pass"):
        try:
            importlib.import_module(mod)
        except ImportError:  # an older tree
            pass
    from quantkit.calib.executor import LayerExecutor

    LayerExecutor(a.model)
    out = {"quantkit": quantkit.__file__, "threads": torch.get_num_threads(),
           "runs": {f"g{g}": {m: run(m, g) for m in a.methods} for g in a.groups}}
    print(json.dumps(out), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench calib_passes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=[str(BENCH_DIR.parent)], help="quantkit source trees to time")
    ap.add_argument("--groups", type=int, nargs="+", default=[32])
    ap.add_argument("--methods", nargs="+", default=["gptq", "awq"],
                    help="bench/quality.py's method names (e.g. gptq-mse-aff4); ratios are to the first")
    ap.add_argument("--num-samples", type=int, default=None, help="default 64 (16 with --bench-moe)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 128 (256 with --bench-moe)")
    ap.add_argument("--bench-moe", action="store_true", help="the 32-expert bench MoE (harness.bench_moe)")
    ap.add_argument("--random", action="store_true", help="the random-weight model even if the fixture is cached")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    add_common_args(ap, repeat=3)
    a = ap.parse_args(argv)
    if a.smoke:
        a.random, a.num_samples, a.seq_len, a.repeat, a.methods = True, 4, 32, 1, ["gptq"]
    if a.num_samples is None:
        a.num_samples = 16 if a.bench_moe else 64
    if a.seq_len is None:
        a.seq_len = 256 if a.bench_moe else 128
    if a.worker:
        return worker(a)
    run = Run("calib_passes", a, argv)

    work = scratch_dir("qk-calib-passes-")
    src, rows, what = model_and_rows(a.random, a.num_samples, a.seq_len, work, a.bench_moe)
    trees = [str(Path(t).resolve()) for t in a.trees]
    print(f"model: {what}\n{a.num_samples} x {a.seq_len} tokens; trees: {', '.join(trees)}", flush=True)
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    # the worker imports quantkit from the tree and bench from this checkout: a folder holding only a link to
    # this bench/ comes first on its path (a tree of its own may have a bench/ too), the tree second
    link = work / "bench-only"
    link.mkdir(exist_ok=True)
    (link / "bench").symlink_to(BENCH_DIR)
    for r in range(a.repeat):
        for t in trees:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(link), t, os.environ.get("PYTHONPATH", "")])}
            cmd = [sys.executable, "-m", "bench.calib_passes", "--worker", "--model", str(src), "--rows", str(rows),
                   "--work", str(work), "--num-samples", str(a.num_samples), "--seq-len", str(a.seq_len),
                   "--groups", *map(str, a.groups), "--methods", *a.methods]
            p = measure_cmd(cmd, env=env, cwd=work, check=True)
            doc = last_json(p["stdout"].strip().splitlines()[-1])
            runs[t].append(doc)
            print(f"round {r + 1}, {t}: " + "; ".join(
                f"{g} " + ", ".join(f"{m} {v[m]['wall_s']:.2f} s" for m in a.methods) for g, v in doc["runs"].items()),
                flush=True)
    summary = {}
    first = a.methods[0]
    for t, docs in runs.items():
        for g in (f"g{x}" for x in a.groups):
            per = {m: [d["runs"][g][m] for d in docs] for m in a.methods}
            best = {m: min(v, key=lambda x: x["wall_s"]) for m, v in per.items()}
            s = {"best": best, **{f"{m}_wall_s": [x["wall_s"] for x in per[m]] for m in a.methods}}
            for m in a.methods[1:]:
                s[f"{m}_over_{first}_wall"] = round(best[m]["wall_s"] / best[first]["wall_s"], 2)
                s[f"{m}_over_{first}_cpu"] = round(min(x["cpu_s"] for x in per[m]) / min(x["cpu_s"] for x in per[first]), 2)
            summary.setdefault(t, {})[g] = s
    print(f"\ntree / group: wall s of each run, the fastest's CPU s, and the fastest's wall (CPU) over {first}'s")
    for t, by in summary.items():
        for g, s in by.items():
            for m in a.methods:
                ratio = (f"   {s[f'{m}_over_{first}_wall']} ({s[f'{m}_over_{first}_cpu']})" if m != first else "")
                print(f"{t[-28:]:28s} {g:5s} {m:14s} {' '.join(f'{x:6.2f}' for x in s[f'{m}_wall_s']):28s} "
                      f"cpu {s['best'][m]['cpu_s']:6.2f}{ratio}")
    rows_out = [{"tree": t, "group": g, "method": m, "best_wall_s": s["best"][m]["wall_s"],
                 "best_cpu_s": s["best"][m]["cpu_s"], "other_cores": s["best"][m]["other_cores"],
                 "over_first_wall": s.get(f"{m}_over_{first}_wall"), "over_first_cpu": s.get(f"{m}_over_{first}_cpu"),
                 "runs_wall_s": s[f"{m}_wall_s"]}
                for t, by in summary.items() for g, s in by.items() for m in a.methods]
    run.write(rows_out, {"model": what, "runs": runs}, tag="bench_moe" if a.bench_moe else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
