"""How the `quantkit` command asks glibc's malloc to keep freed memory for reuse.

A calibrated pass allocates and frees the same large temporaries thousands of times per layer (float64
Hessian copies in the solves, routed-token activations, Gram products). With glibc's defaults every free
of such a block that sits at the top of the heap (or above the dynamic mmap threshold) goes back to the
kernel, and the next allocation faults every page in again: on the bench MoE of bench/calib_dist.py, 5.4
million page faults and ~12 s of system time in a 45 s conversion. Keeping freed memory in the heap (a high
trim threshold, a top pad, a fixed mmap threshold) cuts that to ~1 million faults and ~3 s.

What it costs: memory freed at the top of the heap stays resident until reused, so the process's RSS
follows its high-water mark instead of falling after each peak; the peak itself is the same up to
fragmentation (+~50 MiB measured on that bench, 0.72 vs 0.67 GiB).

Only the command line applies it (a library caller's process is theirs to tune), only on glibc, and never
when the user set any `MALLOC_*_` variable or `QUANTKIT_MALLOC=system`.

Transparent huge pages: the executor still gives every layer's freed memory back to the kernel
(calib/weights.release_memory, which keeps the peak RSS bounded), so each layer faults its working set in
again, 4 KiB at a time: ~1.4 million faults on the bench MoE. The command also sets torch's
`THP_MEM_ALLOC_ENABLE=1` (CPU tensors of 2 MiB or more advised onto huge pages) where the kernel offers
transparent huge pages on request (`madvise` or `always`), before torch is imported: ~0.3 million faults
there, and on bench/gptq_rss.py 33.6 s instead of 49.0 s with a lower peak (1036 vs 1055 MB; one run each).
A value the user set is left as it is, and `QUANTKIT_MALLOC=system` leaves it unset.
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

SETTINGS = (
    (M_MMAP_THRESHOLD, 32 << 20),  # glibc's largest allowed value; also turns its dynamic threshold off
    (M_TRIM_THRESHOLD, 1 << 30),  # give memory back only when more than 1 GiB is free at the top
    (M_TOP_PAD, 256 << 20),  # grow the heap in large steps (address space; pages count once touched)
)
ENV_VARS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_",
            "MALLOC_ARENA_MAX")


THP_ENV = "THP_MEM_ALLOC_ENABLE"  # read by torch at its first CPU allocation
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_on_request(path: str = THP_MODE) -> bool:
    """Whether the kernel gives transparent huge pages to memory advised for them ("[always]" or
    "[madvise]" selected in `path`)."""
    try:
        with open(path, encoding="ascii") as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def tune(environ=os.environ) -> bool:
    """Apply SETTINGS to this process's glibc malloc, and ask torch for huge pages (THP_ENV) where the
    kernel has them; call it before torch is imported. Returns whether the malloc settings were applied."""
    if environ.get("QUANTKIT_MALLOC", "").lower() == "system":
        return False
    if THP_ENV not in environ and platform.system() == "Linux" and huge_pages_on_request():
        environ[THP_ENV] = "1"
    if any(v in environ for v in ENV_VARS):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
