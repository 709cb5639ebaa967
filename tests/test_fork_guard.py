"""Forks wait for torch's native threads to rest (``distributed/fork_guard.py``):
on Pythons whose forked children can wait forever for a lock such a thread
held (python/cpython#112275), a DataLoader worker forked beside a gloo
thread never started (1 launch in 3 of ``launched/resume_loaders.py`` under
load)."""

import _thread
import hashlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from harness import run_processes

from accel_mixin.distributed import fork_guard

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task"
)


@pytest.mark.parametrize(
    ("version", "needed"),
    [
        ((3, 9, 19), True),
        ((3, 9, 20), False),
        ((3, 10, 14), True),
        ((3, 10, 15), False),
        ((3, 11, 7), True),
        ((3, 11, 10), False),
        ((3, 12, 0), False),
        ((3, 13, 1), False),
    ],
)
def test_only_pythons_without_the_fix_are_guarded(version, needed):
    assert fork_guard.needed(version) is needed


class Spinner:
    """A thread that threading does not know, in one long call without the
    GIL after another until told to rest."""

    def __init__(self):
        self.spin, self.stop = threading.Event(), threading.Event()
        self.calling, self.resting = threading.Event(), threading.Event()
        self.spin.set()
        _thread.start_new_thread(self.run, ())

    def run(self):
        self.tid = threading.get_native_id()
        while not self.stop.is_set():
            if self.spin.is_set():
                self.calling.set()
                hashlib.pbkdf2_hmac("sha256", b"k", b"s", 2_000_000)  # releases the GIL
            else:
                self.resting.set()
                self.stop.wait(0.05)

    def running(self):
        """Its native id, once it is inside a call."""
        self.calling.wait(10)
        time.sleep(0.05)  # the GIL, for it to enter the call
        return self.tid

    def rest(self):
        """Its native id, once it waits."""
        self.spin.clear()
        self.resting.wait(30)
        return self.tid


@pytest.fixture
def spinner():
    spinner = Spinner()
    yield spinner
    spinner.stop.set()


def test_a_running_native_thread_is_waited_for_and_a_resting_one_is_not(spinner):
    tid = spinner.running()
    assert tid in fork_guard._native_threads()
    assert threading.get_native_id() not in fork_guard._native_threads()
    assert fork_guard.rest([tid], patience=0.05) is False
    assert fork_guard.rest([spinner.rest()], patience=5) is True


def test_a_thread_that_ended_does_not_hold_a_fork_back():
    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    assert fork_guard.rest([ended.native_id], patience=0.05) is True


def test_the_switch_interval_is_put_back(spinner):
    before = sys.getswitchinterval()
    fork_guard.rest([spinner.running()], patience=0.02)
    assert sys.getswitchinterval() == before


SCRIPT = textwrap.dedent(
    """
    import _thread, datetime, hashlib, json, os, threading, time
    import torch.distributed as dist
    from accel_mixin.distributed import fork_guard

    fork_guard.needed = lambda: True
    seen = []
    rest = fork_guard.rest
    fork_guard.rest = lambda tids: seen.append(rest(tids, patience=0.05))

    def fork():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    fork_guard.guard_forks()
    fork_guard.guard_forks()  # once per process
    spinner = Spinner()
    fork()  # no process group: nothing to wait for
    store = dist.FileStore({store!r}, 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    spinner.running()
    fork()  # the spinner runs: waited for, in vain
    spinner.rest()
    fork()  # it rests
    spinner.stop.set()
    dist.destroy_process_group()
    print(json.dumps(seen))
    """
)


def test_every_fork_of_a_process_with_a_group_waits_for_its_native_threads(tmp_path):
    # the child defines the same Spinner
    script = inspect.getsource(Spinner) + SCRIPT.format(store=str(tmp_path / "store"))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[false, true]"


@pytest.mark.multiprocess
def test_the_cost_benchmark_runs_on_two_processes(tmp_path):
    out = tmp_path / "fork.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "benchmarks" / "fork.py"
    launch = run_processes(script, "--out", str(out), "--rounds", "2", timeout=180)
    assert launch.returncode == 0, launch.describe()
    result = json.loads(out.read_text())
    assert len(result["runs_s"]["guarded"]) == len(result["runs_s"]["unguarded"]) == 2
