"""Jobs exit cleanly: a whole job as the README writes one (fit, predict,
save, end_training) ends with status 0, in two real processes.

The abort this guards against ("terminate called without an active
exception", SIGABRT, torchrun's exitcode -6) came from a daemon thread that
was inside a store call when Python began to shut down: returning from the
call, pybind11 takes the GIL back, CPython ends the thread with
``pthread_exit`` because the interpreter is finalizing, and the forced unwind
meets a ``noexcept`` C++ frame, so ``std::terminate`` runs. The mixin stops
and joins its presence threads at exit, before finalization.

The busy launch makes the presence thread call the store without pause, so
that its exit meets that moment: without the mixin's stop at exit, 6 of 6
such launches aborted under load. The plain launch is the job as users write
it. Each ran several times in a row when the abort was a matter of chance;
the busy launch no longer leaves it to chance, and every launch of the suite
that a test reads through ``Launch.check()`` (most of them, each a job with
its presence threads) fails on any exit status but 0, so the suite ends
many jobs on each run.
"""

import pytest
from harness import run_processes

pytestmark = pytest.mark.multiprocess


def exits_with_status_0(tmp_path, *args):
    launch = run_processes("exit_job.py", tmp_path, *args, timeout=120)
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()


def test_a_job_exits_with_status_0(tmp_path):
    exits_with_status_0(tmp_path)


def test_a_job_exits_cleanly_mid_store_call(tmp_path):
    exits_with_status_0(tmp_path, "busy")
