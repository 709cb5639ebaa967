"""A rank that dies or leaves is noticed within seconds by the others, in
the two-agent layout of two machines (each torchrun agent keeps its own
worker alive), with one of them in a PID namespace of its own (a container
with the host's network), and in one agent's, with the process group's
default timeout (``launched/dead_rank.py``); in every phase, the epoch-end
exchange and an asynchronous save in flight among them. A rank that lives
but does not answer, paused or holding the GIL, is waited for and the job
finishes (``launched/liveness_run.py``).

A rank ends once per launch, so each way of ending is a launch of its own;
the calls of the survivor that look for it anew (save_params, then predict)
share one. The healthy job in another PID namespace is the paused and busy
one, on three machines.
"""

import pytest
from harness import can_isolate, free_port, run_nodes, run_processes

pytestmark = pytest.mark.multiprocess

isolating = can_isolate()
needs_namespaces = pytest.mark.skipif(
    not isolating, reason="unshare may not make PID namespaces here"
)


@pytest.fixture(scope="module")
def dead_rank():
    """``launch(mode, nodes, isolated)``: dead_rank.py's launch for it, run
    once and shared by the tests that read it."""
    launches = {}

    def launch(mode, nodes=2, isolated=()):
        key = (mode, nodes, isolated)
        if key not in launches:
            if nodes == 1:
                launches[key] = run_processes("dead_rank.py", mode, timeout=120)
            else:
                launches[key] = run_nodes("dead_rank.py", mode, timeout=120, isolated=isolated)
        return launches[key]

    return launch


def survivor(launch, call):
    """What ``call`` raised on rank 0, the survivor, and in how long."""
    assert not launch.timed_out and not launch.hung, launch.describe()
    rank0 = launch.ranks[0]
    assert rank0 is not None, launch.describe()
    return rank0[call]["value"]  # error_and_seconds: the call's error, never its own


@pytest.mark.parametrize("what", ["save_params", "inference", "load_params"])
@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_the_surviving_machine_raises_naming_the_rank_that_is_gone(dead_rank, mode, what):
    outcome = survivor(dead_rank(mode), what)
    assert outcome["error"].startswith(f"DistributedError: {what}"), outcome
    assert "rank 1 is gone" in outcome["error"] and "last seen after fit" in outcome["error"]
    # the phase that failed: no save was in flight
    assert "in flight" not in outcome["error"], outcome
    assert outcome["seconds"] < 30  # the process group's timeout is 30 minutes


@needs_namespaces
def test_a_peer_in_another_pid_namespace_that_ends_is_named_within_seconds(dead_rank):
    launch = dead_rank("kill", isolated=(1,))
    for what in ("save_params", "inference"):
        outcome = survivor(launch, what)
        assert outcome["error"].startswith(f"DistributedError: {what}"), outcome
        assert "rank 1 is gone" in outcome["error"]
        assert outcome["seconds"] < 30  # the process group's timeout is 30 minutes


def test_one_agent_ends_the_job_within_seconds(dead_rank):
    # rank 1 ends by an uncaught error, which runs its exit (the mixin's stop
    # of its threads among it): torchrun then stops rank 0, waiting for it
    launch = dead_rank("raise", nodes=1)
    assert not launch.timed_out and not launch.hung, launch.describe()
    assert launch.returncode != 0  # rank 1 failed: so does the job
    rank0 = launch.ranks[0]
    if rank0 is not None:  # unless torchrun stopped it first
        outcome = rank0["save_params"]["value"]
        assert "rank 1 is gone" in outcome["error"] and outcome["seconds"] < 30


@pytest.fixture(scope="module")
def paused_and_busy():
    # three machines, rank 1 in a PID namespace of its own where allowed:
    # its process id means nothing to the others, looked up it may be no
    # process, and it holds the GIL, so that its key stands still
    return run_nodes(
        "liveness_run.py", "busy", nodes=3, timeout=170, isolated=(1,) if isolating else ()
    )


@needs_namespaces
def test_a_peer_in_another_pid_namespace_with_this_hostname_is_not_taken_for_gone(
    paused_and_busy,
):
    for rank in paused_and_busy.check():
        assert rank["error"] is None


def test_a_rank_paused_or_holding_the_gil_for_20_s_is_waited_for(paused_and_busy):
    # beyond any window of missed beats: the process lives, so it is no loss;
    # rank 1 holds the GIL while rank 2 is paused
    ranks = paused_and_busy.check()
    assert [rank["error"] for rank in ranks] == [None, None, None]
    assert ranks[1]["gil"] >= 19.5 and ranks[2]["paused"] >= 19.5
    assert ranks[0]["seconds"] > 19.5  # it did wait for them


@pytest.mark.parametrize(
    ("mode", "what"),
    [("kill-in-exchange", "on_epoch_end"), ("kill-async-in-flight", "partial_fit")],
)
def test_a_rank_that_ends_in_any_phase_is_named_on_two_machines(mode, what):
    # gloo's own error there was "Connection reset by peer ... GLHF!"
    launch = run_nodes("liveness_run.py", mode, timeout=120)
    assert not launch.timed_out, launch.describe()
    rank0 = launch.ranks[0]
    assert rank0 is not None, launch.describe()
    assert rank0["error"].startswith(f"DistributedError: {what}: rank 1 is gone"), rank0
    assert rank0["seconds"] < 30


@pytest.mark.parametrize("mode", ["kill-in-exchange", "kill-async-in-flight"])
def test_a_rank_that_ends_in_any_phase_is_named_on_one_machine(mode):
    # the agent stops the survivors once it sees a worker fail: here it looks
    # once a minute, so that rank 0 reports first, then ends the agent itself
    launch = run_processes(
        "liveness_run.py",
        mode,
        timeout=120,
        launcher_args=["--monitor-interval=60"],
        env={"LIVENESS_END_AGENT": "1"},
    )
    assert not launch.timed_out, launch.describe()
    assert launch.returncode != 0
    rank0 = launch.ranks[0]
    assert rank0 is not None, launch.describe()
    assert rank0["error"].startswith("DistributedError: "), rank0
    assert "rank 1 is gone (its process ended)" in rank0["error"]


@pytest.fixture(scope="module")
def stalled_io():
    ranks = run_processes("stalled_io.py", timeout=180).check()
    return [{name: r["value"] for name, r in rank.items()} for rank in ranks]


def test_a_write_without_progress_fails_on_every_rank_after_the_io_timeout(stalled_io):
    rank0, rank1 = (rank["a_stuck_write_fails_on_every_rank"] for rank in stalled_io)
    # by default the I/O timeout is the process group's: 10 s here
    assert rank0["error"].startswith(
        "Stalled: save_params of f_params=params.pt made no progress for 10 s"
    )
    assert rank1["error"].startswith("DistributedError: save_params failed on rank 0: Stalled")
    for rank in (rank0, rank1):
        assert 9 < rank["seconds"] < 30


def test_a_slow_write_that_progresses_finishes(stalled_io):
    for rank in stalled_io:
        outcome = rank["a_slow_write_that_progresses_finishes"]
        assert outcome["error"] is None
        assert outcome["seconds"] > 2.5  # longer than its I/O timeout of 1 s
        assert outcome["written"]


def restart(**kwargs):
    return run_processes("restart_attempts.py", **kwargs)


def test_a_restarted_attempt_waits_at_its_own_barriers():
    # the launcher flags the guide recommends: a store of its own per attempt
    launch = restart(
        timeout=120,
        launcher_args=[
            "--max-restarts=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        ],
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )
    rank0, rank1 = launch.check()
    assert rank0["attempt"] == rank1["attempt"] == 1
    assert rank0["error"] is None and rank1["error"] is None
    assert rank0["left"] >= rank1["arrived"]  # it waited for rank 1, which came late


def test_on_a_store_shared_across_restarts_no_key_of_the_dead_attempt_is_read():
    # torchrun's static rendezvous keeps one store: accel_mixin's keys are
    # the attempt's own. torch's gloo reads the dead attempt's addresses on
    # such a store, and fails or hangs connecting: the script deletes them
    # (restart_attempts.forget_gloo_addresses), and leaves ours.
    launch = restart(timeout=90, launcher_args=["--max-restarts=1"])
    rank0, rank1 = launch.check()
    assert rank0["forgot"] and rank1["forgot"]  # gloo's old addresses were there
    assert rank0["attempt"] == rank1["attempt"] == 1
    assert rank0["error"] is None and rank1["error"] is None
    assert rank0["left"] >= rank1["arrived"]  # the barrier it waited at was attempt 1's


@pytest.mark.parametrize("mode", ["absent", "ended", "writer-ended"])
def test_among_four_processes_every_other_rank_names_the_one_missing(mode):
    # the barrier's outcome passes through log2(4) rounds: a rank that ended
    # is passed on by those that saw its connection close; one that lives
    # but never arrives is found by the census after the timeout. The
    # others wait for the writer's outcome on their connection to it.
    launch = run_processes("four_ranks.py", mode, nproc=4, timeout=120)
    assert not launch.timed_out, launch.describe()
    missing = 0 if mode == "writer-ended" else 2
    for rank in sorted({0, 1, 2, 3} - {missing}):
        outcome = launch.ranks[rank]
        assert outcome is not None, launch.describe()
        if mode == "absent":
            assert ". Rank 2 did not arrive: its process lives" in outcome["error"]
            assert "is gone" not in outcome["error"]
        else:
            gone = f"save_params: rank {missing} is gone (its process ended)"
            assert gone in outcome["error"], outcome
            assert outcome["seconds"] < 3  # at once (the writer wrote for 1 s), not at the timeout
