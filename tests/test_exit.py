"""Jobs exit cleanly: a whole job as the README writes one (fit, predict,
save, end_training) ends with status 0 every time, in two real processes.

The abort this guards against ("terminate called without an active
exception", SIGABRT, torchrun's exitcode -6) came from a daemon thread that
was inside a store call when Python began to shut down: returning from the
call, pybind11 takes the GIL back, CPython ends the thread with
``pthread_exit`` because the interpreter is finalizing, and the forced unwind
meets a ``noexcept`` C++ frame, so ``std::terminate`` runs. The mixin stops
and joins its presence threads at exit, before finalization.

The busy launches make the presence thread call the store without pause, so
that every exit meets that moment; the plain launches are the job as users
write it.
"""

import pytest
from harness import run_processes

pytestmark = pytest.mark.multiprocess


def launch_repeatedly(tmp_path, launches, *args):
    failed = []
    for attempt in range(launches):
        launch = run_processes("exit_job.py", tmp_path, *args, timeout=120)
        if launch.returncode != 0 or launch.timed_out:
            failed.append(f"launch {attempt}: {launch.describe()}")
    assert not failed, f"{len(failed)} of {launches} launches failed:\n" + "\n".join(failed)


def test_a_job_exits_with_status_0_every_time(tmp_path):
    launch_repeatedly(tmp_path, 10)


def test_a_job_exits_cleanly_mid_store_call(tmp_path):
    launch_repeatedly(tmp_path, 3, "busy")
