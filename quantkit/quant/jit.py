"""`njit`: numba's compiler for quantkit's native kernels (quant/_*_native.py, export/_blocks_native.py), each
compiled once and cached on disk in the user's cache, never beside the package."""

from __future__ import annotations

import os
from pathlib import Path

import numba


def cache_dir() -> str:
    """Where the compiled kernels are cached: the user's NUMBA_CACHE_DIR when set, else a per-user cache
    directory. Never beside this file: numba's files there are not the package's, so `pip uninstall` leaves
    them and an empty `quantkit` directory in site-packages, which then shadows a later editable install."""
    if numba.config.CACHE_DIR:
        return numba.config.CACHE_DIR
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "quantkit" / "numba")


def njit(**options):
    """numba.njit(cache=True, **options), cached in `cache_dir()`: numba picks a function's cache location
    when it is decorated, so CACHE_DIR is set for that moment only (other numba code keeps its own)."""
    def decorate(fn):
        saved = numba.config.CACHE_DIR
        numba.config.CACHE_DIR = cache_dir()
        try:
            return numba.njit(cache=True, **options)(fn)
        finally:
            numba.config.CACHE_DIR = saved
    return decorate
