"""`python -m bench --smoke all`: every bench on its tiny case, in one run (several minutes on 2 cores, so besides
the `slow` mark it runs only with QUANTKIT_BENCH_SMOKE=1: the default test run stays as long as it was). A bench
whose requirement is absent (a peer venv, a GPU, llama.cpp, vLLM) is reported as skipped, with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("QUANTKIT_BENCH_SMOKE") != "1",
                    reason="several minutes: set QUANTKIT_BENCH_SMOKE=1 to run every bench's smoke case")
def test_every_bench_runs_its_smoke_case():
    p = subprocess.run([sys.executable, "-m", "bench", "--smoke", "all"], cwd=ROOT, capture_output=True, text=True,
                       timeout=3600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert " 0 failed" in p.stdout
