"""Collective sections that fail fast on every rank.

A section is a block that every rank runs, in the same order. An exception
leaving it on one rank is written into the process group's store under the
section's key; barriers poll the keys of the sections the rank is in, so
the others raise too, naming the rank and its error, instead of waiting for
the process group's timeout. An error caught inside the section (skorch's
Checkpoint swallowing a failed save) leaves the enclosing sections healthy.

Ranks agree on keys without talking: a session (a fit, or a save or load
outside of one) starts a new generation, and sections and barriers are
numbered within their parent in the order ranks reach them; a section is one
step of its parent however it ends.

A barrier's outcome is the same on every rank: each adds its arrival to a
counter and polls it (``Store.wait`` with a timeout prints a C++ warning
each time); a rank that gives up takes its arrival back and fails the
section, so a slower rank arriving afterwards raises too. Besides the
timeout, a wait ends once a rank is gone: its process ended (``liveness``:
its lifeline was reset, or its process id on this machine is no more). A rank
that lives but does not answer (paused, or busy in a call that holds the GIL)
is waited for up to the timeout, then named as unresponsive. A wait lasts as
long as a ``run`` (a save, a load) advances under ``liveness.supervised``:
the process group's timeout, which users shorten so that errors in steps
surface fast, never cuts a slow save short.

An error of the transport (gloo's "Connection reset by peer") in a section,
while a rank is gone, is raised as the ``DistributedError`` that names it, as
a barrier would: every phase reports a dead peer alike.
"""

import contextlib
import os
import time
from datetime import timedelta

import torch.distributed as dist

from accel_mixin.distributed.liveness import Lifelines, Presence, exited, supervised
from accel_mixin.errors import DistributedError, Preempted
from accel_mixin.internals import default_store

__all__ = ["Coordinator", "coordinator_for", "failure_message"]

# barrier polls: fast for a while, then doubling up to the slowest; failures,
# progress and presence are looked at less often
_POLL_FIRST, _POLL_FAST_FOR, _POLL_MAX, _LOOK_EVERY = 0.0001, 0.02, 0.002, 0.02
_PRESENCE_EVERY = 0.5
# what every rank must call alike (docs/guide/migrating.md lists the same)
COLLECTIVE = (
    "fit, partial_fit, predict, predict_proba, forward, score, save_params, "
    "load_params, save_state, load_state, wait_for_saves, wait_for_everyone"
)
_BEAT_SECONDS = 1.0
# a rank whose key stood still this many beats is called unresponsive when a
# wait times out; it is never taken for gone
_QUIET_BEATS = 3
# after an error of the transport, how long the lifelines get to say which
# rank ended: its kernel resets the lines as it resets gloo's
_TRANSPORT_GRACE = 2.0


def failure_message(what, rank, exc):
    """How the other ranks learn of ``exc``: the operation, the rank, the error."""
    return f"{what} failed on rank {rank}: {type(exc).__name__}: {exc}"


def namespace():
    """This attempt's prefix: launchers may keep one store across restarts."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"accel_mixin/{run}/{attempt}" if run else f"accel_mixin/{attempt}"


class Coordinator:
    """Fail-fast sessions, sections and barriers for one process group.

    ``timeout`` is the seconds a barrier waits for the others; without a
    ``store`` (one process) barriers return at once and failures just raise.
    """

    def __init__(self, num_processes, process_index, timeout=1800.0, store=None):
        self.num_processes = num_processes
        self.process_index = process_index
        self.timeout = timeout
        self.store = None if store is None else dist.PrefixStore(namespace(), store)
        self._generation = 0
        self._agreed = 0  # the last generation whose call the ranks compared
        self.alone = None  # what runs on this rank only (a main-only logger), if anything
        self._open = []  # the sections this rank is in: [key, children so far, what]
        self._peers = {}  # the others' presence as last seen: rank -> (value, since)
        self._last_call = None
        self.beat = min(_BEAT_SECONDS, timeout / 8)
        self._presence = self.lifelines = None
        if self.store is not None:
            with contextlib.suppress(OSError):  # no socket: process ids alone tell
                self.lifelines = Lifelines(self.store, process_index, num_processes)
            self._presence = Presence(self)
            self._presence.start()

    def announce(self):
        """Set this rank's presence key now: where it is changed."""
        with contextlib.suppress(Exception):  # the store is gone: the group is torn down
            if self._presence is not None:
                self._presence.announce(self)

    @property
    def where(self):
        """Where this rank is, for the others: in which call, or after which."""
        if self._open:
            return f"in {self._open[0][2]}"
        return f"after {self._last_call}" if self._last_call else "before any collective call"

    @property
    def distributed(self):
        return self.store is not None

    @contextlib.contextmanager
    def running_alone(self, who):
        """Within the block only this rank runs ``who``: a collective call
        there would wait for ranks that never come, so it raises at once."""
        previous, self.alone = self.alone, who
        try:
            yield
        finally:
            self.alone = previous

    def _refuse_alone(self, what):
        if self.alone is not None:
            raise DistributedError(
                f"{what} is a collective call, which every rank must make, but "
                f"{self.alone} runs on the main process only; give it "
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
        if not self._open:
            return self.session(what)
        return _Section(self, self._child("s"), what)

    def _child(self, kind):
        parent = self._open[-1]
        parent[1] += 1
        return f"{parent[0]}/{kind}{parent[1]}"

    def fail(self, what, exc):
        """Fail the current section for an error this rank caught and acts on
        later: the others stop waiting at their next barrier in it."""
        if self._open:
            self._publish(self._open[-1][0], failure_message(what, self.process_index, exc))

    def _publish(self, key, message):
        if self.distributed:
            # the first failure wins; later ones are usually its echoes
            with contextlib.suppress(Exception):  # the store is gone: the group is torn down
                self.store.compare_set(key + "/failed", "", message)

    def _raise(self, message, key=None):
        self._publish(key or self._open[-1][0], message)
        raise DistributedError(message)

    def failure(self):
        """The failure of a section this rank is in, innermost first, or None."""
        for key, *_ in reversed(self._open):
            key += "/failed"
            if self.store.check([key]):
                return self.store.get(key).decode()
        return None

    def _look(self):
        """Read the others' presence keys: rank -> ``(value, unchanged since)``."""
        now = time.monotonic()
        for rank in range(self.num_processes):
            if rank == self.process_index:
                continue
            key = f"presence/{rank}"
            value = self.store.get(key).decode() if self.store.check([key]) else None
            seen = self._peers.get(rank)
            if seen is None or seen[0] != value:
                self._peers[rank] = (value, now)
        return self._peers

    def gone(self):
        """A rank whose process ended, as ``(rank, its last call)``, or None."""
        ended = set(self.lifelines.ended()) if self.lifelines is not None else set()
        now = time.monotonic()
        for rank, (value, since) in self._look().items():
            identity = value.split("|", 1)[0].partition(" ")[2] if value else ""
            # a zombie's key stands still: only then is /proc read, which
            # would count as I/O progress of a save in this process
            zombies = now - since > 2 * self.beat
            if rank in ended or (identity and exited(identity, zombies)):
                return rank, _last_seen(value)
        return None

    def unresponsive(self):
        """The ranks whose presence key stood still for a while, as
        ``(rank, seconds, last call)``: alive as far as anyone can tell,
        but not answering (paused, or busy in a call that holds the GIL)."""
        now = time.monotonic()
        return [
            (rank, now - since, _last_seen(value))
            for rank, (value, since) in sorted(self._look().items())
            if now - since > _QUIET_BEATS * self.beat
        ]

    def lost_in_transport(self, exc, what):
        """The ``DistributedError`` naming a rank that is gone, for an error
        of the transport ``exc`` in ``what`` (gloo's, as a peer's process
        ended); None if ``exc`` is none, or no rank is gone."""
        if not self.distributed or not isinstance(exc, RuntimeError):
            return None
        if isinstance(exc, DistributedError) or not _of_transport(exc):
            return None
        deadline = time.monotonic() + _TRANSPORT_GRACE
        while True:
            with contextlib.suppress(Exception):  # the store may be gone too
                gone = self.gone()
                if gone is not None:
                    return DistributedError(self._lost_message(what, *gone))
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def barrier(self, what, patience=None):
        """Wait for every rank, or raise ``DistributedError`` as soon as one
        failed in a section this rank is in, or once nothing advanced for
        ``patience`` seconds (default: the timeout)."""
        if not self.distributed:
            return
        self._refuse_alone(what)
        if not self._open:
            with self.session(what):
                self.barrier(what, patience)
            return
        if self._agreed != self._generation:
            self._agree_on_the_call()
        key = self._child("b")
        if self.store.add(key, 1) < self.num_processes:
            self._wait(key, what, self.timeout if patience is None else patience)

    def _agree_on_the_call(self):
        """At a session's first barrier, check that every rank is in the same
        top-level call: otherwise they would wait for the timeout, or abort
        in a collective of the other call."""
        self._agreed = self._generation
        session, _, call = self._open[0]
        first = self.store.compare_set(session + "/call", "", call).decode()
        if first != call:
            self._raise(
                f"{call} on rank {self.process_index} met {first} on another rank: every "
                f"rank must make the same collective calls, in the same order ({COLLECTIVE}); "
                'a call under "if accelerator.is_main_process:" leaves the other ranks behind',
                session,
            )

    def _wait(self, key, what, patience):
        start = time.monotonic()
        deadline, look = start + patience, start + _LOOK_EVERY
        presence = start + _PRESENCE_EVERY
        pause, progress = _POLL_FIRST, None  # progress is read at the first look only
        while self.store.add(key, 0) < self.num_processes:
            time.sleep(pause)
            now = time.monotonic()
            if now > start + _POLL_FAST_FOR:
                pause = min(2 * pause, _POLL_MAX)
            if now < look:
                continue
            look = now + _LOOK_EVERY
            failure = self.failure()
            if failure is not None:
                raise DistributedError(failure)
            if now > presence:
                presence = now + _PRESENCE_EVERY
                gone = self.gone()
                # a rank that arrived and then ended (its job done) is no loss
                if gone is not None and self.store.add(key, 0) < self.num_processes:
                    self._raise(self._lost_message(what, *gone))
            # some rank's run in one of these sections advances: wait on
            advanced = sum(self.store.add(k + "/alive", 0) for k, *_ in self._open)
            if advanced != progress:
                progress, deadline = advanced, now + patience
            elif now > deadline:
                self._give_up(key, what, patience)
                return

    @staticmethod
    def _lost_message(what, rank, where):
        return (
            f"{what}: rank {rank} is gone (its process ended), last seen {where}; the "
            "other ranks cannot go on without it. Its own output says why it ended."
        )

    def _give_up(self, key, what, patience):
        """Leave a barrier that timed out, so that every rank agrees on it."""
        if self.store.add(key, -1) + 1 >= self.num_processes:
            self.store.add(key, 1)  # everyone had arrived after all: pass
            return
        quiet = "".join(
            f" Rank {rank} is unresponsive: its process lives, but has not answered "
            f"for {seconds:.0f} s (paused, or busy in a call that holds the GIL), last "
            f"seen {where}."
            for rank, seconds, where in self.unresponsive()
        )
        self._raise(
            f"{what}: rank {self.process_index} waited {patience:.0f} s for the "
            f"other ranks, which neither arrived nor reported a failure.{quiet} Every "
            f"rank must make the same collective calls ({COLLECTIVE}); the process "
            "group's timeout (InitProcessGroupKwargs) sets how long a rank is waited for"
        )

    def run(self, fn, *, what, here=True, io_timeout=None, files=None):
        """Run ``fn`` on the ranks where ``here`` is true, and agree on the outcome.

        Every rank starts once all arrived and returns once ``fn`` finished
        wherever it ran (a file the main process writes is complete). If it
        failed anywhere, every rank raises: the failing one its exception,
        the others a ``DistributedError`` naming it. ``io_timeout`` (default:
        the timeout) bounds a stall of ``fn``; ``files`` names them in its error.
        """
        io_timeout = self.timeout if io_timeout is None else io_timeout
        with self.session(what):
            self.barrier(what)
            if here and self.distributed:
                key = self._open[-1][0] + "/alive"
                result = supervised(
                    fn,
                    io_timeout=io_timeout,
                    on_progress=lambda: self.store.add(key, 1),
                    what=what if files is None else f"{what} of {files}",
                )
            else:
                result = fn() if here else None
            # the ranks that wait outlast the stalled one's own bound, so that
            # its error, which says what stalled, reaches them first
            self.barrier(what, max(self.timeout, io_timeout) + _report_grace(io_timeout))
        return result


def _last_seen(value):
    return value.split("|", 1)[-1] if value else "before any collective call"


def _of_transport(exc):
    """Whether ``exc`` is the process group's transport failing (a peer's
    connection closed or reset), which a peer's end causes."""
    if isinstance(
        exc, (getattr(dist, "DistNetworkError", ()), getattr(dist, "DistBackendError", ()))
    ):
        return True
    text = str(exc)
    return any(sign in text for sign in _TRANSPORT_SIGNS)


_TRANSPORT_SIGNS = ("Connection reset by peer", "Connection closed by peer", "gloo", "Broken pipe")


def _report_grace(io_timeout):
    return min(max(5.0, io_timeout / 4), 60.0)


class _Section:
    """The context of a section: entered on every batch, so a plain class."""

    __slots__ = ("coordinator", "key", "what")

    def __init__(self, coordinator, key, what):
        self.coordinator, self.key, self.what = coordinator, key, what

    # pylint: disable=protected-access
    def __enter__(self):
        coordinator = self.coordinator
        if not coordinator._open:
            coordinator._last_call = self.what
        coordinator._open.append([self.key, 0, self.what])
        if len(coordinator._open) == 1:
            coordinator.announce()
        return self

    def __exit__(self, exc_type, exc, traceback):
        coordinator = self.coordinator
        coordinator._open.pop()
        if not coordinator._open:
            coordinator.announce()
        # a stop every rank takes is no failure
        if exc_type is None or issubclass(exc_type, (KeyboardInterrupt, GeneratorExit, Preempted)):
            return False
        lost = coordinator.lost_in_transport(exc, self.what)
        if lost is not None:
            coordinator._publish(self.key, str(lost))
            raise lost from exc
        # another rank's failure learned in an inner section is passed on as
        # it is, for ranks that left the inner section otherwise
        if issubclass(exc_type, DistributedError):
            message = str(exc)
        else:
            message = failure_message(self.what, coordinator.process_index, exc)
        coordinator._publish(self.key, message)
        return False


_COORDINATORS = {}


def coordinator_for(accelerator):
    """The process's coordinator for the accelerator's process group, shared by
    every net: ranks number sections in the order they reach them."""
    # without the store, barriers could not wait: fail loudly instead
    store = default_store() if accelerator.num_processes > 1 else None
    key = (accelerator.num_processes, accelerator.process_index, id(store))
    if key not in _COORDINATORS:
        handler = getattr(accelerator, "init_handler", None)
        timeout = getattr(handler, "timeout", None) or timedelta(minutes=30)
        _COORDINATORS.clear()  # an older process group is gone
        _COORDINATORS[key] = Coordinator(
            accelerator.num_processes, accelerator.process_index, timeout.total_seconds(), store
        )
    return _COORDINATORS[key]
