import faulthandler
import os

os.environ.setdefault("TQDM_DISABLE", "1")

import pytest  # noqa: E402

from quantkit.testing import ARCHS, make_tiny_model  # noqa: E402


# A test (setup and teardown included) that runs past this many seconds is a hang: every thread's stack is
# written to the real stderr and the run ends there, instead of waiting for CI's own limit with no clue.
TEST_TIMEOUT_S = float(os.environ.get("QUANTKIT_TEST_TIMEOUT", "900"))
_STDERR_COPY: int | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    global _STDERR_COPY
    _STDERR_COPY = os.dup(2)  # before any capture: where the watchdog writes


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if TEST_TIMEOUT_S > 0 and _STDERR_COPY is not None:
        faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=_STDERR_COPY)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


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
