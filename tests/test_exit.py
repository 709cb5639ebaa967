"""Jobs exit cleanly: a whole job as the README writes one (fit, predict,
save, end_training) ends with status 0 every time, in two real processes.

A process group left to Python's exit could abort a process after all its
work was done ("terminate called without an active exception"), which
launchers report as a failed job; the mixin collects the nets' garbage at
exit while everything is still alive. Twenty launches in a row, because the
abort was intermittent.
"""

import pytest
from harness import run_processes

pytestmark = pytest.mark.multiprocess

LAUNCHES = 20


def test_a_job_exits_with_status_0_every_time(tmp_path):
    failed = []
    for attempt in range(LAUNCHES):
        launch = run_processes("exit_job.py", tmp_path, timeout=120)
        if launch.returncode != 0 or launch.timed_out:
            failed.append(f"launch {attempt}: {launch.describe()}")
    assert not failed, f"{len(failed)} of {LAUNCHES} launches failed:\n" + "\n".join(failed)
