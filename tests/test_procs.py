"""The guard that fails a test leaving a process behind (tests/procs.py) can fail: an orphaned grandchild is seen
(the session is its subreaper), named and killed; a process that ends within the grace period is not."""

import subprocess
import time

import procs


def test_an_orphaned_grandchild_is_found_and_killed():
    before = procs.live_descendants()
    subprocess.run(["sh", "-c", "sleep 300 &"], check=True, stdout=subprocess.DEVNULL)  # sh exits at once
    left = procs.leftovers(before, grace_s=0.3)
    assert len(left) == 1 and "sleep 300" in next(iter(left.values())), left
    time.sleep(0.2)
    assert not (procs.live_descendants() - before)  # killed


def test_a_process_that_ends_in_time_is_not_reported():
    before = procs.live_descendants()
    p = subprocess.Popen(["sleep", "0.3"])
    assert procs.leftovers(before, grace_s=3) == {}
    p.wait()
