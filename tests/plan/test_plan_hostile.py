"""`quantkit plan` against hostile input: every number it takes is finite and inside its documented range
(cli.py's plan options, plan/bounds.py; docs/memory.md), `--measure` is bounded by the host, `--pair` refuses
the prefill recipes `convert --pair` refuses, and the files it reads fail in one line. A bad input ends in exit 2
(a usage error naming the option) or exit 1 (`error:` + `hint:`), never a traceback or an internal error, with
nothing on stdout, within seconds."""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit import cli as qcli
from quantkit.errors import ConfigError, RecipeError
from quantkit.plan import CostOptions, PlanOptions, bounds, check_serving, measure, plan
from quantkit.plan.calibration import calibration_cost, parse_calibration
from quantkit.plan.pass_work import pass_batches
from quantkit.plan.pair import plan_pair
from quantkit.testing import tiny_config
from tests.harness import cli  # noqa: F401  (fixture)

SLOW_S = 10.0  # a refusal comes within this many seconds of the command's start


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile_plan")
    p = d / "config.json"
    p.write_text(json.dumps(tiny_config("qwen3_moe", layers=2, experts=4).to_dict()))
    return p


def _files(root: Path) -> dict[str, Path]:
    """Files plan may be pointed at that are not a config it can read."""
    out = {}
    fifo = root / "fifo.json"
    os.mkfifo(fifo)
    out["fifo"] = fifo
    d = root / "fifo_dir"
    d.mkdir()
    os.mkfifo(d / "config.json")
    out["dir_with_fifo_config"] = d
    z = root / "zero_dir"
    z.mkdir()
    (z / "config.json").symlink_to("/dev/zero")
    out["config_is_dev_zero"] = z
    huge = root / "huge" / "config.json"
    huge.parent.mkdir()
    with open(huge, "wb") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB of nothing
    out["huge"] = huge.parent
    big_int = root / "big_int.json"
    big_int.write_text('{"model_type": "qwen3_moe", "hidden_size": ' + "9" * 5000 + "}")
    out["huge_integer"] = big_int
    absurd = root / "absurd.json"
    absurd.write_text(json.dumps({**tiny_config("qwen3_moe").to_dict(), "num_experts": 10**30}))
    out["absurd_experts"] = absurd
    nested = root / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    out["deep_nesting"] = nested
    return out


GPTQ = ["-r", "int4-experts-gptq"]
# (the options after MODEL, the exit code, a word the error must hold)
HOSTILE = [
    *[(["--gpu-memory-gib", v], 2, "--gpu-memory-gib") for v in
      ("nan", "inf", "-inf", "1e400", "1e308", "0", "-1", "16384.5", "-0")],
    *[(["--activation-reserve-gib", v], 2, "--activation-reserve-gib") for v in
      ("nan", "inf", "-inf", "1e309", "-1", "-1e-9", "16385")],
    *[(["--gpus", v], 2, "--gpus") for v in ("0", "-8", "65537", "1" + "0" * 50, "nan", "1e3", "inf")],
    *[(["--tp", v], 2, "--tp") for v in ("0", "-1", "65537", "9" * 60)],
    (["--tp", "3"], 1, "multiple of tp=3"),
    (["--gpus", "65536", "--tp", "65535"], 1, "multiple of tp"),
    *[(["--context-len", v], 2, "--context-len") for v in ("0", "-1", str((1 << 24) + 1), "1" + "0" * 40, "nan")],
    *[([*GPTQ, "--calibration", v], 2, "--calibration") for v in
      ("nan,5", "inf,64", "8,nan", "0,64", "8,0", "-1,64", "65537,64", "8,1048577", "1" + "0" * 30 + ",64",
       "8," + "9" * 5000, "1e3,64", "\u0661\u0662,64", "8,64,2", "8", ",", "8.5,64", "0x10,64")],
    (["-r", "int4-experts-rtn", "--pair", "int4-experts-rtn"], 1, "no FP8 weight group"),
    (["-r", "int4-experts-rtn", "--pair", "int4-experts-w4afp8"], 1, "no FP8 weight group"),
]


def _check_refusal(r, rc: int, word: str, elapsed: float) -> None:
    assert r.rc == rc, (r.rc, r.stdout[-500:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    assert r.stdout == "", r.stdout[:500]  # nothing that looks like a plan
    assert elapsed < SLOW_S, elapsed
    if rc == 1:  # a named error: one line, and a hint
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) in (1, 2) and lines[0].startswith("error: ") and word in lines[0], r.stderr
        assert len(lines) == 1 or lines[1].startswith("hint: "), r.stderr
    else:  # click's usage error: the option named, once
        flat = " ".join(r.stderr.replace("│", " ").replace("'", "").split())
        assert flat.count("Invalid value for") == 1 and f"Invalid value for {word}" in flat, r.stderr


@pytest.mark.parametrize("args,rc,word", HOSTILE, ids=[" ".join(a)[-60:] for a, _, _ in HOSTILE])
def test_hostile_option(cli, cfg, args, rc, word):  # noqa: F811
    t0 = time.monotonic()
    r = cli.run("plan", cfg, *args, "--json", timeout=60)
    _check_refusal(r, rc, word, time.monotonic() - t0)


FILES = ["fifo", "dir_with_fifo_config", "config_is_dev_zero", "huge", "huge_integer", "absurd_experts",
         "deep_nesting"]


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory) -> dict[str, Path]:
    return _files(tmp_path_factory.mktemp("hostile_files"))


@pytest.mark.parametrize("name", FILES)
def test_hostile_file(cli, hostile_files, name):  # noqa: F811
    t0 = time.monotonic()
    r = cli.run("plan", hostile_files[name], "-r", "int4-experts-rtn", "--json", timeout=60)
    _check_refusal(r, 1, "", time.monotonic() - t0)


def test_the_edges_of_the_ranges_are_accepted(cli, cfg):  # noqa: F811
    """The bounds are inclusive where the help says so: the largest setup still plans (the refusals above are
    the range, not a broken option)."""
    r = cli.run("plan", cfg, "--gpus", "65536", "--tp", "65536", "--gpu-memory-gib", "16384", "--context-len",
                str(1 << 24), "--activation-reserve-gib", "0", "--json", timeout=120)
    assert r.rc == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["per_gpu"]["gpus"] == 65536 and doc["context_len"] == 1 << 24
    assert all(v is None or (isinstance(v, int) and v >= 0) for v in doc["max_concurrency"].values())
    r = cli.run("plan", cfg, "--gpu-memory-gib", "0.5", "--gpus", "1", "--json", timeout=120)
    assert r.rc == 0 and json.loads(r.stdout)["per_gpu"]["gpu_memory_bytes"] == 1 << 29, r.stderr


# ---- the library holds the same ranges -----------------------------------------------------------------
def test_cli_and_library_bounds_agree():
    assert qcli.PLAN_MAX_GPU_MEMORY_GIB == bounds.MAX_GPU_MEMORY_GIB
    assert qcli.PLAN_MAX_GPUS == bounds.MAX_GPUS
    assert qcli.PLAN_MAX_CONTEXT_LEN == bounds.MAX_CONTEXT_LEN
    assert qcli.PLAN_MAX_CALIBRATION == (bounds.MAX_CALIBRATION_SAMPLES, bounds.MAX_CALIBRATION_TOKENS)


GOOD = dict(gpu_memory_gib=80, gpus=8, tp=None, context_len=4096, activation_reserve_gib=None)


@pytest.mark.parametrize("field,value", [
    ("gpu_memory_gib", math.nan), ("gpu_memory_gib", math.inf), ("gpu_memory_gib", 0), ("gpu_memory_gib", 1e300),
    ("gpu_memory_gib", "80"), ("gpus", 0), ("gpus", 10**30), ("gpus", 8.0), ("gpus", True), ("tp", 0),
    ("context_len", 0), ("context_len", 1 << 40), ("activation_reserve_gib", -1.0),
    ("activation_reserve_gib", math.nan), ("activation_reserve_gib", -math.inf),
])
def test_library_refuses_each_number(cfg, field, value):
    with pytest.raises(ConfigError, match=field) as ei:
        check_serving(**{**GOOD, field: value})
    assert "\n" not in ei.value.message and "config.json" not in ei.value.hint
    with pytest.raises(ConfigError, match=field):
        plan(cfg, opts=PlanOptions(**{**GOOD, field: value}))


@pytest.mark.parametrize("kw", [dict(num_samples=0), dict(num_samples=1 << 17), dict(seq_len=math.nan),
                                dict(seq_len=(1 << 20) + 1), dict(world_size=0), dict(world_size=1 << 20),
                                dict(gpu_memory_gib=math.inf), dict(threads=math.inf)])
def test_calibration_cost_refuses_each_number(cfg, kw):
    args = {"num_samples": 8, "seq_len": 64, **kw}
    n, t = args.pop("num_samples"), args.pop("seq_len")
    with pytest.raises(ConfigError):
        calibration_cost(cfg, "int4-experts-gptq", n, t, CostOptions(device="cuda", **args))


def test_pass_batches_least_loaded_rank_first():
    """The batches go to the ranks as before (heaviest batch first, to the least loaded, lowest rank), in
    O(batches log ranks): 65,536 ranks of one batch each stay fast."""

    class Ex:
        batch_tokens = 96

    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.choice((16, 32, 48, 64)) for _ in range(rng.randint(1, 40))]
        g = rng.randint(1, 9)
        got = pass_batches(Ex(), lengths, g, capped=False)
        tokens = got.all_batches
        load, mine = [0] * g, [[] for _ in range(g)]
        for b in sorted(range(len(tokens)), key=lambda b: (-tokens[b], b)):
            r = min(range(g), key=lambda r: (load[r], r))
            load[r] += tokens[b]
            mine[r].append(tokens[b])
        busiest = max(range(g), key=lambda r: (load[r], -r))
        assert (got.rank_batches, got.rank_tokens) == (mine[busiest], load[busiest])
    t0 = time.monotonic()
    pass_batches(Ex(), [64] * (1 << 16), 1 << 16, capped=False)
    assert time.monotonic() - t0 < 5


# ---- --pair: the rule convert --pair holds prefill recipes to ---------------------------------------------
def test_pair_refuses_what_convert_refuses(cfg):
    import quantkit.convert.pair as convert_pair
    import quantkit.match.recipe as recipe

    assert convert_pair.check_prefill_recipe is recipe.check_prefill_recipe  # one rule, both commands
    with pytest.raises(RecipeError, match="no FP8 weight group") as ei:
        plan_pair(cfg, "int4-experts-rtn", "int4-experts-rtn")
    with pytest.raises(RecipeError) as ec:
        recipe.check_prefill_recipe(recipe.load_recipe("int4-experts-rtn"))
    assert (ei.value.message, ei.value.hint) == (ec.value.message, ec.value.hint)
    assert plan_pair(cfg, "int4-experts-rtn", "fp8-prefill")["prefill"]["expert_math"] == "fp8"


# ---- --measure: bounded by the host, refused before any process starts -----------------------------------
@pytest.fixture
def no_processes(monkeypatch):
    """Nothing of a measurement may run: a process started or a rate measured fails the test."""
    started = []

    def popen(*a, **kw):
        started.append(a)
        raise AssertionError("a process was started")

    monkeypatch.setattr(measure.subprocess, "Popen", popen)
    monkeypatch.setattr(measure, "measure_rates", lambda *a, **kw: pytest.fail("rates were measured"))
    return started


@pytest.mark.parametrize("ranks,capacity,word", [
    (3, (2, 64 << 30), "this host runs 2"), (4096, (16, None), "this host runs 16"),
    (2, (2, 1 << 30), "GB available"), (8, (8, 4 << 30), "GB available"),
])
def test_measure_refuses_more_ranks_than_the_host_runs(no_processes, monkeypatch, ranks, capacity, word):
    monkeypatch.setattr(measure, "host_capacity", lambda: capacity)
    with pytest.raises(ConfigError, match=word):
        measure.measure_throughput("cpu", ranks=ranks)
    with pytest.raises(ConfigError, match=word):
        measure.check_host(ranks)
    assert no_processes == []


def test_measure_within_the_host_is_allowed():
    measure.check_host(2, (2, 64 << 30))
    measure.check_host(1, (1, None))
    cpus, available = measure.host_capacity()
    assert cpus >= 1 and (available is None or available > 0)


def test_cli_measure_refused_in_one_line(no_processes, monkeypatch, capsys, cfg):
    monkeypatch.setattr(measure, "host_capacity", lambda: (2, 64 << 30))
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as ei:
        qcli.main(["plan", str(cfg), *GPTQ, "--calibration", "8,64", "--device", "cpu", "--gpus", "3", "--measure"])
    out, err = capsys.readouterr()
    assert ei.value.code == 1 and out == "" and time.monotonic() - t0 < SLOW_S
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[0].startswith("error: --measure as one of 3 CPU ranks") and "runs 2" in lines[0], err
    assert len(lines) == 2 and lines[1].startswith("hint: measure with --gpus 2 or fewer"), err
    assert no_processes == []


# ---- the parsers, under hypothesis -----------------------------------------------------------------------
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**60), 10**60),
                    st.sampled_from([0, -0.0, 1, 16384, 16384.000001, 65536, 65537, 1 << 24, True, False]),
                    st.none())
RANGES = st.sampled_from([(0, 16384, False, True), (0, 16384, False, False), (1, 65536, True, False),
                          (1, 1 << 24, True, False)])


@settings(max_examples=400, derandomize=True, database=None, deadline=None)
@given(NUMBERS, RANGES)
def test_number_option_parser(value, rng):
    """cli._in_range: a number comes back only finite, of its kind and in its range; anything else is a
    usage error naming the option, never another exception. The library's check_number agrees."""
    lo, hi, integer, lo_open = rng
    try:
        got = qcli._in_range(value, "--opt", lo, hi, integer=integer, lo_open=lo_open)
    except typer.BadParameter as e:
        assert e.param_hint == "--opt" and "\n" not in e.message and len(e.message) < 120
        assert value is not None
        with pytest.raises(ConfigError):
            bounds.check_number("opt", value, lo, hi, integer=integer, lo_open=lo_open)
        return
    if value is None:
        assert got is None
        return
    assert got is value and not isinstance(got, bool) and (isinstance(got, int) or not integer)
    assert math.isfinite(got) and (lo < got if lo_open else lo <= got) and got <= hi
    assert bounds.check_number("opt", value, lo, hi, integer=integer, lo_open=lo_open) is value


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.one_of(st.text(max_size=30),
                 st.tuples(st.integers(-5, 1 << 21), st.integers(-5, 1 << 21), st.sampled_from([",", "x", " , "]))
                 .map(lambda t: f"{t[0]}{t[2]}{t[1]}")))
def test_calibration_parser(text):
    try:
        n, t = parse_calibration(text)
    except ConfigError as e:
        assert "\n" not in e.message
        return
    assert 1 <= n <= bounds.MAX_CALIBRATION_SAMPLES and 1 <= t <= bounds.MAX_CALIBRATION_TOKENS
    assert text.isascii()
