"""Without a GPU, check that every kernel variant compiles for sm_90 (see _compile_sm90.py)."""

import os
import sys
from pathlib import Path

import pytest
import torch

from .helpers import needs_triton
from harness import run_bounded


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the kernel tests compile and run there")
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("_compile_sm90.py")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = run_bounded([sys.executable, str(script)], timeout=600, env=env, cwd=root)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
