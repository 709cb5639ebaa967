"""Fail-fast sections, with two coordinators (``Control``) on one in-memory
store, in threads: their gloo group connects over loopback.

The same over real processes: test_multiprocess.py and test_sync.py.
"""

import functools
import gc
import threading
import time
import weakref

import pytest
import torch.distributed as dist

from accel_mixin.distributed.control import Control, agreed_failure
from accel_mixin.distributed.io_watchdog import Watchdog
from accel_mixin.distributed.object_gather import ObjectGather
from accel_mixin.errors import DistributedError, Stalled
from accel_mixin.training.notifications import Notification


@pytest.fixture(autouse=True)
def no_group_outlives_its_test():
    """The gloo groups these tests make die with their test, here, where
    their threads run. Left in a reference cycle (a traceback, a closure),
    a group is torn down by whatever collects it: a DataLoader worker that a
    later test of this process forks collected one and waited forever in
    its teardown for threads that a child does not have."""
    yield
    gc.collect()


def pair(timeout=30.0):
    return ranks(2, timeout)


def ranks(n, timeout=30.0):
    store = dist.HashStore()
    return [Control(n, rank, timeout=timeout, store=store) for rank in range(n)]


def warmed_up(n, timeout):
    """``n`` coordinators whose group is connected: one barrier passed."""
    coordinators = ranks(n, timeout)
    run_ranks(*[functools.partial(c.barrier, "warm up") for c in coordinators])
    return coordinators


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
    coordinator = Control(1, 0)
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

    wrote = []

    def waiting():
        start = time.monotonic()
        try:
            with rank0.session("fit"), rank0.section("on_epoch_end"):
                rank0.run(lambda: wrote.append(True), what="save_params")
        finally:
            waiting.seconds = time.monotonic() - start

    (kind0, exc0), (kind1, exc1) = run_ranks(waiting, failing)
    assert (kind0, kind1) == ("raised", "raised")
    assert isinstance(exc1, ValueError)
    assert isinstance(exc0, DistributedError)
    assert "on_epoch_end failed on rank 1: ValueError: boom on rank 1" in str(exc0)
    assert waiting.seconds < 5
    assert not wrote  # the barrier before the write raised


@pytest.mark.parametrize("n", [3, 4, 5])
def test_among_more_ranks_an_error_on_one_reaches_every_other(n):
    # the barrier's outcome passes from rank to rank in log2(n) rounds
    coordinators = warmed_up(n, timeout=30)

    def body(control):
        with control.session("fit"):
            if control.process_index == n - 1:
                raise ValueError(f"boom on rank {n - 1}")
            control.barrier("on_epoch_end")

    results = run_ranks(*[functools.partial(body, c) for c in coordinators])
    assert [kind for kind, _ in results] == ["raised"] * n
    for _, exc in results[:-1]:
        assert f"fit failed on rank {n - 1}: ValueError: boom on rank {n - 1}" in str(exc)


def test_among_four_ranks_a_rank_that_does_not_arrive_is_named_by_every_other():
    coordinators = warmed_up(4, timeout=1)
    errors, seconds = _barrier_without_rank_2(coordinators)
    for error in errors:
        assert ". Rank 2 did not arrive: its process lives" in error, error
    assert seconds < 10


def test_among_four_ranks_a_rank_that_ends_is_named_at_once_by_every_other():
    coordinators = warmed_up(4, timeout=20)
    # its connections close as a dead process's do
    coordinators[2]._group = None  # pylint: disable=protected-access
    gc.collect()
    errors, seconds = _barrier_without_rank_2(coordinators)
    for error in errors:
        assert "save: rank 2 is gone (its process ended)" in error, error
    assert seconds < 10  # not the 20 s timeout


def _barrier_without_rank_2(coordinators):
    """What a barrier of ranks 0, 1 and 3 raised on each, and how long it took."""
    start = time.monotonic()
    others = [coordinators[rank] for rank in (0, 1, 3)]
    results = run_ranks(*[functools.partial(c.barrier, "save") for c in others])
    assert [kind for kind, _ in results] == ["raised"] * 3
    return [str(exc) for _, exc in results], time.monotonic() - start


# a run on the ranks where ``here`` holds, or on one writer every rank knows,
# which starts as the ranks meet and tells the others its outcome
ON_RANK_0 = {
    "here": lambda coordinator: {"here": coordinator.process_index == 0},
    "writer": lambda coordinator: {"writer": 0},
}


@pytest.mark.parametrize("on", ON_RANK_0)
def test_main_only_failure_reaches_the_others(on):
    rank0, rank1 = pair()

    def fail():
        raise OSError("disk full")

    results = run_ranks(
        lambda: rank0.run(fail, what="save_params", **ON_RANK_0[on](rank0)),
        lambda: rank1.run(
            lambda: pytest.fail("not the main process"), what="save_params", **ON_RANK_0[on](rank1)
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
    # rank 0 learns why: it waited too, and nobody met it
    assert isinstance(exc0, DistributedError)
    assert "neither arrived nor reported a failure" in str(exc0)


@pytest.mark.parametrize("on", ON_RANK_0)
def test_a_run_slower_than_the_timeout_succeeds_while_it_writes(tmp_path, on):
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

        return coordinator.run(save, what="save_params", **ON_RANK_0[on](coordinator))

    assert run_ranks(lambda: body(rank0), lambda: body(rank1)) == [("ok", "saved"), ("ok", None)]


@pytest.mark.parametrize("on", ON_RANK_0)
def test_a_run_without_progress_fails_on_every_rank_after_its_io_timeout(on):
    # a write stuck in a hung filesystem: nothing read, written or computed
    rank0, rank1 = pair(timeout=30)
    stuck = threading.Event()

    def body(coordinator):
        return coordinator.run(
            lambda: stuck.wait(20),  # bounded: a watch that never fires fails the test
            what="save_params",
            files="p.pt",
            io_timeout=1,
            **ON_RANK_0[on](coordinator),
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


def test_a_writer_is_kept_between_runs_and_replaced_after_a_stall():
    watchdog = Watchdog()
    workers = [watchdog.run(threading.get_ident, io_timeout=5, what="w") for _ in range(3)]
    assert len(set(workers)) == 1 and workers[0] != threading.get_ident()

    class Net:  # what a save's function holds
        pass

    def saving(net):
        return lambda: net

    net = Net()
    held = weakref.ref(net)
    watchdog.run(saving(net), io_timeout=5, what="w")
    del net
    gc.collect()
    assert held() is None  # the waiting worker holds nothing of the last save
    stuck = threading.Event()
    with pytest.raises(Stalled, match="stuck made no progress for 0 s"):
        watchdog.run(lambda: stuck.wait(20), io_timeout=0.3, what="stuck")
    # the stalled worker still waits: the next run gets a worker of its own
    assert watchdog.run(threading.get_ident, io_timeout=5, what="w") != workers[0]
    stuck.set()
    with pytest.raises(ValueError, match="raised on the worker"):
        watchdog.run(_raise, io_timeout=5, what="w")


def _raise():
    raise ValueError("raised on the worker")


def test_a_live_rank_keeps_the_others_waiting():
    rank0, rank1 = pair(timeout=30)

    def late():
        time.sleep(1.5)
        rank1.barrier("b")

    results = run_ranks(lambda: rank0.barrier("b"), late)
    assert results == [("ok", 0), ("ok", None)]


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


def test_a_restarted_attempt_never_meets_the_dead_one(monkeypatch):
    # one store across the attempts, as torchrun's static rendezvous keeps it
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    dead = [Control(2, rank, timeout=30, store=store) for rank in (0, 1)]

    def fails(coordinator):
        with coordinator.session("fit"):
            coordinator.barrier("fit")
            raise ValueError("attempt 0 dies")

    run_ranks(*(lambda c=c: fails(c) for c in dead))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    rank0, rank1 = (Control(2, rank, timeout=30, store=store) for rank in (0, 1))
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


def test_a_live_rank_that_does_not_arrive_is_named_not_gone():
    # rank 1 lives (its connections stay up), paused or holding the GIL:
    # it is waited for the whole timeout, then named as not arriving
    rank0, rank1 = pair(timeout=3)
    run_ranks(lambda: rank0.barrier("warm up"), lambda: rank1.barrier("warm up"))
    start = time.monotonic()
    with pytest.raises(DistributedError) as raised:
        rank0.barrier("on_epoch_end")
    assert time.monotonic() - start >= 2.9  # the whole timeout
    message = str(raised.value)
    assert "is gone" not in message
    assert "Rank 1 did not arrive: its process lives" in message


def _gloo_closed(address, port):
    return RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
        f"Connection closed by peer [{address}]:{port}"
    )


def test_a_closed_connection_names_the_rank_whose_socket_it_was():
    rank0, rank1 = pair()
    run_ranks(lambda: rank0.barrier("warm up"), lambda: rank1.barrier("warm up"))
    sockets = {s for s, rank in rank0._peers.items() if rank == 1}  # pylint: disable=protected-access
    assert sockets  # every rank's sockets, gathered with the group
    address, port = next(iter(sockets))
    assert rank0.gone(_gloo_closed(address, port)) == 1
    # gloo prints the port in network byte order: that reading names it too
    swapped = int.from_bytes(port.to_bytes(2, "big"), "little")
    assert rank0.gone(_gloo_closed(address, swapped)) == 1
    # a peer killed while this rank reads from it
    read = f"[../pair.cc:537] Read error [{address}]:{port}: Connection reset by peer"
    assert rank0.gone(RuntimeError(read)) == 1
    assert rank0.gone(RuntimeError("something else")) is None
    assert rank0.gone(_gloo_closed("203.0.113.9", 1)) == -1  # a peer, rank unknown


def test_a_failure_learned_in_a_barrier_is_carried_by_every_later_barrier_of_its_section():
    rank0, rank1 = pair(timeout=30)

    def saving():
        with rank0.session("fit"), rank0.section("on_epoch_end"):
            with pytest.raises(DistributedError):
                rank0.run(lambda: None, what="save_state")
            with pytest.raises(DistributedError, match="boom on rank 1"):
                rank0.barrier("on_epoch_end")  # no collective: rank 1 left
        return "left"

    def failing():
        with rank1.session("fit"), rank1.section("on_epoch_end"):
            raise ValueError("boom on rank 1")

    start = time.monotonic()
    (kind0, out0), (_kind1, out1) = run_ranks(saving, failing)
    assert time.monotonic() - start < 5
    assert isinstance(out1, ValueError)
    # the section a failing rank left ends failed on the others too
    assert kind0 == "raised" and "on_epoch_end failed on rank 1" in str(out0), out0


def end_epoch_like(coordinator, callbacks):
    """epoch_end's protocol, in its notification's section: the callbacks, a
    failure noted, one barrier unless the failure was agreed in one; raise."""
    with coordinator.section("on_epoch_end"):
        error = None
        try:
            callbacks()
        except Exception as exc:  # pylint: disable=broad-except
            error = exc
            if not isinstance(exc, DistributedError):
                coordinator.fail("on_epoch_end", exc)
        if error is None or not agreed_failure(error):
            try:
                coordinator.barrier("on_epoch_end")
            except DistributedError as exc:
                error = exc
        if error is not None:
            raise error


def epoch_end_on_both(callbacks0, callbacks1):
    """What end_epoch_like raised on each rank (``callbacks0(coordinator)``
    gives rank 0's callbacks), after which the group still serves a barrier,
    and the seconds it all took."""
    rank0, rank1 = pair(timeout=30)

    def body(coordinator, callbacks):
        outcome = None
        with coordinator.session("fit"):
            try:
                end_epoch_like(coordinator, callbacks(coordinator))
            except Exception as exc:  # pylint: disable=broad-except
                outcome = exc
        with coordinator.session("save_params"):
            coordinator.barrier("save_params")
        return outcome

    start = time.monotonic()
    results = run_ranks(lambda: body(rank0, callbacks0), lambda: body(rank1, callbacks1))
    assert [kind for kind, _ in results] == ["ok", "ok"], results
    return [value for _, value in results], time.monotonic() - start


def _raising(coordinator):
    def callbacks():
        raise ValueError("boom on rank 1")

    return callbacks


def _saving(coordinator):
    def callbacks():
        try:
            coordinator.run(lambda: None, what="save_state")
        except DistributedError:
            pass  # as skorch's Checkpoint does

    return callbacks


def test_a_callback_error_meets_a_save_that_another_rank_swallows():
    (err0, err1), seconds = epoch_end_on_both(_saving, _raising)
    assert seconds < 5
    assert isinstance(err1, ValueError), err1
    assert isinstance(err0, DistributedError), err0
    assert "on_epoch_end failed on rank 1: ValueError: boom on rank 1" in str(err0)


def test_a_callback_error_meets_the_end_of_epoch_barrier():
    (err0, err1), seconds = epoch_end_on_both(lambda coordinator: lambda: None, _raising)
    assert seconds < 5
    assert isinstance(err1, ValueError), err1
    assert "on_epoch_end failed on rank 1: ValueError: boom on rank 1" in str(err0)


@pytest.mark.parametrize("swallowing", [0, 1])
def test_a_failure_swallowed_on_one_rank_only_reaches_it_at_its_next_barrier(swallowing):
    # LoadInitState: rank 1's load fails and one rank swallows what it raised
    # there (rank 1 its FileNotFoundError, or rank 0 the DistributedError);
    # the other's error leaves the enclosing section, where the swallowing
    # rank's next barrier meets it, naming the load as it failed
    rank0, rank1 = pair(timeout=30)

    def body(coordinator):
        def load():
            if coordinator.process_index == 1:
                raise FileNotFoundError("no checkpoint")

        with coordinator.session("fit"), coordinator.section("on_train_begin"):
            try:
                coordinator.run(load, what="load_params")
            except (FileNotFoundError, DistributedError):
                if coordinator.process_index != swallowing:
                    raise
            coordinator.barrier("on_train_begin")
        return "went on"

    start = time.monotonic()
    (kind0, out0), (kind1, out1) = run_ranks(lambda: body(rank0), lambda: body(rank1))
    assert time.monotonic() - start < 5
    assert (kind0, kind1) == ("raised", "raised"), (out0, out1)
    swallowed = out0 if swallowing == 0 else out1
    assert isinstance(swallowed, DistributedError), swallowed
    assert "load_params failed on rank 1: FileNotFoundError: no checkpoint" in str(swallowed)


def test_an_error_in_a_per_batch_notification_is_named_on_the_other_rank():
    # ranks may run different numbers of batches: no barrier per batch, the
    # notification fails the section around it, which names it
    rank0, rank1 = pair(timeout=30)

    def failing():
        with rank1.session("fit"), Notification(rank1, "on_batch_end"):
            raise ValueError("boom on rank 1")

    def training():
        with rank0.session("fit"):
            with Notification(rank0, "on_batch_end"):
                pass
            rank0.barrier("on_epoch_end")

    start = time.monotonic()
    (kind0, out0), (_, out1) = run_ranks(training, failing)
    assert time.monotonic() - start < 5
    assert isinstance(out1, ValueError), out1
    assert kind0 == "raised", out0
    assert "on_batch_end failed on rank 1: ValueError: boom on rank 1" in str(out0)


def test_a_barrier_gives_every_rank_the_largest_flag_any_rank_gave():
    coordinators = warmed_up(3, 30)

    def body(coordinator, flag):
        with coordinator.session("on_epoch_begin"):
            return coordinator.barrier("on_epoch_begin", flag=flag)

    asked_by_one = run_ranks(
        *[functools.partial(body, c, c.process_index == 1) for c in coordinators]
    )
    assert asked_by_one == [("ok", 1)] * 3
    asked_by_none = run_ranks(*[functools.partial(body, c, 0) for c in coordinators])
    assert asked_by_none == [("ok", 0)] * 3


class CountingGroup:
    """A control group that counts its all-gathers."""

    def __init__(self, group):
        self.group, self.allgathers = group, 0

    def allgather(self, output_tensors, input_tensors):
        self.allgathers += 1
        return self.group.allgather(output_tensors, input_tensors)


def test_a_gather_gives_every_rank_s_object_in_one_all_gather_once_its_room_is_known():
    coordinators = warmed_up(3, 30)
    counting = [CountingGroup(c.group()) for c in coordinators]
    gathers = [ObjectGather() for _ in coordinators]

    def payload(rank, epoch):
        # rank 1's outgrows the first room: its remainder takes a second all-gather
        return {"rank": rank, "epoch": epoch, "batches": list(range(3000 if rank == 1 else 10))}

    def body(rank):
        def gather(epoch):
            before = counting[rank].allgathers
            got = gathers[rank](counting[rank], 3, "history merge", payload(rank, epoch))
            return got, counting[rank].allgathers - before

        return [gather(epoch) for epoch in range(3)]

    results = run_ranks(*[functools.partial(body, rank) for rank in range(3)])
    assert [kind for kind, _ in results] == ["ok"] * 3, results
    for _, epochs in results:
        assert [got for got, _ in epochs] == [
            [payload(rank, epoch) for rank in range(3)] for epoch in range(3)
        ]
        # the room grew to the largest payload after the first gather
        assert [collectives for _, collectives in epochs] == [2, 1, 1]


def test_a_gather_on_one_process_returns_its_object():
    assert Control(1, 0).gather("epoch row", {"a": 1}) == [{"a": 1}]


def test_a_gather_under_a_main_process_only_call_raises_at_once():
    rank0, _ = pair()
    with rank0.running_alone("a logger"), pytest.raises(DistributedError, match="a logger"):
        rank0.gather("epoch row", 1)


def test_a_child_forked_after_these_tests_collects_its_garbage_at_once():
    # last in the module, whose tests run in one process: a gloo group that
    # an earlier test left in a reference cycle would be torn down by the
    # child's collection, which then waits forever for the group's threads
    # (or aborts)
    import os

    pid = os.fork()
    if pid == 0:
        gc.collect()
        os._exit(0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the child failed collecting"
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("a forked child hung collecting what the tests of this module left")
