"""What `plan` is asked to size, bounded: each number it takes (the serving setup, the calibration asked
about) is finite and inside a range that holds every real setup with room to spare, so that the arithmetic
after it never meets NaN, infinity or a float overflow, and the cost model's walks over samples and ranks
stay short. `quantkit plan`'s options state the same bounds (cli.py; docs/memory.md, docs/cost.md)."""

from __future__ import annotations

import math
from numbers import Integral, Real

from .. import options
from ..errors import ConfigError

MAX_GPU_MEMORY_GIB = 16384  # memory per GPU, GiB (16 TiB; the largest accelerator today has under 300 GiB)
MAX_GPUS = 65536  # GPUs (or --device cpu ranks) of one plan, and the tensor-parallel size
MAX_CONTEXT_LEN = 1 << 24  # tokens per request (16,777,216; real models: at most ~10M)
# calibration N,T: the cost model walks every sample's batches, so N stays well under convert's own bound
# (options.MAX_NUM_SAMPLES; real runs use hundreds to thousands); T is convert's (options.MAX_SEQ_LEN)
MAX_CALIBRATION_SAMPLES = 1 << 16
MAX_CALIBRATION_TOKENS = options.MAX_SEQ_LEN

HINT = "plan sizes real serving setups; docs/memory.md lists the range of each of its numbers"


def shown(value: object) -> str:
    """A number as an error message shows it: a huge integer by its size, anything else at most 40 characters."""
    if isinstance(value, Integral) and not isinstance(value, bool) and abs(int(value)) >= 10**40:
        return f"<a {int(value).bit_length()}-bit integer>"
    return repr(value)[:40]


def check_number(name: str, value: object, lo: float, hi: float, *, integer: bool, lo_open: bool = False,
                 hint: str = HINT):
    """`value` if it is a number (an integer where `integer`; never a bool), finite, and in [lo, hi] ((lo, hi]
    where `lo_open`); a ConfigError naming `name` otherwise."""
    ok = isinstance(value, Integral if integer else Real) and not isinstance(value, bool)
    if ok and not isinstance(value, Integral):
        ok = math.isfinite(value)  # NaN compares false both ways: refused here, not by the range
    if ok:
        ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        what = "an integer" if integer else "a finite number"
        raise ConfigError(f"{name} must be {what} in {'(' if lo_open else '['}{_bound(lo)}, {_bound(hi)}], got "
                          f"{shown(value)}", hint=hint)
    return value


def _bound(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"
