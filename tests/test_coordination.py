"""Fail-fast sections, with two coordinators on one in-memory store, in threads.

The same over real processes: test_multiprocess.py and test_sync.py.
"""

import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from accel_mixin.distributed import liveness
from accel_mixin.distributed.coordination import Coordinator
from accel_mixin.errors import DistributedError


def pair(timeout=30.0):
    store = dist.HashStore()
    return [Coordinator(2, rank, timeout=timeout, store=store) for rank in (0, 1)]


def run_ranks(*bodies):
    """Run one body per rank in threads; return what each raised or returned."""
    results = [None] * len(bodies)

    def target(i):
        try:
            results[i] = ("ok", bodies[i]())
        except BaseException as exc:  # pylint: disable=broad-except
            results[i] = ("raised", exc)

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_single_process_needs_no_store():
    coordinator = Coordinator(1, 0)
    assert not coordinator.distributed
    coordinator.barrier("nothing to wait for")
    assert coordinator.run(lambda: 42, what="x") == 42
    with pytest.raises(ValueError):
        coordinator.run(lambda: int("x"), what="x")


def test_barrier_waits_for_every_rank():
    rank0, rank1 = pair()
    arrived = []

    def late():
        time.sleep(0.3)
        arrived.append(time.monotonic())
        with rank1.session("s"):
            rank1.barrier("b")

    def early():
        with rank0.session("s"):
            rank0.barrier("b")
        return time.monotonic()

    (_, done), _ = run_ranks(early, late)
    assert done >= arrived[0]


def test_an_error_on_one_rank_reaches_the_other_promptly():
    rank0, rank1 = pair(timeout=30)

    def failing():
        with rank1.session("fit"), rank1.section("on_epoch_end"):
            time.sleep(0.1)
            raise ValueError("boom on rank 1")

    def waiting():
        start = time.monotonic()
        try:
            with rank0.session("fit"), rank0.section("on_epoch_end"):
                rank0.run(lambda: None, what="save_params")
        finally:
            waiting.seconds = time.monotonic() - start

    (kind0, exc0), (kind1, exc1) = run_ranks(waiting, failing)
    assert (kind0, kind1) == ("raised", "raised")
    assert isinstance(exc1, ValueError)
    assert isinstance(exc0, DistributedError)
    assert "on_epoch_end failed on rank 1: ValueError: boom on rank 1" in str(exc0)
    assert waiting.seconds < 5


def test_main_only_failure_reaches_the_others():
    rank0, rank1 = pair()

    def fail():
        raise OSError("disk full")

    results = run_ranks(
        lambda: rank0.run(fail, what="save_params"),
        lambda: rank1.run(
            lambda: pytest.fail("not the main process"), what="save_params", here=False
        ),
    )
    assert isinstance(results[0][1], OSError)
    assert isinstance(results[1][1], DistributedError)
    assert "rank 0: OSError: disk full" in str(results[1][1])


def test_a_caught_error_leaves_the_enclosing_section_healthy():
    rank0, rank1 = pair()

    def body(coordinator):
        def save():
            raise OSError("disk full")

        with coordinator.session("fit"), coordinator.section("on_epoch_end"):
            try:
                coordinator.run(save, what="save_params", here=coordinator.process_index == 0)
            except (OSError, DistributedError):
                pass  # as skorch's Checkpoint does
            coordinator.barrier("on_epoch_end")
        return "done"

    results = run_ranks(lambda: body(rank0), lambda: body(rank1))
    assert results == [("ok", "done"), ("ok", "done")]


def test_the_next_session_starts_afresh():
    rank0, rank1 = pair()

    def body(coordinator, fail):
        try:
            with coordinator.session("first"):
                if fail:
                    raise ValueError("only in the first session")
                coordinator.barrier("first")
        except (ValueError, DistributedError):
            pass
        with coordinator.session("second"):
            coordinator.barrier("second")
        return "second passed"

    results = run_ranks(lambda: body(rank0, False), lambda: body(rank1, True))
    assert results == [("ok", "second passed"), ("ok", "second passed")]


def test_a_rank_that_never_arrives_times_out():
    rank0, _ = pair(timeout=0.2)
    with pytest.raises(DistributedError, match="neither arrived nor reported"):
        with rank0.session("s"):
            rank0.barrier("b")


def test_a_barrier_that_times_out_fails_on_every_rank():
    # rank 1 gives up before the slow rank 0 arrives: rank 0 must not pass
    # the barrier alone and go on as if everyone had been there
    rank0, rank1 = pair(timeout=0.3)

    def slow():
        with rank0.session("save"):
            time.sleep(1.0)
            rank0.barrier("save")

    def waiting():
        with rank1.session("save"):
            rank1.barrier("save")

    (state0, exc0), (state1, exc1) = run_ranks(slow, waiting)
    assert state0 == state1 == "raised"
    assert str(exc1).startswith(
        "save: rank 1 waited 0 s for the other ranks, which neither "
        "arrived nor reported a failure. Every rank must make the same "
        "collective calls (fit, partial_fit, predict"
    )
    assert str(exc0) == str(exc1)  # rank 0 learns why


def test_a_run_slower_than_the_timeout_succeeds_while_it_writes(tmp_path):
    # the process group's timeout, kept short so that errors surface fast,
    # must not cut a long save short while it makes progress
    rank0, rank1 = pair(timeout=0.3)

    def body(coordinator):
        def save():
            with open(tmp_path / "slow", "wb") as f:
                for _ in range(10):  # five timeouts long
                    f.write(b"x" * 100)
                    f.flush()
                    time.sleep(0.15)
            return "saved"

        return coordinator.run(save, what="save_params", here=coordinator.process_index == 0)

    assert run_ranks(lambda: body(rank0), lambda: body(rank1)) == [("ok", "saved"), ("ok", None)]


def test_a_run_without_progress_fails_on_every_rank_after_its_io_timeout():
    # a write stuck in a hung filesystem: nothing read, written or computed
    rank0, rank1 = pair(timeout=30)
    stuck = threading.Event()

    def body(coordinator):
        return coordinator.run(
            lambda: stuck.wait(20),  # bounded: a watch that never fires fails the test
            what="save_params",
            files="p.pt",
            here=coordinator.process_index == 0,
            io_timeout=1,
        )

    start = time.monotonic()
    (state0, exc0), (state1, exc1) = run_ranks(lambda: body(rank0), lambda: body(rank1))
    stuck.set()
    assert time.monotonic() - start < 10  # not the 30 s timeout, nor forever
    assert (state0, state1) == ("raised", "raised")
    assert isinstance(exc0, TimeoutError)
    assert str(exc0).startswith("save_params of p.pt made no progress for 1 s")
    assert isinstance(exc1, DistributedError)
    assert "save_params failed on rank 0: Stalled: save_params of p.pt made no" in str(exc1)


def _ended_process():
    """The identity of a process of this machine that ended."""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from accel_mixin.distributed import liveness; print(liveness.process_identity())",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_a_rank_whose_process_ended_is_named_within_seconds():
    rank0, rank1 = pair(timeout=30)
    ended = _ended_process()
    assert ended.count("/") == 2 and ended != liveness.process_identity()
    rank1._presence.stopped.set()  # pylint: disable=protected-access
    rank1._presence.join()  # pylint: disable=protected-access
    rank0.lifelines.close()  # the process id alone tells
    rank0.lifelines = None
    rank0.store.set("presence/1", f"7 {ended}|in predict")
    start = time.monotonic()
    with pytest.raises(
        DistributedError, match=r"rank 1 is gone \(its process ended\), last seen in predict"
    ):
        rank0.barrier("save_params")
    assert time.monotonic() - start < 5


def test_a_process_id_of_another_boot_or_pid_namespace_is_never_looked_at():
    # a peer with this hostname in another container: its process id, looked
    # up here, may be no process, or another one
    boot, namespace, _ = _ended_process().split("/")
    assert liveness.exited(f"{boot}/{namespace}/999999999")  # no such process here
    assert not liveness.exited(f"{boot}/pid:[1]/999999999")  # another PID namespace
    assert not liveness.exited(f"another-boot/{namespace}/999999999")  # another machine
    assert not liveness.exited("-")  # a system that did not say


def test_a_process_that_ended_but_was_not_collected_has_ended():
    # a zombie: its launcher looks at its workers seldom (torchrun's
    # --monitor-interval) and has not collected it
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    boot, namespace, _ = liveness.process_identity().split("/")
    deadline = time.monotonic() + 30
    while not liveness.exited(f"{boot}/{namespace}/{child.pid}"):
        assert time.monotonic() < deadline, "a zombie counts as alive"
        time.sleep(0.05)
    with open(f"/proc/{child.pid}/stat", encoding="ascii") as f:
        assert f.read().rpartition(")")[2].split()[0] == "Z"  # not yet collected
    child.wait()


def _wait_for_lines(*coordinators):
    deadline = time.monotonic() + 10
    while not all(
        line.verified for c in coordinators for line in list(c.lifelines.lines.values())
    ) or not all(c.lifelines.lines for c in coordinators):
        assert time.monotonic() < deadline, "the lifelines never came up"
        for c in coordinators:
            c.lifelines.ended()
        time.sleep(0.05)


def test_a_rank_whose_lifeline_was_reset_is_gone_whatever_its_process_id_says():
    # another machine, or another PID namespace: no process id to look at;
    # the kernel closes the rank's lines when its process ends
    rank0, rank1 = pair(timeout=30)
    _wait_for_lines(rank0, rank1)
    # rank 1's presence thread would announce itself again over the key set
    # below ("before any collective call"): under load it did, between the
    # set and rank 0's look. A process that ended announces nothing
    rank1._presence.stopped.set()  # pylint: disable=protected-access
    rank1._presence.join()  # pylint: disable=protected-access
    rank1.lifelines.close()  # what the kernel does at the end of rank 1's process
    rank0.store.set("presence/1", "7 another-boot/pid:[1]/123|after fit")
    start = time.monotonic()
    with pytest.raises(
        DistributedError, match=r"rank 1 is gone \(its process ended\), last seen after fit"
    ):
        rank0.barrier("on_epoch_end")
    assert time.monotonic() - start < 5


def test_a_line_to_something_else_than_the_rank_proves_nothing():
    # an address that does not reach the rank (its host's loopback, seen
    # from another machine) may reach another listener, which then closes
    store = dist.HashStore()
    with socket.create_server(("127.0.0.1", 0)) as stranger:
        port = stranger.getsockname()[1]
        store.set("lifeline/1", f"{port} 1-abcdef 127.0.0.1")
        lifelines = liveness.Lifelines(store, 0, 2)
        lifelines.connect()
        conn, _ = stranger.accept()
        conn.sendall(b"something else\n")
        conn.close()
        time.sleep(0.2)
        assert lifelines.ended() == []
        assert 1 not in lifelines.lines
        lifelines.close()


def test_a_paused_rank_is_waited_for_then_named_unresponsive_not_gone():
    # rank 1 lives (its lines stay up) but its presence thread, like a
    # process paused or holding the GIL, no longer sets its key
    rank0, rank1 = pair(timeout=3)
    _wait_for_lines(rank0, rank1)
    paused = threading.Event()
    rank1._presence.announce = lambda coordinator: paused.wait(20)  # pylint: disable=protected-access
    time.sleep(1.5)
    start = time.monotonic()
    with pytest.raises(DistributedError) as raised:
        rank0.barrier("on_epoch_end")
    paused.set()
    assert time.monotonic() - start >= 2.9  # the whole timeout
    message = str(raised.value)
    assert "rank 1 is gone" not in message
    assert "Rank 1 is unresponsive: its process lives, but has not answered for" in message


def test_a_live_rank_keeps_the_others_waiting():
    rank0, rank1 = pair(timeout=30)

    def late():
        time.sleep(1.5)
        rank1.barrier("b")

    results = run_ranks(lambda: rank0.barrier("b"), late)
    assert results == [("ok", None), ("ok", None)]


def test_a_rank_that_times_out_just_as_the_last_arrives_passes():
    rank0, rank1 = pair(timeout=0.2)
    with rank0.session("x"), rank1.session("x"):
        key = rank1._child("b")  # pylint: disable=protected-access
        rank1.store.add(key, 2)  # both arrived, as the timeout fires
        rank1._give_up(key, "x", 0.2)  # pylint: disable=protected-access
        assert rank1.store.add(key, 0) == 2
        assert rank1.failure() is None


def test_ranks_in_different_calls_raise_at_once_naming_both():
    rank0, rank1 = pair()

    def inference():
        rank0.barrier("predict")

    def saving():
        return rank1.run(lambda: None, what="save_params")

    start = time.monotonic()
    (state0, exc0), (state1, exc1) = run_ranks(inference, saving)
    assert time.monotonic() - start < 5  # not the 30 s timeout
    assert state0 == state1 == "raised"
    for exc in (exc0, exc1):
        assert isinstance(exc, DistributedError)
        message = str(exc)
        assert "predict" in message and "save_params" in message
        assert "every rank must make the same collective calls" in message


def test_ranks_in_the_same_calls_compare_them_once_per_call():
    rank0, rank1 = pair()
    compared = []

    class Counting:
        def __init__(self, store):
            self.store = store

        def compare_set(self, key, *args):
            compared.append(key)
            return self.store.compare_set(key, *args)

        def __getattr__(self, name):
            return getattr(self.store, name)

    for coordinator in (rank0, rank1):
        coordinator.store = Counting(coordinator.store)

    def body(coordinator):
        for _ in range(3):
            coordinator.run(lambda: None, what="save_params")
        with coordinator.session("fit"):
            for _ in range(4):
                coordinator.barrier("epoch")

    assert run_ranks(lambda: body(rank0), lambda: body(rank1)) == [("ok", None)] * 2
    assert sorted(compared) == sorted(f"g{g}/call" for g in (1, 2, 3, 4) for _ in range(2))


def test_a_restarted_attempt_never_reads_the_keys_of_the_dead_one(monkeypatch):
    # one store across the attempts, as torchrun's static rendezvous keeps it
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    dead = [Coordinator(2, rank, timeout=30, store=store) for rank in (0, 1)]

    def fails(coordinator):
        with coordinator.session("fit"):
            coordinator.barrier("fit")
            raise ValueError("attempt 0 dies")

    run_ranks(*(lambda c=c: fails(c) for c in dead))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    rank0, rank1 = (Coordinator(2, rank, timeout=30, store=store) for rank in (0, 1))
    arrived = []

    def late():
        time.sleep(1.0)
        arrived.append(time.monotonic())
        with rank1.session("fit"):
            rank1.barrier("fit")

    def early():
        with rank0.session("fit"):
            rank0.barrier("fit")
        return time.monotonic()

    (state0, done), (state1, _) = run_ranks(early, late)
    assert (state0, state1) == ("ok", "ok")  # no failure of attempt 0 surfaced
    assert done >= arrived[0]  # and barrier 1 waited for rank 1
