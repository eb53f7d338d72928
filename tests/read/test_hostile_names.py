"""Indices in tensor names are input: a 5,000-digit layer or expert "index" (Python's int() refuses strings
over 4,300 digits) is a named error from every command that reads the names, never an internal error."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from harness import run_bounded
from quantkit.errors import ConfigMismatch
from quantkit.read.safetensors import SafetensorsFile
from quantkit.write.writer import write_safetensors

HUGE = "9" * 5000


def _add_tensor(src, name):
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    shard = sorted(set(idx["weight_map"].values()))[0]
    with SafetensorsFile(src / shard) as f:
        tensors = {n: f.get(n) for n in f.header.tensors}
    tensors[name] = torch.zeros(4, 4, dtype=torch.bfloat16)
    write_safetensors(src / shard, tensors, metadata={"format": "pt"})
    idx["weight_map"][name] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))


@pytest.mark.parametrize("name", [f"model.layers.{HUGE}.mlp.gate.weight",
                                  f"model.layers.1.mlp.experts.{HUGE}.gate_proj.weight"])
def test_huge_indices_are_named_errors(tmp_path, name):
    from quantkit.testing import make_tiny_model

    src = make_tiny_model("qwen3_moe", tmp_path / "src")
    _add_tensor(src, name)
    from quantkit.plan import plan

    if "experts" not in name:  # an expert "index" that is not one is a stray tensor: copied, not an error
        with pytest.raises(ConfigMismatch, match="without a decoder-layer index"):
            plan(str(src))
    for cmd in (["convert", str(src), str(tmp_path / "q"), "-r", "int4-experts-rtn"], ["plan", str(src)]):
        p = run_bounded([sys.executable, "-m", "quantkit", *cmd], timeout=120)
        assert "internal error" not in p.stderr and p.returncode in (0, 1), p.stderr[-1500:]
