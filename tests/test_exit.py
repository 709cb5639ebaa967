"""Jobs exit cleanly: a whole job as the README writes one (fit, predict,
save, end_training) ends with status 0, in two real processes.

Two aborts at exit were seen ("terminate called without an active
exception", SIGABRT, torchrun's exitcode -6): a daemon thread of the mixin
inside a store call as Python finalized (the presence thread, gone with the
store polling: the mixin keeps no thread beyond a save's), and DDP wrappers
dying in reference cycles that hold the process group during finalization's
collection, which the mixin collects at exit while the interpreter still
runs. Every launch of the suite that a test reads through
``Launch.check()`` also fails on any exit status but 0, so the suite ends
many jobs on each run.
"""

import pytest
from harness import run_processes

pytestmark = pytest.mark.multiprocess


def test_a_job_exits_with_status_0(tmp_path):
    launch = run_processes("exit_job.py", tmp_path, timeout=120)
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
