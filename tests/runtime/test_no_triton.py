"""quantkit.runtime must import and run its torch paths when triton is not installed."""

import sys

from harness import run_bounded

SCRIPT = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton blocked for this test")
sys.meta_path.insert(0, Block())
import torch
import quantkit.runtime as rt
assert not rt.triton_available()
from quantkit.runtime.synth import random_int4
w = random_int4(16, 64, 32)
y = rt.int4_gemm(torch.randn(2, 64).bfloat16(), w)  # auto -> torch
assert y.shape == (2, 16)
try:
    rt.int4_gemm(torch.randn(2, 64).bfloat16(), w, backend="triton")
except RuntimeError as e:
    assert "not installed" in str(e)
else:
    raise AssertionError("backend='triton' should fail without triton")
print("ok")
"""


def test_imports_and_runs_without_triton():
    r = run_bounded([sys.executable, "-c", SCRIPT], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")
