"""The launch-layout checks in one process; their multi-process side runs in
test_multiprocess.py."""

import ast
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from accelerate import Accelerator

from accel_mixin.distributed.process_layout import (
    check_not_a_child_of_a_rank,
    check_process_layout,
)


def fake_accelerator(main=True, processes=1):
    return SimpleNamespace(is_main_process=main, num_processes=processes, distributed_type="NO")


def test_layout_refuses_a_group_that_sees_one_process(monkeypatch):
    accelerator = Accelerator(cpu=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError) as exc:
        check_process_layout(accelerator)
    msg = str(exc.value)
    assert "WORLD_SIZE=2" in msg
    assert "ACCELERATE_USE_CPU=true" in msg
    assert "Accelerator(cpu=True)" in msg


@pytest.mark.parametrize("world_size", [None, "1", "garbage"])
def test_layout_accepts_a_single_process(monkeypatch, world_size):
    accelerator = Accelerator(cpu=True)
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    check_process_layout(accelerator)


def test_layout_accepts_a_group_the_accelerator_sees(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_process_layout(fake_accelerator(processes=2))


def _refusal():
    """What ``check_not_a_child_of_a_rank`` raises in this process, or None."""
    try:
        check_not_a_child_of_a_rank()
    except RuntimeError as exc:
        return str(exc)
    return None


_PARENT = """
import os, subprocess, sys
from test_process_layout import _refusal
os.environ.update({late!r})
code = "from test_process_layout import _refusal; print(repr(_refusal()))"
started = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
read, write = os.pipe()
child = os.fork()
if child == 0:
    os.write(write, repr(_refusal()).encode())
    os._exit(0)
os.waitpid(child, 0)
os.close(write)
print(repr((os.getpid(), started.stdout.strip().splitlines()[-1], os.read(read, 1 << 16).decode())))
"""


def _children_of(started, late=None):
    """A program started with the environment ``started``, then given
    ``late``: its pid, and what refuses a child it starts as a new program
    (as joblib's loky does) and a child it forks (as notebook_launcher)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(started, PYTHONPATH=os.pathsep.join(sys.path))
    code = _PARENT.format(late=late or {})
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    pid, new_program, forked = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return pid, ast.literal_eval(new_program), ast.literal_eval(forked)


def test_a_child_of_a_launched_rank_is_refused_naming_it():
    # a rank as torchrun starts it: a new program with the job's variables
    pid, new_program, forked = _children_of({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"})
    for refusal in (new_program, forked):
        assert f"started by rank 1 of a job of WORLD_SIZE=2 processes (pid {pid})" in refusal


def test_a_rank_whose_launcher_lacks_its_variables_is_not_refused():
    # notebook_launcher: a kernel started alone sets the job's variables,
    # then forks the ranks (or starts them as new programs: spawn, on XPU)
    late = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    assert _children_of({}, late=late)[1:] == (None, None)
    # torchrun in a job of its own, as Kubeflow's pods: RANK and WORLD_SIZE
    # of the pod, no LOCAL_RANK
    late = {"LOCAL_RANK": "0"}
    assert _children_of({"WORLD_SIZE": "2", "RANK": "1"}, late=late)[1:] == (None, None)


def test_importing_it_in_a_rank_writes_no_environment():
    code = (
        "import os, accelerate, skorch, sklearn, torch; before = dict(os.environ); "
        "import accel_mixin.net; print(sorted(set(os.environ.items()) ^ set(before.items())))"
    )
    env = dict(os.environ, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stderr


def test_one_process_is_no_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _refusal() is None


@pytest.mark.multiprocess
def test_worker_processes_of_a_rank_get_a_clear_error():
    from harness import check_values, run_processes

    # torchrun starts the ranks as new programs (the harness's forked
    # ranks are children of a process that set their variables later)
    launch = run_processes("children_check.py", timeout=240, forked=False)
    for value in check_values(
        [r["checks"] for r in launch.check()], "search_with_worker_processes"
    ):
        assert value["error"].startswith("BrokenProcessPool: A task has failed to un-serialize")
        assert "RuntimeError: This process (pid " in value["cause"]
        assert "as a worker of GridSearchCV(n_jobs=...)" in value["cause"]
        assert "Use n_jobs=1 in a job of several processes" in value["cause"]
        assert value["seconds"] < 60  # joblib starts its workers, then they refuse


@pytest.mark.multiprocess
def test_ranks_forked_by_notebook_launcher_are_not_refused():
    from harness import free_port, run_plain

    launch = run_plain(
        "notebook_ranks.py",
        free_port(),
        timeout=240,
        env={"ACCELERATE_USE_CPU": "true"},
        forked=False,  # the kernel: a program started without the job's variables
    )
    (report,) = launch.check()
    ranks = report["ranks"]
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    assert all(r["forked_by_the_kernel"] for r in ranks)
    # a net unpickled on a rank builds its accelerator
    assert [r["unpickled"] for r in ranks] == [None, None]
