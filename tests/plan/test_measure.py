"""`quantkit plan --calibration N,T --measure`: the cost model's rates measured on this machine
(quantkit/plan/measure.py, which bench/calib_cost.py uses too) and the prediction made with them. The
measurements run on small shapes here (a few seconds); what they are worth is checked by bench/calib_cost.py."""

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.errors import ConfigError
from quantkit.plan import measure
from quantkit.plan.calibration import THROUGHPUT, Throughput
from quantkit.testing import tiny_config

MEASURED = {"gemm_flops", "gemm_half_rows", "gram_flops", "gram_half_rows", "block_form_flops", "chol_flops",
            "sweep_col_s", "sweep_elems_per_s", "mem_bytes_per_s", "op_s", "read_bytes_per_s", "write_bytes_per_s",
            "fsync_s", "module_s", "fake_quant_elems_per_s", "hash_bytes_per_s", "process_bytes", "layer_s",
            "alt_gemm_flops"}


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(measure, "HIDDEN", 64)
    monkeypatch.setattr(measure, "INTER", 32)
    monkeypatch.setattr(measure, "MIN_S", 0.005)


def _config(tmp_path: Path) -> Path:
    cfg = tiny_config("qwen3_moe", layers=2, experts=8, hidden=128, moe_intermediate=64).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "config.json"


def test_measured_table(small):
    lines = []
    t = measure.measure_throughput("cpu", log=lines.append)
    shipped = THROUGHPUT["cpu"]
    assert t.kind == "cpu" and t.provenance == "measured" and t.source.startswith("quantkit plan --measure")
    assert t.threads == torch.get_num_threads()
    for f in fields(Throughput):
        v = getattr(t, f.name)
        if f.name in MEASURED:
            assert isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, (f.name, v)
            if f.name not in ("gemm_half_rows", "gram_half_rows"):
                assert v > 0, f.name
    # what is not measured is the shipped table's, and the table says so
    assert (t.link_bytes_per_s, t.setup_s, t.startup_s) == (shipped.link_bytes_per_s, shipped.setup_s,
                                                             shipped.startup_s)
    assert any("not measured" in n for n in t.notes)
    assert sum(getattr(t, k) != getattr(shipped, k) for k in MEASURED) >= len(MEASURED) - 1
    assert len(lines) >= 8  # one progress line per measurement
    assert Throughput.from_json(t.to_json()) == t


def test_cli_measure(small, tmp_path):
    cfg = _config(tmp_path)
    base = ["plan", str(cfg), "--recipe", "int4-experts-gptq", "--calibration", "8,64", "--device", "cpu", "--json"]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 0, r.output
    shipped = json.loads(r.stdout)["calibration"]
    r = CliRunner().invoke(app, base + ["--measure"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout[r.stdout.index("{"):])["calibration"]
    k = got["constants"]
    assert k["provenance"] == "measured" and k["source"].startswith("quantkit plan --measure")
    assert shipped["constants"]["provenance"] == "measured" and shipped["constants"]["source"] != k["source"]
    assert got["total_seconds"] > 0 and got["total_seconds"] != shipped["total_seconds"]
    assert got["constants"]["values"]["gemm_flops"] != shipped["constants"]["values"]["gemm_flops"]


def test_cli_measure_needs_calibration(tmp_path):
    r = CliRunner().invoke(app, ["plan", str(_config(tmp_path)), "--recipe", "int4-experts-gptq", "--measure"])
    assert r.exit_code == 2 and "--calibration" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: its rates can be measured")
def test_cli_measure_cuda_without_a_gpu(tmp_path):
    r = CliRunner().invoke(app, ["plan", str(_config(tmp_path)), "--recipe", "int4-experts-gptq", "--calibration",
                                 "8,64", "--device", "cuda", "--measure"])
    assert r.exit_code == 1 and isinstance(r.exception, ConfigError) and "needs one here" in str(r.exception)
