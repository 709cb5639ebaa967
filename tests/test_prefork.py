"""Forked launches (tests/prefork.py) give a worker what torchrun gives it."""

import signal

import pytest
from harness import run_plain, run_processes

LAUNCHERS = {"torchrun": False, "forked": True}

# what differs between any two fresh interpreters, and so between launchers
DRAWN = ("hash", "draws")


def without_drawn(report):
    return {key: value for key, value in report.items() if key not in DRAWN}


@pytest.fixture(scope="module")
def views():
    return {
        name: run_processes("launch_view.py", "view", forked=forked, timeout=120)
        for name, forked in LAUNCHERS.items()
    }


@pytest.mark.multiprocess
def test_a_forked_worker_sees_what_a_torchrun_worker_sees(views):
    torchrun, forked = (views[name].check() for name in LAUNCHERS)
    assert [without_drawn(r) for r in forked] == [without_drawn(r) for r in torchrun]
    assert forked[0]["variables"]["RANK"] == "0" and forked[1]["variables"]["RANK"] == "1"
    assert forked[0]["main"] == "__main__" and forked[0]["path0"] == "launched"
    assert all(r["own_session"] and r["stdin"] == "null" for r in forked)
    assert forked[1]["store_after_rank_0"] == "yes"  # the launcher's store outlives rank 0


@pytest.mark.multiprocess
def test_forked_ranks_hash_strings_and_draw_numbers_as_fresh_interpreters(views):
    # a seed shared by the ranks would hide collectives entered in different orders
    ranks = views["forked"].check()
    assert ranks[0]["hash"] != ranks[1]["hash"]
    assert all(a != b for a, b in zip(ranks[0]["draws"], ranks[1]["draws"]))
    again = run_processes("launch_view.py", "view", timeout=120).check()
    assert all(a != b for a, b in zip(ranks[0]["draws"], again[0]["draws"]))


@pytest.mark.multiprocess
def test_each_rank_writes_its_own_output_files(views):
    for name in LAUNCHERS:
        launch = views[name]
        assert [out for out, _ in launch.rank_outputs] == ["rank 0 out\n", "rank 1 out\n"], name
        assert all(f"rank {r} err" in err for r, (_, err) in enumerate(launch.rank_outputs))
        assert "[default1]:rank 1 out" in launch.output, name


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_sigterm_to_the_launcher_reaches_every_worker(launcher):
    launch = run_processes(
        "launch_view.py", "signal-launcher", forked=LAUNCHERS[launcher], timeout=120
    )
    assert not launch.timed_out and launch.returncode != 0, launch.describe()
    assert [r["ended_by"] for r in launch.ranks] == ["SIGTERM", "SIGTERM"], launch.describe()


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_failed_worker_stops_the_others_and_fails_the_launch(launcher):
    launch = run_processes("launch_view.py", "fail", forked=LAUNCHERS[launcher], timeout=120)
    assert not launch.timed_out and launch.returncode == 1, launch.describe()
    assert [r["ended_by"] for r in launch.ranks] == ["SIGTERM", "exit 3"], launch.describe()
    assert "exitcode  : 3" in launch.output


@pytest.mark.multiprocess
@pytest.mark.parametrize("sigint", ["handled", "ignored"])
def test_a_forked_plain_run_is_a_plain_python_run(sigint):
    # a test run in the background of a shell ignores SIGINT, and so does
    # every interpreter it starts
    previous = signal.signal(
        signal.SIGINT, signal.SIG_IGN if sigint == "ignored" else signal.default_int_handler
    )
    try:
        plain, forked = (
            run_plain("launch_view.py", "view", forked=forked, timeout=120)
            for forked in (False, True)
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert without_drawn(forked.check()[0]) == without_drawn(plain.check()[0])
    assert forked.check()[0]["sigint_default"] == (sigint == "handled")
    assert forked.check()[0]["variables"]["RANK"] is None
    assert forked.output == plain.output == "rank 0 out\nrank 0 err\n"
