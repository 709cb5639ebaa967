"""Collective sections that fail fast on every rank.

A section is a block that every rank runs, in the same order. When an
exception leaves a section on one rank, that rank writes it into the process
group's key-value store under the section's key before it propagates. Every
barrier polls the keys of the sections the waiting rank is in, so the other
ranks raise too, within milliseconds, naming the rank and its error, instead
of waiting in a collective until the process group times out. An error that
something inside the section catches, such as skorch's Checkpoint swallowing
a failed save, leaves the enclosing sections healthy.

Ranks agree on keys without talking: a session (a fit, or a save or load
outside of one) starts a new generation, and sections and barriers are
numbered within their enclosing section, in the order ranks reach them. A
section counts as one step of its parent however it ends, so ranks that left
a section at different points, one by an error that was caught, are in step
again after it.

A barrier's outcome is the same on every rank. Each rank adds its arrival
to the barrier's counter, and the ranks that arrived early poll the counter
until it is full: every 0.1 ms for the first 20 ms (a small save ends within
them; a round trip to the store costs tens of microseconds), then at
intervals doubling up to 2 ms, so that a long wait costs little CPU. The
last rank to arrive thus makes one round trip only.
torch's ``Store.wait`` with a timeout would wake them sooner, but every
timeout of it prints a warning from C++. A rank that gives up waiting first
takes its arrival back, then reports the timeout as a failure of its
section, so a slower rank that arrives afterwards raises too instead of
going on alone; if everyone arrived meanwhile, the barrier is passed after
all.

Two things bound a wait besides the timeout:

- Presence. Every rank's coordinator keeps a key of its own fresh (a
  thread sets it every second, with the process's host, id and current
  call). A waiting rank looks at the others' keys: a rank whose process is
  gone from this machine, or whose key has not changed for
  ``DEAD_AFTER_BEATS`` beats (another machine's process that died, or left),
  is gone, and every waiting rank raises, naming it and its last call,
  within seconds rather than after the process group's timeout.
- Progress. ``run`` executes its function (a save, a load) in a worker
  thread under ``progress.supervised``: while it reads, writes or computes,
  the ranks waiting for it see its progress and wait on, however long that
  takes; once it made no progress for the I/O timeout (a hung filesystem),
  it fails, and with it every rank. The process group's timeout, which
  users shorten so that errors inside training steps surface fast, thus
  never cuts a slow save short, and a stuck one never keeps the job
  waiting forever.
"""

import atexit
import contextlib
import gc
import itertools
import os
import socket
import threading
import time
import weakref
from datetime import timedelta

import torch.distributed as dist

from accel_mixin.distributed.progress import supervised
from accel_mixin.errors import DistributedError, Preempted
from accel_mixin.internals import default_store

__all__ = ["Coordinator", "coordinator_for", "failure_message"]

# polls of a barrier's counter: fast for a while, then slower, so that a long
# wait costs little CPU; failures, heartbeats and the deadline are looked at
# less often
_POLL_FIRST, _POLL_FAST_FOR, _POLL_MAX, _LOOK_EVERY = 0.0001, 0.02, 0.002, 0.02
# what every rank must call alike (docs/guide/migrating.md lists the same)
COLLECTIVE = (
    "fit, partial_fit, predict, predict_proba, forward, score, save_params, "
    "load_params, save_state, load_state, wait_for_saves, wait_for_everyone"
)

# a rank's presence key is set every beat; one that has not changed for this
# many beats belongs to a rank that is gone
_BEAT_SECONDS = 1.0
DEAD_AFTER_BEATS = 15
# how often a waiting rank looks at the others' presence
_PRESENCE_EVERY = 0.5
_HOST = socket.gethostname()


def namespace():
    """The prefix of this attempt's keys in the process group's store.

    Launchers may keep one store across the restarts of a job (torchrun's
    static rendezvous of ``--master_addr``/``--master_port``, and c10d's):
    the keys of every attempt are then apart, so that no barrier counter or
    failure of a dead attempt is ever read by the next, whose counters start
    from 1 again.
    """
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"accel_mixin/{run}/{attempt}" if run else f"accel_mixin/{attempt}"


def failure_message(what, rank, exc):
    """How the other ranks learn of ``exc``: the operation, the rank, the error."""
    return f"{what} failed on rank {rank}: {type(exc).__name__}: {exc}"


class Coordinator:
    """Fail-fast sessions, sections and barriers for one process group.

    Parameters
    ----------
    num_processes, process_index : int
      The layout, as the accelerator sees it.

    timeout : float (default=1800)
      Seconds a barrier waits for the other ranks before it gives up.

    store : torch.distributed.Store or None (default=None)
      Where ranks leave arrivals and failures. Without one (a single
      process), barriers return at once and failures just raise.

    """

    def __init__(self, num_processes, process_index, timeout=1800.0, store=None):
        self.num_processes = num_processes
        self.process_index = process_index
        self.timeout = timeout
        self.store = None if store is None else dist.PrefixStore(namespace(), store)
        self._generation = 0
        self._alone = None  # what runs on this rank only, if anything
        self._agreed = 0  # the last generation whose call the ranks compared
        # the sections this rank is in, outermost first: [key, children so far, what]
        self._open = []
        # the others' presence as last seen: rank -> (value, when it changed)
        self._peers = {}
        self._last_call = None  # the last top-level call this rank entered
        self.beat = min(_BEAT_SECONDS, timeout / 8)
        # a presence key unchanged this long belongs to a rank that is gone
        self.dead_after = DEAD_AFTER_BEATS * self.beat
        self._presence = None
        if self.store is not None:
            self._presence = _Presence(self)
            self._presence.start()

    def announce(self):
        """Set this rank's presence key now: where it is changed."""
        if self._presence is not None:
            try:
                self._presence.announce(self)
            except Exception:  # pylint: disable=broad-except
                pass  # the store is gone: the beats stop, as the group is torn down

    @property
    def where(self):
        """Where this rank is, for the others: in which call, or after which."""
        if self._open:
            return f"in {self._open[0][2]}"
        return f"after {self._last_call}" if self._last_call else "before any collective call"

    @property
    def distributed(self):
        return self.store is not None

    @property
    def alone(self):
        """What this rank runs without the others, or None."""
        return self._alone

    @contextlib.contextmanager
    def running_alone(self, who):
        """Within the block this rank runs ``who`` and the others do not (a
        logger on the main process): a collective call there would wait for
        ranks that never come, so it raises at once instead."""
        previous, self._alone = self._alone, who
        try:
            yield
        finally:
            self._alone = previous

    def _refuse_alone(self, what):
        if self._alone is not None:
            raise DistributedError(
                f"{what} is a collective call, which every rank must make, but "
                f"{self._alone} runs on the main process only; give it "
                "main_process_only=False to run it on every rank"
            )

    def session(self, what):
        """A top-level section; a new generation of keys unless nested."""
        self._refuse_alone(what)
        if self._open:
            return self.section(what)
        self._generation += 1
        return _Section(self, f"g{self._generation}", what)

    def section(self, what):
        """Run a block on every rank; an error leaving it reaches every rank."""
        if not self._open:  # outside any session: a session of its own
            return self.session(what)
        return _Section(self, self._child("s"), what)

    def _child(self, kind):
        parent = self._open[-1]
        parent[1] += 1
        return f"{parent[0]}/{kind}{parent[1]}"

    def fail(self, what, exc):
        """Tell the other ranks that this one failed in the current section.

        For an error this rank catches but will act on later: the others
        stop waiting at their next barrier in this section.
        """
        if self._open:
            self._publish(self._open[-1][0], failure_message(what, self.process_index, exc))

    def _publish(self, key, message):
        if not self.distributed:
            return
        try:
            # the first failure wins; later ones are usually its echoes
            self.store.compare_set(key + "/failed", "", message)
        except Exception:  # pylint: disable=broad-except
            pass  # the store is gone: the launcher is tearing the group down

    def failure(self):
        """The failure of a section this rank is in, innermost first, or None."""
        for key, *_ in reversed(self._open):
            key += "/failed"
            if self.store.check([key]):
                return self.store.get(key).decode()
        return None

    def _progress(self):
        """The progress of the sections this rank is in: it grows while
        some rank's ``run`` advances in one of them."""
        return sum(self.store.add(key + "/alive", 0) for key, *_ in self._open)

    def gone(self):
        """A rank that is gone, as ``(rank, its last call)``, or None."""
        now = time.monotonic()
        for rank in range(self.num_processes):
            if rank == self.process_index:
                continue
            key = f"presence/{rank}"
            value = self.store.get(key).decode() if self.store.check([key]) else None
            seen = self._peers.get(rank)
            if seen is None or seen[0] != value:
                self._peers[rank] = (value, now)
                if value is None or not _exited(value):
                    continue
            elif now - seen[1] <= self.dead_after and not (value is not None and _exited(value)):
                continue
            return rank, (value.split("|", 1)[1] if value else "") or "before any collective call"
        return None

    def barrier(self, what):
        """Wait for every rank, or raise as soon as one failed.

        Raises
        ------
        DistributedError
          If a rank failed in a section this rank is in, or the others did
          not arrive within the timeout.

        """
        if not self.distributed:
            return
        self._refuse_alone(what)
        if not self._open:
            with self.session(what):
                self.barrier(what)
            return
        if self._agreed != self._generation:
            self._agree_on_the_call()
        key = self._child("b")
        if self.store.add(key, 1) < self.num_processes:
            self._wait(key, what)

    def _agree_on_the_call(self):
        """At the first barrier of a session, check that every rank is in the
        same top-level call: a rank in ``predict`` while another is in
        ``save_params`` would otherwise wait for the timeout, or abort in a
        collective of the other call."""
        self._agreed = self._generation
        session, _, call = self._open[0]
        first = self.store.compare_set(session + "/call", "", call).decode()
        if first != call:
            message = (
                f"{call} on rank {self.process_index} met {first} on another rank: every "
                f"rank must make the same collective calls, in the same order ({COLLECTIVE}); "
                'a call under "if accelerator.is_main_process:" leaves the other ranks behind'
            )
            self._publish(session, message)
            raise DistributedError(message)

    def _wait(self, key, what):
        deadline = time.monotonic() + self.timeout
        progress = None  # read at the first look: a short wait never pays for it
        pause, look = _POLL_FIRST, time.monotonic() + _LOOK_EVERY
        slow_down = time.monotonic() + _POLL_FAST_FOR
        presence = time.monotonic() + _PRESENCE_EVERY
        while self.store.add(key, 0) < self.num_processes:
            time.sleep(pause)
            if time.monotonic() > slow_down:
                pause = min(2 * pause, _POLL_MAX)
            if time.monotonic() < look:
                continue
            look = time.monotonic() + _LOOK_EVERY
            failure = self.failure()
            if failure is not None:
                raise DistributedError(failure)
            if time.monotonic() > presence:
                presence = time.monotonic() + _PRESENCE_EVERY
                gone = self.gone()
                if gone is not None:
                    self._lost(what, *gone)
            now = self._progress()
            if now != progress:  # a rank's run advances: wait on
                progress, deadline = now, time.monotonic() + self.timeout
            elif time.monotonic() > deadline:
                self._give_up(key, what)
                return

    def _lost(self, what, rank, where):
        """Fail the section: ``rank`` is gone."""
        message = (
            f"{what}: rank {rank} is gone (its process ended, or stopped answering for "
            f"{self.dead_after:.0f} s), last seen {where}; the other ranks cannot "
            "go on without it. Its own output says why it ended."
        )
        if self._open:
            self._publish(self._open[-1][0], message)
        raise DistributedError(message)

    def _give_up(self, key, what):
        """Leave a barrier that timed out, so that every rank agrees on it."""
        if self.store.add(key, -1) + 1 >= self.num_processes:
            # everyone had arrived after all: put the arrival back, pass
            self.store.add(key, 1)
            return
        message = (
            f"{what}: rank {self.process_index} waited {self.timeout:.0f} s for the "
            "other ranks, which neither arrived nor reported a failure. Every rank must "
            f"make the same collective calls ({COLLECTIVE})"
        )
        self._publish(self._open[-1][0], message)
        raise DistributedError(message)

    def run(self, fn, *, what, here=True, io_timeout=None, files=None):
        """Run ``fn`` on the ranks where ``here`` is true, and agree on the outcome.

        Every rank starts once all have arrived, and returns only once ``fn``
        finished wherever it ran, so a file written by the main process is
        complete when any rank returns.
        If ``fn`` failed anywhere, every rank raises: the failing one its own
        exception, the others a :class:`DistributedError` naming it.

        Parameters
        ----------
        io_timeout : float or None (default=None)
          Seconds ``fn`` may go without progress (``progress.supervised``)
          before it fails; None: the coordinator's timeout.

        files : str or None (default=None)
          The files ``fn`` reads or writes, for the error if it stalls.

        """
        with self.session(what):
            self.barrier(what)
            if here and self.distributed:
                key = self._open[-1][0] + "/alive"
                result = supervised(
                    fn,
                    io_timeout=self.timeout if io_timeout is None else io_timeout,
                    on_progress=lambda: self.store.add(key, 1),
                    what=what if files is None else f"{what} of {files}",
                )
            else:
                result = fn() if here else None
            self.barrier(what)
        return result


def _exited(value):
    """Whether the presence ``value`` is of a process of this machine that
    has ended."""
    beat_host_pid = value.split("|", 1)[0].split(" ")
    if len(beat_host_pid) != 3 or beat_host_pid[1] != _HOST or not beat_host_pid[2].isdigit():
        return False
    try:
        os.kill(int(beat_host_pid[2]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


_PRESENCES = weakref.WeakSet()


def _stop_at_exit():
    """Stop and join the presence threads while the interpreter still runs.

    A daemon thread that returns from a store call once Python has begun to
    finalize is ended by CPython with ``pthread_exit`` as it takes the GIL
    back; the forced unwind meets pybind11's ``noexcept`` GIL guard, and
    ``std::terminate`` aborts the process after all its work is done
    ("terminate called without an active exception", exit code -6). Atexit
    handlers run before finalization, so a thread joined here is in no call
    then. A call on a live store takes microseconds; the join is bounded
    for a store whose server is gone.
    """
    for presence in list(_PRESENCES):
        presence.stopped.set()
    for presence in list(_PRESENCES):
        presence.join(timeout=2)
    # The nets' DDP wrappers die in reference cycles, and with them the last
    # references to the process group; freed by finalization's collection,
    # the group's teardown aborted a process at exit (1 in 13 launches of a
    # grid search under load). Collected here, the interpreter is whole.
    gc.collect()


class _Presence(threading.Thread):
    """Sets the coordinator's presence key every beat, with the process's
    host, id and where the rank is; ends with the coordinator or the store."""

    def __init__(self, coordinator):
        super().__init__(daemon=True, name="accel_mixin-presence")
        # weakly: the thread ends once the coordinator is gone
        self.coordinator = weakref.ref(coordinator)
        self.key = f"presence/{coordinator.process_index}"
        self.store = coordinator.store
        self.beat = coordinator.beat
        self.count = itertools.count(1)
        self.stopped = threading.Event()
        _PRESENCES.add(self)

    def announce(self, coordinator):
        value = f"{next(self.count)} {_HOST} {os.getpid()}|{coordinator.where}"
        self.store.set(self.key, value)

    def run(self):
        while True:
            coordinator = self.coordinator()
            if coordinator is None:
                return
            try:
                self.announce(coordinator)
            except Exception:  # pylint: disable=broad-except
                return  # the store is gone: the group is being torn down
            del coordinator
            if self.stopped.wait(self.beat):
                return


class _Section:
    """The context of a section: entered on every batch, so a plain class."""

    __slots__ = ("coordinator", "key", "what")

    def __init__(self, coordinator, key, what):
        self.coordinator = coordinator
        self.key = key
        self.what = what

    def __enter__(self):
        coordinator = self.coordinator
        outermost = not coordinator._open  # pylint: disable=protected-access
        if outermost:
            coordinator._last_call = self.what  # pylint: disable=protected-access
        coordinator._open.append([self.key, 0, self.what])  # pylint: disable=protected-access
        if outermost:
            coordinator.announce()
        return self

    def __exit__(self, exc_type, exc, traceback):
        coordinator = self.coordinator
        coordinator._open.pop()  # pylint: disable=protected-access
        if not coordinator._open:  # pylint: disable=protected-access
            coordinator.announce()
        # a stop every rank takes is no failure
        if exc_type is None or issubclass(exc_type, (KeyboardInterrupt, GeneratorExit, Preempted)):
            return False
        if issubclass(exc_type, DistributedError):
            # another rank's failure, learned in an inner section: passed on
            # as it is, for ranks that left the inner section otherwise (a
            # callback that swallowed the error there) and now wait out here
            message = str(exc)
        else:
            message = failure_message(self.what, coordinator.process_index, exc)
        coordinator._publish(self.key, message)  # pylint: disable=protected-access
        return False


_COORDINATORS = {}
_EXIT_HOOK = []


def coordinator_for(accelerator):
    """The process's coordinator for the accelerator's process group.

    One per process group, shared by every net: ranks number sections in the
    order they reach them, whichever net reaches them.

    """
    # without the store, barriers could not wait: fail loudly instead
    store = default_store() if accelerator.num_processes > 1 else None
    key = (accelerator.num_processes, accelerator.process_index, id(store))
    if key not in _COORDINATORS:
        if not _EXIT_HOOK:
            _EXIT_HOOK.append(atexit.register(_stop_at_exit))
        handler = getattr(accelerator, "init_handler", None)
        timeout = getattr(handler, "timeout", None) or timedelta(minutes=30)
        _COORDINATORS.clear()  # an older process group is gone
        _COORDINATORS[key] = Coordinator(
            accelerator.num_processes,
            accelerator.process_index,
            timeout=timeout.total_seconds(),
            store=store,
        )
    return _COORDINATORS[key]
