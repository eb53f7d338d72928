"""The refinements after GPTQ's solve (`refit_scales`, `refine_codes`) timed on the solve batches of a real
conversion, and their outputs kept, so that two trees can be compared on the same inputs.

    .venv/bin/python bench/solve_steps.py capture                  # convert once, keep each batch's inputs
    .venv/bin/python bench/solve_steps.py time -o /tmp/new.pt      # time this tree on them (best of --repeat)
    PYTHONPATH=/tmp/qk-base .venv/bin/python bench/solve_steps.py time -o /tmp/old.pt   # (from /tmp) another tree
    .venv/bin/python bench/solve_steps.py compare /tmp/old.pt /tmp/new.pt

`capture` converts bench/calib_dist.py's bench MoE (8 layers, 32 experts of [512, 512] gate/up and [512, 256]
down, 16 x 256 random token ids) with `int4-experts-gptq-fit`'s options (quality.py method
gptq-mse-aff2k-refit-cd2-fit50, g32) and keeps the arguments of the first --calls calls of each step (the
held-out check's re-solves included) in bench/.cache/solve_steps.pt. `time` replays them with the process's
allocator settings as `quantkit convert` applies them, and writes each call's result and best time; `compare`
prints the times side by side and counts the codes and scales that differ.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CAPTURE = HERE / ".cache" / "solve_steps.pt"
STEPS = ("refit_scales", "refine_codes")


def capture(calls: int) -> None:
    from quantkit import allocator

    allocator.tune()
    import torch

    sys.path.insert(0, str(HERE))
    from calib_dist import BENCH, _dataset, _source
    from quality import method_options

    import quantkit.calib.gptq_pass as gp
    from quantkit.convert import ConvertOptions, convert

    src = _source(8)
    work = HERE / ".cache" / "solve-steps-work"
    work.mkdir(parents=True, exist_ok=True)
    rows = _dataset(work / "calib.jsonl", 16, 256, BENCH["vocab"])
    kept: list[tuple[str, list, dict]] = []
    for name in STEPS:
        fn = getattr(gp, name)

        def keep(*a, _fn=fn, _name=name, **k):
            if sum(1 for c in kept if c[0] == _name) < calls:
                kept.append((_name, [x.clone() if torch.is_tensor(x) else x for x in a], dict(k)))
            return _fn(*a, **k)
        setattr(gp, name, keep)
    convert(src, work / "out", ConvertOptions(overwrite=True, dataset=rows, num_samples=16, seq_len=256,
                                              model_card=False,
                                              **method_options("gptq-mse-aff2k-refit-cd2-fit50", 32)))
    torch.save(kept, CAPTURE)
    print(f"kept {len(kept)} calls in {CAPTURE}: " + ", ".join(f"{n} {tuple(a[0].shape)}" for n, a, _ in kept))


def time_steps(out: Path, repeat: int) -> None:
    from quantkit import allocator

    allocator.tune()
    import torch

    import quantkit
    from quantkit.quant import gptq

    kept = torch.load(CAPTURE)
    results = []
    for name, args, kw in kept:
        fn = getattr(gptq, name)
        fn(*args, **kw)  # first use: compiled kernels loaded, buffers touched
        best, res = float("inf"), None
        for _ in range(repeat):
            t = time.perf_counter()
            res = fn(*args, **kw)
            best = min(best, time.perf_counter() - t)
        results.append((name, tuple(args[0].shape), best, res[0]))
        print(f"{name} {tuple(args[0].shape)}: {best * 1e3:.1f} ms")
    torch.save({"tree": str(Path(quantkit.__file__).parent.parent), "results": results}, out)


def compare(a: Path, b: Path) -> None:
    import torch

    ra, rb = torch.load(a), torch.load(b)
    print(f"{'step':14s} {'shape':16s} {Path(ra['tree']).name:>10s} {Path(rb['tree']).name:>10s}  differ")
    for (n, s, ta, xa), (_, _, tb, xb) in zip(ra["results"], rb["results"]):
        print(f"{n:14s} {str(s):16s} {ta * 1e3:8.1f} ms {tb * 1e3:8.1f} ms  {int((xa != xb).sum())} of {xa.numel()}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--calls", type=int, default=6, help="calls kept per step")
    t = sub.add_parser("time")
    t.add_argument("-o", "--output", type=Path, required=True)
    t.add_argument("--repeat", type=int, default=3)
    p = sub.add_parser("compare")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "capture":
        capture(args.calls)
    elif args.cmd == "time":
        time_steps(args.output, args.repeat)
    else:
        compare(args.a, args.b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
