"""The refinements after GPTQ's solve (`refit_scales`, `refine_codes`) timed on the solve batches of a real
conversion, and their outputs kept, so that two trees can be compared on the same inputs.

    python -m bench solve_steps capture                  # convert once, keep each batch's inputs
    python -m bench solve_steps time -o /tmp/new.pt      # time this tree on them (best of --repeat)
    (cd /tmp && PYTHONPATH=/tmp/qk-base:/work/main /work/main/.venv/bin/python -m bench solve_steps time -o /tmp/old.pt)
                                                         # another tree's quantkit (first on the path), this bench/
    python -m bench solve_steps compare /tmp/old.pt /tmp/new.pt
    python -m bench solve_steps --smoke                  # capture, time and compare on a 1-layer, 4-expert model

`capture` converts the bench MoE (bench.harness.bench_moe (8 layers, 32 experts of [512, 512] gate/up and [512, 256]
down), 16 x 256 random token ids, with `int4-experts-gptq-fit`'s options (quality.py method
gptq-mse-aff2k-refit-cd2-fit50, g32) and keeps the arguments of the first --calls calls of each step (the
held-out check's re-solves included) in bench/.cache/solve_steps.pt. `time` replays them with the process's
allocator settings as `quantkit convert` applies them, and writes each call's result and best time; `compare`
prints the times side by side and counts the codes and scales that differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.harness import BENCH_MOE, CACHE, Run, add_common_args, bench_moe, measure_fn, scratch_dir, token_rows

CAPTURE = CACHE / "solve_steps.pt"
STEPS = ("refit_scales", "refine_codes")


def capture(calls: int, path: Path = CAPTURE, layers: int = 8, experts: int = BENCH_MOE["experts"],
            samples: int = 16, seq_len: int = 256) -> None:
    from quantkit import allocator

    allocator.tune()
    import torch

    import quantkit.calib.gptq_pass as gp
    from bench.quality import method_options
    from quantkit.convert import ConvertOptions, convert

    src = bench_moe(layers, experts)
    work = scratch_dir("qk-solve-steps-")
    rows = token_rows(work / "calib.jsonl", samples, seq_len, BENCH_MOE["vocab"])
    kept: list[tuple[str, list, dict]] = []
    for name in STEPS:
        fn = getattr(gp, name)

        def keep(*a, _fn=fn, _name=name, **k):
            if sum(1 for c in kept if c[0] == _name) < calls:
                kept.append((_name, [x.clone() if torch.is_tensor(x) else x for x in a], dict(k)))
            return _fn(*a, **k)
        setattr(gp, name, keep)
    convert(src, work / "out", ConvertOptions(overwrite=True, dataset=rows, num_samples=samples, seq_len=seq_len,
                                              model_card=False,
                                              **method_options("gptq-mse-aff2k-refit-cd2-fit50", 32)))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(kept, path)
    print(f"kept {len(kept)} calls in {path}: " + ", ".join(f"{n} {tuple(a[0].shape)}" for n, a, _ in kept))


def time_steps(out: Path, repeat: int, path: Path = CAPTURE) -> list[dict]:
    from quantkit import allocator

    allocator.tune()
    import torch

    import quantkit
    from quantkit.quant import gptq

    kept = torch.load(path, weights_only=False)  # our own capture: tensors and QParams
    results, rows = [], []
    for name, args, kw in kept:
        fn = getattr(gptq, name)
        fn(*args, **kw)  # first use: compiled kernels loaded, buffers touched
        best, res = float("inf"), None
        for _ in range(repeat):
            res, m = measure_fn(fn, *args, **kw)
            best = min(best, m["wall_s"])
        results.append((name, tuple(args[0].shape), best, res[0]))
        rows.append({"step": name, "shape": "x".join(map(str, args[0].shape)), "best_ms": round(best * 1e3, 2)})
        print(f"{name} {tuple(args[0].shape)}: {best * 1e3:.1f} ms")
    torch.save({"tree": str(Path(quantkit.__file__).parent.parent), "results": results}, out)
    return rows


def compare(a: Path, b: Path) -> None:
    import torch

    ra, rb = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    print(f"{'step':14s} {'shape':16s} {Path(ra['tree']).name:>10s} {Path(rb['tree']).name:>10s}  differ")
    for (n, s, ta, xa), (_, _, tb, xb) in zip(ra["results"], rb["results"]):
        print(f"{n:14s} {str(s):16s} {ta * 1e3:8.1f} ms {tb * 1e3:8.1f} ms  {int((xa != xb).sum())} of {xa.numel()}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench solve_steps", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, repeat=None)
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("capture")
    c.add_argument("--calls", type=int, default=6, help="calls kept per step")
    t = sub.add_parser("time")
    t.add_argument("-o", "--output", type=Path, required=True)
    t.add_argument("--repeat", type=int, default=3)
    p = sub.add_parser("compare")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        run = Run("solve_steps", args, argv)
        work = scratch_dir("qk-solve-steps-smoke-")
        capture(1, work / "kept.pt", layers=1, experts=4, samples=4, seq_len=32)
        rows = time_steps(work / "t.pt", 1, work / "kept.pt")
        compare(work / "t.pt", work / "t.pt")
        run.write(rows)
    elif args.cmd == "capture":
        capture(args.calls)
    elif args.cmd == "time":
        run = Run("solve_steps", args, argv)
        run.write(time_steps(args.output, args.repeat), tag="time")
    elif args.cmd == "compare":
        compare(args.a, args.b)
    else:
        ap.error("capture, time or compare (or --smoke)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
