"""The launch-layout checks in one process; their multi-process side runs in
test_multiprocess.py."""

from types import SimpleNamespace

import pytest
from accelerate import Accelerator

from accel_mixin.distributed.process_layout import check_process_layout


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


@pytest.mark.multiprocess
def test_worker_processes_of_a_rank_get_a_clear_error():
    from harness import check_values, run_processes

    ranks = [r["checks"] for r in run_processes("children_check.py", timeout=240).check()]
    for value in check_values(ranks, "search_with_worker_processes"):
        assert value["error"].startswith("BrokenProcessPool: A task has failed to un-serialize")
        assert "RuntimeError: This process (pid " in value["cause"]
        assert "as a worker of GridSearchCV(n_jobs=...)" in value["cause"]
        assert "Use n_jobs=1 in a job of several processes" in value["cause"]
        assert value["seconds"] < 60  # joblib starts its workers, then they refuse
