"""The fixed set-up of a calibrated convert, timed: the calibration data, an executor over the model, the
embedding. calib_cost's `setup_s` is its warm time; run in a fresh process (as calib_cost's measure_startup
does) it prints cold minus warm: what a fresh `quantkit convert` pays once more (transformers' modeling
imports of the first executor, first-use initialization), `startup_s`. A helper of calib_cost, not a bench.

    python -m bench.setup_probe SRC CALIB.jsonl N T
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def setup_times(src: Path, calib: Path, n: int, t: int, clock=time.perf_counter, rounds: int = 2) -> list[float]:
    """Seconds of each of `rounds` set-ups in this process: the first cold (unless one ran before), then warm."""
    from quantkit.calib.executor import LayerExecutor
    from quantkit.convert.calibrated import calibration_data
    from quantkit.match.recipe import load_recipe
    from quantkit.read.checkpoint import Checkpoint

    times = []
    for _ in range(rounds):
        t0 = clock()
        ck = Checkpoint.open(src)
        data = calibration_data(ck, load_recipe("int4-experts-gptq"), str(calib), n, t)
        ex = LayerExecutor(src, device="cpu")
        ex.embed(data.samples).close()
        times.append(clock() - t0)
    return times


if __name__ == "__main__":
    import quantkit.cli  # noqa: F401  (what `quantkit convert` has imported when convert() starts)

    cold, warm = setup_times(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    print(cold - warm)
