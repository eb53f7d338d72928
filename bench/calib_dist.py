"""GPTQ convert of the bench MoE on 1, 2 and 3 ranks (torchrun, gloo, one thread per rank): wall times and
a byte comparison of every output file.

    python -m bench calib_dist                      # the issue's bench model, 32 x 256 tokens, ranks 1 2 3
    python -m bench calib_dist --samples 16         # 16 x 256
    python -m bench calib_dist --quick --out /tmp/x # 2 layers, 8 x 64: the bench's own logic (~1 min)
    python -m bench calib_dist --smoke              # 1 layer, 4 experts, ranks 1 2, 2 x 16 tokens
    python -m bench calib_dist --repeat 3 --peer-python bench/.cache/peer-venv/bin/python
                                                    # 3 interleaved rounds with llm-compressor, medians

The model: bench.harness.bench_moe (qwen3_moe built with quantkit.tiny.make_tiny_model (random BF16 weights): 8 layers, 32 routed
experts per layer, hidden 512, expert width 256, top-4 routing, 8 query / 4 KV heads of 64, vocab 4096).
Calibration: `--samples` rows of `--seq-len` random token ids (seeded; an `input_ids` JSONL file, so no
tokenizer is involved). Recipe int4-experts-gptq (`--recipe`: another shipped one).

World size 1 is a plain `python -m quantkit convert` with OMP_NUM_THREADS=1 (one thread; `--torchrun-one`:
under torchrun too); world size n > 1 is
`torchrun --standalone --nproc-per-node n -m quantkit convert ...` with OMP_NUM_THREADS=1 in every rank (gloo
on the CPU). Each run writes a fresh output directory (--overwrite). Reported per world size: the command's
wall time (process start and imports included), the conversion's own `seconds` (rank 0's ConvertResult) and
the pass's own time from the timeline (`pass`: the slowest rank's load, forward, statistics, solve, exchange,
wait, write and kv phases; quantkit/timeline.py), each rank's phases in wall and CPU seconds,
the speed-up of both against world size 1, whether every output file is byte-identical to world size 1's,
and `quantkit plan --calibration`'s prediction of the pass for that world size on one thread per rank (with
`--measure`, also with rates measured here for each world size as its ranks compute: plan --measure --gpus N).
Run it on a quiet machine with at least as many cores as the largest world size: the ranks share the cores.

Writes bench/results/calib_dist.json (or under --out) and prints the markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from bench.harness import (BENCH_MOE, CACHE, GPTQ_RECIPE, Run, add_common_args, bench_moe, last_json, measure_cmd,
                           run_convert, token_rows)

RECIPE = GPTQ_RECIPE


def _hashes(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def convert_row(n: int, src: Path, out: Path, data: Path, samples: int, seq_len: int, timeout: int,
                torchrun_one: bool = False, extra: tuple[str, ...] = (), recipe: str | None = None) -> dict:
    """One measured convert on `n` ranks (harness.run_convert) as a row: wall, the conversion's own seconds, its
    peak RSS (rank 0's report), the pass's seconds from the timeline, the timeline."""
    r = run_convert(n, src, out, data, samples, seq_len, timeout, torchrun_one, extra, recipe or RECIPE)
    res = r["reported"]
    ranks = (res.get("timeline") or {}).get("ranks") or []
    return {"world_size": n, "wall_s": round(r["wall_s"], 2), "convert_s": res.get("seconds"),
            "peak_rss_bytes": res.get("peak_rss_bytes"), "pass_s": _pass_seconds(ranks),
            "setup_pass_s": _pass_seconds(ranks, phases=("setup", *PASS_PHASES)),
            "pass_cpu_s": _pass_seconds(ranks, "phases_cpu"), "timeline": ranks}


# The calibrated pass's own phases (quantkit/timeline.py): what ranks can divide, KV-scale calibration (`kv`,
# data parallel: --recipe fp8-kv) included. Left out: `setup` (the model skeleton, the plan: every rank pays
# it) and `stream` (the RTN shard conversion after the pass).
PASS_PHASES = ("load", "forward", "statistics", "grams", "solve", "exchange", "wait", "write", "kv")


def _pass_seconds(ranks: list[dict], key: str = "phases", phases: tuple[str, ...] = PASS_PHASES) -> float | None:
    """The pass's own time: the slowest rank's sum of `phases` (wall, or main-thread CPU with phases_cpu). A
    rank's waits at checks that followed a step outside `phases` (`wait_after`: e.g. rank 1 waiting at the end
    for rank 0 to convert the larger shard, `stream`) are that step's, not the pass's: left out of the wall."""
    if not ranks:
        return None

    def own(r: dict) -> float:
        t = sum((r.get(key) or {}).get(p, 0.0) for p in phases)
        if key == "phases" and "wait" in phases:
            t -= sum(v for k, v in (r.get("wait_after") or {}).items() if k not in phases)
        return t

    return round(max(own(r) for r in ranks), 3)


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return round(xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2, 3)


def _peer(python: Path, src: Path, work: Path, data: Path, seq_len: int, timeout: int) -> dict:
    """llm-compressor's GPTQ of the same model on the same token file (quality's peer script)."""
    from bench.quality import PEER

    script = work / "peer.py"
    script.write_text(PEER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    r = measure_cmd([str(python), str(script), str(src), str(work / "peer-out"), str(data), "32", str(seq_len)],
                    env=env, timeout=timeout, check=True)
    wall = r["wall_s"]
    inner = last_json(r["stdout"])["seconds"]
    print(f"llm-compressor: {wall:.2f} s wall, {inner:.2f} s inside", file=sys.stderr)
    return {"wall_s": round(wall, 2), "seconds": round(inner, 2), "threads": 1}


def main(argv=None) -> int:
    global RECIPE
    ap = argparse.ArgumentParser(prog="python -m bench calib_dist", description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--recipe", default=RECIPE, help="a shipped recipe (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="2 layers, 8 samples x 64 tokens")
    ap.add_argument("--torchrun-one", action="store_true",
                    help="world size 1 under torchrun too (--nproc-per-node 1), so every world size pays the launcher")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--measure", action="store_true",
                    help="also predict with rates measured here before the rounds, for each world size as its ranks "
                         "compute (plan --measure --gpus N: one thread each, N - 1 neighbours alongside)")
    ap.add_argument("--peer-python", type=Path, default=None,
                    help="python of a venv with llmcompressor (bench/setup_peers.sh): also its `oneshot` GPTQ (W4A16, "
                         "group 32, quality's script) on the same model and tokens, one thread, after the ranks")
    add_common_args(ap)  # --repeat: rounds, every configuration (and the peer) once per round; medians reported
    a = ap.parse_args(argv)
    RECIPE = a.recipe
    experts = BENCH_MOE["experts"]
    if a.quick:
        a.layers, a.samples, a.seq_len = 2, 8, 64
    if a.smoke:
        a.layers, a.samples, a.seq_len, a.ranks, experts = 1, 2, 16, [1, 2], 4
    run = Run("calib_dist", a, argv)
    ranks = sorted(set(a.ranks) | {1})
    src = bench_moe(a.layers, experts)
    work = CACHE / "calib-dist-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = token_rows(work / "tokens.jsonl", a.samples, a.seq_len, BENCH_MOE["vocab"])
    tables = {}
    if a.measure:
        from quantkit.plan.measure import measure_throughput

        config = json.loads((src / "config.json").read_text())
        for n in ranks:
            print(f"measuring the rates of one of {n} rank(s), one thread each", file=sys.stderr)
            tables[n] = measure_throughput("cpu", ranks=n, threads=1, config=config,
                                           source="python -m bench calib_dist --measure")
    runs: dict[int, list[dict]] = {n: [] for n in ranks}
    peers: list[dict] = []
    hashes: dict[int, dict[str, str]] = {}
    diffs: dict[int, set[str]] = {n: set() for n in ranks}
    for rep in range(a.repeat):  # interleaved, so that a slow spell of the machine hits every configuration
        for n in ranks:
            out = work / f"world{n}"
            r = convert_row(n, src, out, data, a.samples, a.seq_len, a.timeout, a.torchrun_one)
            h = _hashes(out)
            ref = hashes.setdefault(1, h) if n == 1 else hashes[1]
            hashes.setdefault(n, h)
            diffs[n] |= {f for f in set(ref) | set(h) if ref.get(f) != h.get(f)}
            print(f"[{rep + 1}/{a.repeat}] world size {n}: {r['wall_s']} s wall, {r['convert_s']} s convert",
                  file=sys.stderr)
            runs[n].append(r)
        if a.peer_python:
            peers.append(_peer(a.peer_python, src, work, data, a.seq_len, a.timeout))
    rows = []
    for n in ranks:
        rs = runs[n]
        rows.append({"world_size": n, "wall_s": _median([r["wall_s"] for r in rs]),
                     "convert_s": _median([r["convert_s"] for r in rs if r["convert_s"] is not None]),
                     "peak_rss_bytes": max((r["peak_rss_bytes"] or 0) for r in rs) or None,
                     "pass_s": _median([r["pass_s"] for r in rs if r.get("pass_s") is not None]),
                     "setup_pass_s": _median([r["setup_pass_s"] for r in rs if r.get("setup_pass_s") is not None]),
                     "pass_cpu_s": _median([r["pass_cpu_s"] for r in rs if r.get("pass_cpu_s") is not None]),
                     "timeline": rs[-1].get("timeline"),
                     "wall_runs": [r["wall_s"] for r in rs], "convert_runs": [r["convert_s"] for r in rs]})
    from quantkit.plan.calibration import CostOptions, calibration_cost

    base = rows[0]
    for r in rows:  # the plan's prediction of the pass on one thread per rank, as the ranks ran
        plan = calibration_cost(str(src), RECIPE, a.samples, a.seq_len,
                                CostOptions(world_size=r["world_size"], device="cpu", threads=1))
        r["plan_pass_s"] = round(plan.total_seconds, 3)
        r["plan_error"] = (round(plan.total_seconds / r["setup_pass_s"] - 1, 3) if r.get("setup_pass_s")
                           else None)
        if tables:
            m = calibration_cost(str(src), RECIPE, a.samples, a.seq_len,
                                 CostOptions(world_size=r["world_size"], device="cpu", throughput=tables[r["world_size"]]))
            r["plan_measured_s"] = round(m.total_seconds, 3)
            r["plan_measured_error"] = (round(m.total_seconds / r["setup_pass_s"] - 1, 3) if r.get("setup_pass_s")
                                        else None)
            r["measured_table"] = tables[r["world_size"]].to_json()
        r["speedup_wall"] = round(base["wall_s"] / r["wall_s"], 3)
        r["speedup_convert"] = (round(base["convert_s"] / r["convert_s"], 3)
                                if base["convert_s"] and r["convert_s"] else None)
        r["speedup_pass"] = round(base["pass_s"] / r["pass_s"], 3) if base.get("pass_s") and r.get("pass_s") else None
        diff = sorted(diffs[r["world_size"]])
        r["byte_identical"] = not diff
        r["differing_files"] = diff
    doc = {"model": {"arch": "qwen3_moe", "layers": a.layers, **BENCH_MOE, "experts": experts}, "recipe": RECIPE,
           "calibration": {"samples": a.samples, "seq_len": a.seq_len, "tokens": "random ids, seed 0"},
           "threads_per_rank": 1, "backend": "gloo", "world_size_1": "torchrun" if a.torchrun_one else "python -m quantkit",
           "files": len(hashes[1])}
    lines = [f"Calibrated convert ({RECIPE}) of the bench MoE: qwen3_moe, {a.layers} layers, {experts} experts, "
             f"hidden {BENCH_MOE['hidden']}; {a.samples} x {a.seq_len} calibration tokens; one thread per rank, gloo; "
             f"{os.cpu_count()} CPUs.", "",
             "| world size | wall (s) | convert (s) | pass (s) | speed-up (wall) | speed-up (convert) | speed-up (pass) "
             "| set-up + pass (s), plan (s), error | peak RSS rank 0 (MiB) | output vs world size 1 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rss = f"{r['peak_rss_bytes'] / 2 ** 20:.0f}" if r["peak_rss_bytes"] else "-"
        same = "byte-identical" if r["byte_identical"] else f"{len(r['differing_files'])} files differ"
        lines.append(f"| {r['world_size']} | {r['wall_s']} | {r['convert_s']} | {r['pass_s']} | {r['speedup_wall']}x | "
                     f"{r['speedup_convert']}x | {r['speedup_pass']}x | {r['setup_pass_s']}, {r['plan_pass_s']}, "
                     f"{'-' if r['plan_error'] is None else format(r['plan_error'], '+.0%')} | {rss} | {same} "
                     f"({len(hashes[r['world_size']])} files) |")
    if tables:
        lines += ["", "Plan with rates measured here before the rounds (plan --measure --gpus N, one thread per rank, "
                      "N - 1 neighbours computing alongside): "
                  + "; ".join(f"world size {r['world_size']} {r['plan_measured_s']} s against {r['setup_pass_s']} s, "
                              + ("-" if r["plan_measured_error"] is None else format(r["plan_measured_error"], "+.0%"))
                              for r in rows) + "."]
    lines += ["", "pass: the slowest rank's time in the calibrated pass's own phases (timeline: "
              + ", ".join(PASS_PHASES) + "; its waits after steps outside them, e.g. `stream`, left out); "
              "set-up + pass: the same with the `setup` phase (the executor, the "
              "modeling imports); plan: `quantkit plan --calibration`'s total for that world size with one thread per "
              "rank (calibration_cost(..., threads=1)), set-up included; per rank and phase, wall / CPU seconds "
              "(last round), and the rank's wait split by the step whose check it waited at:",
              ""]
    for r in rows:
        for t in r.get("timeline") or []:
            lines.append(f"- world size {r['world_size']}, rank {t['rank']}: "
                         + ", ".join(f"{k} {v:.2f}/{t.get('phases_cpu', {}).get(k, 0):.2f}"
                                     for k, v in t["phases"].items())
                         + ("; wait after " + ", ".join(f"{k} {v:.2f}" for k, v in t["wait_after"].items())
                            if t.get("wait_after") else ""))
    if peers:
        peer = {"wall_s": _median([p["wall_s"] for p in peers]), "seconds": _median([p["seconds"] for p in peers]),
                "threads": 1, "wall_runs": [p["wall_s"] for p in peers]}
        doc["peer"] = peer
        lines += ["", f"llm-compressor `oneshot` GPTQ (W4A16 g32, experts only), one thread: {peer['wall_s']} s wall "
                      f"({peer['seconds']} s load + oneshot + save); quantkit world size 1 / llm-compressor wall: "
                      f"{base['wall_s'] / peer['wall_s']:.2f}x"]
    if a.repeat > 1:
        lines += ["", f"Medians of {a.repeat} runs each, interleaved (every configuration once per round); "
                      "every run: " + "; ".join(f"world size {r['world_size']} {r['wall_runs']}" for r in rows)
                  + (f"; llm-compressor {peer['wall_runs']}" if peers else "") + " s wall."]
    for r in rows:
        r["peak_rss_mib"] = round(r["peak_rss_bytes"] / 2 ** 20) if r["peak_rss_bytes"] else None
    run.write(rows, doc)
    print("\n".join(lines))
    return 0 if all(r["byte_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
