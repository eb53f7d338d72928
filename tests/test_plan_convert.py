"""`plan --recipe` predicts the bytes `convert` actually writes (within 0.5%) on converted fixtures."""

import pytest

from quantkit.convert import ConvertOptions, convert
from quantkit.read.checkpoint import Checkpoint
from quantkit.plan import plan


@pytest.mark.parametrize("recipe", ["int4-experts-rtn"])
def test_predicted_bytes_match_written(arch, tiny_models, tmp_path, recipe):
    src = tiny_models(arch)
    rep = plan(src, recipe).to_json()
    convert(src, tmp_path / "q", ConvertOptions(recipe=recipe))
    written = Checkpoint.open(tmp_path / "q").total_bytes
    predicted = rep["checkpoint_bytes"]["recipe"]
    assert abs(predicted - written) / written < 0.005, (predicted, written)
    assert rep["checkpoint_bytes"]["source"] == Checkpoint.open(src).total_bytes or \
        abs(rep["checkpoint_bytes"]["source"] - Checkpoint.open(src).total_bytes) / Checkpoint.open(src).total_bytes < 0.005
