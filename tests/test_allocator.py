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


@pytest.mark.parametrize("text,expected", [("always [madvise] never\n", True), ("[always] madvise never\n", True),
                                           ("always madvise [never]\n", False), (None, False)])
def test_huge_pages_on_request(tmp_path, text, expected):
    path = tmp_path / "enabled"
    if text is not None:
        path.write_text(text)
    assert allocator.huge_pages_on_request(str(path)) is expected


HUGE = textwrap.dedent("""
    import os
    from quantkit import allocator
    allocator.tune()
    import torch
    x = torch.ones(32 << 18)  # 32 MiB, touched
    with open("/proc/self/smaps_rollup") as f:
        huge = sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    print(os.environ.get(allocator.THP_ENV, "-"), huge)
""")


@pytest.mark.skipif(platform.system() != "Linux", reason="transparent huge pages are Linux's")
@pytest.mark.parametrize("env,value", [({}, "1"), ({"QUANTKIT_MALLOC": "system"}, "-"),
                                       ({"THP_MEM_ALLOC_ENABLE": "0"}, "0")])
def test_torch_asked_for_huge_pages(tmp_path, env, value):
    """The command's tune() asks torch for huge pages before torch is imported, where the kernel has them
    on request; the user's own setting, or QUANTKIT_MALLOC=system, is left alone."""
    import os

    script = tmp_path / "huge.py"
    script.write_text(HUGE)
    base = {k: v for k, v in os.environ.items() if k not in ("QUANTKIT_MALLOC", allocator.THP_ENV)}
    r = run_bounded([sys.executable, str(script)], timeout=300, env={**base, **env})
    assert r.returncode == 0, r.stderr[-2000:]
    got, huge = r.stdout.split()
    on_request = allocator.huge_pages_on_request()
    assert got == (value if on_request or env else "-")
    madvise_only = on_request and "[madvise]" in open(allocator.THP_MODE).read()
    if madvise_only:  # only what is advised gets huge pages: the setting is what makes the difference
        assert (int(huge) > 0) == (got == "1"), (got, huge)


def test_reuse_heap_raises_the_mmap_threshold_and_restores_it(monkeypatch):
    from quantkit.calib import weights

    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(weights, "_libc", lambda: Libc())
    with weights.reuse_heap():
        assert calls == [(weights.M_MMAP_THRESHOLD, weights.SEARCH_MMAP_THRESHOLD)]
    assert calls[-1] == (weights.M_MMAP_THRESHOLD, weights.HEAP_MMAP_THRESHOLD)
    calls.clear()
    try:
        with weights.reuse_heap():
            raise KeyError("a failed search")
    except KeyError:
        pass
    assert calls[-1] == (weights.M_MMAP_THRESHOLD, weights.HEAP_MMAP_THRESHOLD)  # restored on errors too
    monkeypatch.setattr(weights, "_libc", lambda: None)  # not glibc: nothing to do
    with weights.reuse_heap():
        pass

