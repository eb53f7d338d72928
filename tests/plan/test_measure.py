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
from quantkit.plan.throughput import THROUGHPUT, Throughput
from quantkit.testing import tiny_config

MEASURED = {"gemm_flops", "gemm_half_rows", "gram_flops", "gram_half_rows", "block_form_flops", "chol_flops",
            "sweep_col_s", "sweep_elems_per_s", "mem_bytes_per_s", "op_s", "read_bytes_per_s", "write_bytes_per_s",
            "fsync_s", "module_s", "fake_quant_elems_per_s", "hash_bytes_per_s", "process_bytes", "layer_s",
            "alt_gemm_flops", "chol_half_k"}


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(measure, "HIDDEN", 64)
    monkeypatch.setattr(measure, "INTER", 32)
    monkeypatch.setattr(measure, "CHOL_LARGE", 128)
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
            if f.name not in ("gemm_half_rows", "gram_half_rows", "chol_half_k"):
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
    base = ["plan", str(cfg), "--recipe", "int4-experts-gptq", "--calibration", "8,64", "--device", "cpu", "--gpus",
            "1", "--json"]  # one rank (the default is 8: seven neighbours and eight start-up probes at once)
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
    # the model's start-up measured in a fresh process (the modeling imports), no longer the shipped figure
    v = got["constants"]["values"]
    assert 0 < v["startup_s"] < 60 and v["startup_s"] != shipped["constants"]["values"]["startup_s"]
    assert not any("startup_s" in n for n in v["notes"])


def test_cli_measure_needs_calibration(tmp_path):
    r = CliRunner().invoke(app, ["plan", str(_config(tmp_path)), "--recipe", "int4-experts-gptq", "--measure"])
    assert r.exit_code == 2 and "--calibration" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: its rates can be measured")
def test_cli_measure_cuda_without_a_gpu(tmp_path):
    r = CliRunner().invoke(app, ["plan", str(_config(tmp_path)), "--recipe", "int4-experts-gptq", "--calibration",
                                 "8,64", "--device", "cuda", "--measure"])
    assert r.exit_code == 1 and isinstance(r.exception, ConfigError) and "needs one here" in str(r.exception)


def test_measured_as_one_of_several_ranks(small):
    """--gpus G on the cpu: the rates are measured on this rank's share of the threads while G - 1 neighbours
    compute alongside; the table says so (threads, ranks, source) and torch's threads are restored after."""
    before = torch.get_num_threads()
    lines = []
    t = measure.measure_throughput("cpu", ranks=2, log=lines.append)
    assert torch.get_num_threads() == before
    assert t.ranks == 2 and t.threads == max(1, before // 2)
    assert "as one of 2 ranks" in t.source and f"{t.threads} threads" in t.source
    assert any("1 neighbour" in m for m in lines)
    assert Throughput.from_json(t.to_json()) == t
    one = measure.measure_throughput("cpu", threads=1)
    assert one.ranks == 1 and one.threads == 1 and "as one of" not in one.source
    with pytest.raises(ConfigError):
        measure.measure_throughput("cpu", ranks=0)


def test_neighbours_compute_alongside_and_stop():
    """The neighbours run (and have started their work) inside the block and are gone after it, also when the
    block raises; a neighbour whose parent is killed stops by itself."""
    import os
    import signal
    import subprocess
    import sys
    import time

    with measure.neighbours(2, 1) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)
    with pytest.raises(KeyError):
        with measure.neighbours(1, 1) as procs:
            raise KeyError("boom")
    assert procs[0].returncode is not None
    # a neighbour that dies before its work starts: a named error at once, not a wait for the timeout
    from quantkit.errors import MeasurementError

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measure, "_NEIGHBOUR", "import sys; sys.exit(3)")
        t0 = time.monotonic()
        with pytest.raises(MeasurementError, match="did not start.*exit 3"):
            with measure.neighbours(1, 1, timeout=60):
                pass
        assert time.monotonic() - t0 < 30
    # the parent SIGKILLed: no one closes the neighbour's stdin, it sees its parent gone
    code = ("import sys, time\nfrom quantkit.plan import measure\n"
            "with measure.neighbours(1, 1) as ps:\n    print(ps[0].pid, flush=True)\n    time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{pid}/stat") as fh:  # reaped by init once it exits: a zombie counts as gone
            if fh.read().split(") ")[-1].startswith("Z"):
                break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the neighbour outlived its killed parent by 30 s")


def test_cli_measure_for_several_cpu_ranks(small, tmp_path, monkeypatch):
    calls = []

    def startup(config, ranks=1, threads=1, **kw):  # the probe itself runs in test_cli_measure
        calls.append((config["model_type"], ranks, threads))
        return 1.25

    monkeypatch.setattr(measure, "measure_startup", startup)
    r = CliRunner().invoke(app, ["plan", str(_config(tmp_path)), "--recipe", "int4-experts-gptq", "--calibration",
                                 "8,64", "--device", "cpu", "--gpus", "2", "--measure", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout[r.stdout.index("{"):])["calibration"]
    assert got["world_size"] == 2 and got["constants"]["values"]["ranks"] == 2
    assert calls == [("qwen3_moe", 2, max(1, torch.get_num_threads() // 2))]  # two fresh processes at once
    assert got["constants"]["values"]["startup_s"] == 1.25
    assert got["constants"]["threads_per_rank"] == got["constants"]["values"]["threads"]
    assert not any("measured as one of" in w for w in got["warnings"])


def test_startup_probe_failure_is_a_named_error():
    """A config the probe cannot build fails with the probe's own last line, not a traceback or a hang."""
    from quantkit.errors import MeasurementError

    with pytest.raises(MeasurementError, match="start-up probe failed.*not_a_model"):
        measure.measure_startup({"model_type": "not_a_model"}, rounds=1)


def test_the_cholesky_rate_grows_with_the_matrix():
    """chol_half_k: a k x k Cholesky at chol_flops * k / (k + half); 0 (a table measured before it was): one
    rate whatever k, as before."""
    from dataclasses import replace

    from quantkit.plan.pass_work import _gptq_solves

    base = replace(THROUGHPUT["cpu"], chol_half_k=0.0)
    one, _ = _gptq_solves(base, [(1, 8, 512, 1)], 128)
    assert one == pytest.approx((2 / 3) * 512 ** 3 / base.chol_flops)
    t = replace(base, chol_half_k=1000.0)
    small, _ = _gptq_solves(t, [(1, 8, 512, 1)], 128)
    large, _ = _gptq_solves(t, [(1, 8, 7168, 1)], 128)
    assert small == pytest.approx((2 / 3) * 512 ** 3 / (base.chol_flops * 512 / 1512))
    assert large / 7168 ** 3 < small / 512 ** 3 / 2  # per flop, the large matrix is cheaper (2.6x here)
    assert Throughput.from_json({k: v for k, v in base.to_json().items() if k != "chol_half_k"}) == base

