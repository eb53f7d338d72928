"""The runner executes NVFP4 / MXFP4 checkpoints as written: routed experts stay packed (PackedFP4, w13 =
gate + up on one global scale) and run through fused_moe_fp4 (torch path here; the Triton kernels are
held against the same reference in test_fp4_kernels.py)."""

import pytest
import torch

from quantkit.convert import ConvertOptions, convert
from quantkit.runtime.fp4 import FP4Experts
from quantkit.runtime.runner import load_runner
from quantkit.testing import load_model


@pytest.mark.parametrize("recipe", ["nvfp4-experts", "mxfp4-experts"])
def test_runner_prefill_matches_the_source(tiny_models, tmp_path, recipe):
    src = tiny_models("qwen3_moe")
    convert(src, tmp_path / "q", ConvertOptions(recipe=recipe))
    r = load_runner(tmp_path / "q", dtype=torch.float32, backend="torch")
    assert isinstance(r.layers[1].mlp.experts, FP4Experts) and r.layers[1].mlp.experts.kind == recipe[:5]
    ids = [3, 17, 99, 250, 7, 42, 11, 500]
    got = r.prefill(0, ids)
    want = load_model(src, torch.float32)(torch.tensor([ids])).logits[0]
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 0.999, cos  # FP4 experts (SQNR ~20 dB) on a 2-layer random model
    # and a decode step through the paged cache works on the same weights
    logits, aborted = r.decode([0], [int(got[-1].argmax())])
    assert not aborted and torch.isfinite(logits).all()
