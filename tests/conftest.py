import faulthandler
import os

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

# Triton kernels run in the interpreter without CUDA: TRITON_INTERPRET must be set before anything imports triton
# (tests/runtime/conftest.py does it too, but a test module collected before tests/runtime may import it first).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from quantkit.testing import ARCHS, make_tiny_model  # noqa: E402

import procs  # noqa: E402  (tests/procs.py)


@pytest.fixture(autouse=True)
def _seeded_rng():
    """Every test starts from the same global RNG state, so that what it draws without a generator of its own
    does not depend on which tests ran before it (a subset, `-k`, or a new test elsewhere)."""
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    """A test that leaves a process running fails, naming it (tests/procs.py); the process is killed."""
    before = procs.live_descendants()
    yield
    left = procs.leftovers(before)
    assert not left, f"the test left {len(left)} process(es) running (killed now): " + "; ".join(
        f"{pid}: {cmd}" for pid, cmd in left.items())


# A test (setup and teardown included) that runs past this many seconds is a hang: every thread's stack is
# written to the real stderr and the run ends there, instead of waiting for CI's own limit with no clue.
TEST_TIMEOUT_S = float(os.environ.get("QUANTKIT_TEST_TIMEOUT", "900"))
_STDERR_COPY: int | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    global _STDERR_COPY
    _STDERR_COPY = os.dup(2)  # before any capture: where the watchdog writes
    procs.become_subreaper()  # orphaned grandchildren come back to this process, where the guard sees them


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if TEST_TIMEOUT_S > 0 and _STDERR_COPY is not None:
        faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=_STDERR_COPY)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# The slow tests: end to end (they build tiny models, convert, calibrate, drive the CLI or the runner). They stay
# in the default run; `pytest -m "not slow"` leaves them out (README.md, "Tests"). Marked here from one list, by
# file, plus any test that asks for `tiny_models` (it builds checkpoints) and a few named tests, so that the rule
# lives in one place: a new file that converts or calibrates belongs in SLOW_FILES. Chosen from per-file
# `--durations` runs and from what each file does (docs/code.md, after "Tests mirror the package").
SLOW_FILES = {
    "test_arch.py", "test_card.py", "test_cli.py", "test_report.py", "test_report_hostile.py",
    "test_report_timeline.py", "test_timeline.py",
    "calib/test_awq_moe.py", "calib/test_calibrate.py", "calib/test_device.py", "calib/test_executor.py",
    "calib/test_glm5_kimi25.py", "calib/test_passes.py", "calib/test_split.py",
    "convert/test_calibrated.py", "convert/test_convert.py", "convert/test_fp4.py", "convert/test_fp8.py",
    "convert/test_int4_fp4.py", "convert/test_int8.py", "convert/test_w4a4.py", "convert/test_wrapper.py",
    "dist/test_calib_ranks.py", "dist/test_convert_ranks.py",
    "plan/test_plan_hostile.py", "convert/test_pair_hostile.py",
    "engine/test_llamacpp_run.py", "engine/test_vllm_run.py", "engine/test_w4afp8.py", "export/test_export.py",
    "pack/test_kv_scales.py",
    "plan/test_plan.py", "plan/test_plan_convert.py",
    "read/test_hostile.py", "read/test_hostile_sources.py",
    "runtime/test_kv_integrity.py", "runtime/test_runner.py", "runtime/test_runner_fp4.py",
    "verify/test_fp8_judge.py", "verify/test_verify.py",
    "write/test_resume.py",
}
SLOW_TESTS = {
    "test_allocator.py::test_fewer_page_faults_in_gptq_solves",
    "test_allocator.py::test_torch_asked_for_huge_pages",
    "quant/test_rtn_native.py::test_convert_output_identical_without_kernel",
    "quant/test_fp4_native.py::test_convert_output_identical_without_kernel",
    "quant/test_gptq.py::test_inverse_factor_against_the_textbook_one",
    "runtime/test_no_triton.py::test_imports_and_runs_without_triton",
    "read/test_ct_source_fuzz.py::test_source_checks_accept_only_sound_modules",
    "read/test_safetensors_fuzz.py::test_header_hypothesis",
    "calib/test_moe.py::test_other_activations",
    # the rotation's end-to-end tests (they convert, and run transformers); its math tests stay fast
    "test_rotate.py::test_rotated_model_matches_the_source", "test_rotate.py::test_an_unrotated_reader_would_fail",
    "test_rotate.py::test_same_bytes_across_runs_and_workers",
    "test_rotate.py::test_block_fp8_source_is_decoded_then_turned",
    "test_rotate.py::test_refusals_end_in_one_line", "test_rotate.py::test_mtp_layer_is_refused",
    "test_rotate.py::test_verify_measures_a_rotated_output_against_its_source",
    "test_rotate.py::test_calibrated_methods_run_on_the_rotated_model",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path, _, name = item.nodeid.partition("::")
        path = path.removeprefix("tests/")
        if (path in SLOW_FILES or f"{path}::{name.split('[')[0]}" in SLOW_TESTS
                or "tiny_models" in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random MoE checkpoints, one per architecture, saved sharded (built once per session)."""
    cache = {}

    def get(arch: str, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"src_{arch}")
            cache[key] = make_tiny_model(arch, d, **kw)
        return cache[key]

    return get


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param
