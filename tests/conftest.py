import os

os.environ.setdefault("TQDM_DISABLE", "1")

import pytest  # noqa: E402

from quantkit.testing import ARCHS, make_tiny_model  # noqa: E402


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
