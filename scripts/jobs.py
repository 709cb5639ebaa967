"""Stopping a launched job for good (repository tooling, not part of the package).

torchrun starts its workers in sessions of their own, so killing torchrun's
process group leaves them running. Tests, benchmarks and the preemption
example stop jobs with ``kill_job``.
"""

import os
import signal

import psutil  # pip install 'accel_mixin[test]'

__all__ = ["kill_job", "kill_tree"]


def kill_job(proc, timeout=10):
    """SIGKILL a launcher (a ``subprocess.Popen``) and every process under it.

    Parameters
    ----------
    proc : subprocess.Popen
      The launcher, started with ``start_new_session=True``.

    timeout : float (default=10)
      Seconds to wait for the killed workers to be gone.

    """
    workers = kill_tree(proc.pid)
    proc.wait()
    psutil.wait_procs(workers, timeout=timeout)


def kill_tree(pid):
    """SIGKILL ``pid``, its process group and every process under it, which
    may have left that group; return those under it."""
    try:
        workers = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    for send in (os.kill, os.killpg):
        try:
            send(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for worker in workers:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    return workers
