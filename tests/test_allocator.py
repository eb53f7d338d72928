"""quantkit/allocator.py: the command line's glibc malloc settings. Applied only where asked for, and what
they are for: a calibration's repeated large temporaries stop faulting fresh pages in."""

import platform
import sys
import textwrap

import pytest

from quantkit import allocator

from harness import run_bounded

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.parametrize("env", [{"QUANTKIT_MALLOC": "system"}, {"QUANTKIT_MALLOC": "SYSTEM"},
                                 {"MALLOC_TOP_PAD_": "0"}, {"MALLOC_ARENA_MAX": "2"}])
def test_left_alone_when_the_user_chose(env):
    assert allocator.tune(environ=env) is False


FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from quantkit import allocator
    from quantkit.calib.weights import bound_heap
    from quantkit.quant.gptq import gptq
    torch.set_num_threads(1)
    applied = allocator.tune() if sys.argv[1] == "1" else False
    bound_heap()  # as the calibration executor sets it
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1024, 512, generator=g)
    h, w = x.mT @ x / 1024, torch.randn(2, 512, 512, generator=g)
    gptq(w, h)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        gptq(w, h)
    print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 3)
""")


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_fewer_page_faults_in_gptq_solves(tmp_path):
    script = tmp_path / "faults.py"
    script.write_text(FAULTS)
    got = {}
    for arg in ("0", "1"):
        r = run_bounded([sys.executable, str(script), arg], timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        applied, faults = r.stdout.split()
        got[arg] = (applied == "True", float(faults))
    assert got["1"][0] and not got["0"][0]
    # ~6700 page faults per solve of two [512, 512] matrices with glibc's defaults, ~170 tuned
    assert got["1"][1] < got["0"][1] / 4, got
