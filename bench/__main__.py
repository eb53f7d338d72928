"""`python -m bench`: list, run, smoke-run the benches, and regenerate bench/README.md's tables."""

from __future__ import annotations

import ast
import importlib
import os
import sys
import time

from bench.harness import BENCH_DIR, Skip, measure_cmd

SKIP_RC = 75  # a bench that skipped (something it needs is absent) exits with this
NOT_BENCHES = {"__init__", "__main__", "harness", "readme"}
# modules run by other benches or in other environments: listed, not smoke-run
HELPERS = {"setup_probe": "run in a fresh process by calib_cost (python -m bench.setup_probe)",
           "vllm_check": "run by vllm_matrix with a vLLM venv's Python (as a file: it imports nothing from bench)"}


def modules() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if p.stem not in NOT_BENCHES)


def summary_line(name: str) -> str:
    doc = ast.get_docstring(ast.parse((BENCH_DIR / f"{name}.py").read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def run_one(name: str, argv: list[str]) -> int:
    if name not in modules():
        print(f"no bench {name!r}; `python -m bench --list` lists them", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"bench.{name}")
    try:
        rc = mod.main(argv)
    except Skip as e:
        print(f"skipped: {e}", file=sys.stderr)
        return SKIP_RC
    return int(rc or 0)


def smoke_all(names: list[str], timeout: int) -> int:
    """Each bench's --smoke case in a fresh process; a table of what ran, skipped (and why) and failed."""
    results = []
    for name in names:
        if name in HELPERS:
            results.append((name, "helper", 0.0, HELPERS[name]))
            continue
        print(f"--- {name} --smoke", file=sys.stderr, flush=True)
        r = measure_cmd([sys.executable, "-m", "bench", name, "--smoke"], timeout=timeout)
        tail = [line for line in r["stderr"].strip().splitlines() if line.strip()]
        if r["rc"] == 0:
            status, why = "ok", ""
        elif r["rc"] == SKIP_RC:
            status, why = "skipped", next((ln.split("skipped: ", 1)[1] for ln in reversed(tail) if "skipped: " in ln),
                                          "")
        else:
            status = "timed out" if r["timed_out"] else f"FAILED (rc {r['rc']})"
            why = " | ".join(tail[-3:])
            print(r["stderr"][-3000:], file=sys.stderr)
        results.append((name, status, r["wall_s"], why))
        print(f"{name}: {status} in {r['wall_s']:.1f} s {why}", file=sys.stderr, flush=True)
    print(f"\n{'bench':<18}{'status':<16}{'seconds':>8}  reason")
    for name, status, secs, why in results:
        print(f"{name:<18}{status:<16}{secs:>8.1f}  {why}")
    skipped = [n for n, s, _, _ in results if s == "skipped"]
    failed = [n for n, s, _, _ in results if s not in ("ok", "skipped", "helper")]
    print(f"\n{sum(s == 'ok' for _, s, _, _ in results)} ran, {len(skipped)} skipped"
          + (f" ({', '.join(skipped)})" if skipped else "") + f", {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


USAGE = __doc__ + """
    python -m bench --list
    python -m bench NAME [args]          (NAME --help: its arguments; every bench takes --out, --smoke)
    python -m bench --smoke all|NAME...  [--timeout S]
    python -m bench readme [--check]
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--list":
        for name in modules():
            kind = "helper" if name in HELPERS else "bench"
            print(f"{name:<18}{kind:<8}{summary_line(name)}")
        return 0
    if argv[0] == "--smoke":
        rest = argv[1:]
        timeout = 600
        if "--timeout" in rest:
            i = rest.index("--timeout")
            timeout = int(rest[i + 1])
            rest = rest[:i] + rest[i + 2:]
        names = modules() if rest in ([], ["all"]) else rest
        t0 = time.perf_counter()
        rc = smoke_all(names, timeout)
        print(f"smoke run: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        return rc
    if argv[0] == "readme":
        from bench import readme

        return readme.main(argv[1:])
    return run_one(argv[0], argv[1:])


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    sys.exit(main())
