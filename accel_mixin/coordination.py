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
takes its arrival back, then
reports the timeout as a failure of its section, so a slower rank that
arrives afterwards raises too instead of going on alone; if everyone arrived
meanwhile, the barrier is passed after all. The timeout counts time without
progress only: while ``run`` executes its function on some rank (a large
save), that rank shows a heartbeat, and the others keep waiting as long as it
beats. The process group's timeout, which users shorten so that errors inside
training steps surface fast, thus never cuts a slow save short.
"""

import contextlib
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from accel_mixin.internals import default_store

__all__ = ["Coordinator", "DistributedError", "Preempted", "coordinator_for", "failure_message"]

# polls of a barrier's counter: fast for a while, then slower, so that a long
# wait costs little CPU; failures, heartbeats and the deadline are looked at
# less often
_POLL_FIRST, _POLL_FAST_FOR, _POLL_MAX, _LOOK_EVERY = 0.0001, 0.02, 0.002, 0.02
# what every rank must call alike (docs/guide/migrating.md lists the same)
COLLECTIVE = (
    "fit, partial_fit, predict, predict_proba, forward, score, save_params, "
    "load_params, save_state, load_state, wait_for_saves, wait_for_everyone"
)

# how often a rank running a long function beats
_HEARTBEAT_SECONDS = 1.0


class DistributedError(RuntimeError):
    """Raised on every rank when a collective section failed on another rank."""


class Preempted(Exception):
    """Training stopped on a preemption notice, after a state was saved.

    Every rank stops at the same batch and saves a training state there.
    It ends ``fit`` with an error, so that a script that does not catch it
    exits non-zero and the scheduler requeues the job; the next run resumes
    from the saved state (``ResumeTraining``). Every rank raises it: it is no
    failure of one rank. The net is left as training stopped (still wrapped,
    its history ending with the unfinished epoch's row): run the script
    again rather than training on in the same process.
    """


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
        self.store = None if store is None else dist.PrefixStore("accel_mixin", store)
        self._generation = 0
        self._alone = None  # what runs on this rank only, if anything
        self._agreed = 0  # the last generation whose call the ranks compared
        # the sections this rank is in, outermost first: [key, children so far, what]
        self._open = []
        if self.store is not None:
            self._heartbeat = _Heartbeat(self.store, min(_HEARTBEAT_SECONDS, timeout / 4))

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

    def _heartbeats(self):
        """The beats of the sections this rank is in: they grow while some
        rank works in one of them."""
        return sum(self.store.add(key + "/alive", 0) for key, *_ in self._open)

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
        self._arrive(what)()

    def _arrive(self, what):
        """Arrive at the next barrier; return the wait for the others.

        The wait may be called more than once: it waits the first time only.
        """
        if self._agreed != self._generation:
            self._agree_on_the_call()
        key = self._child("b")
        if self.store.add(key, 1) >= self.num_processes:
            return _passed
        waited = []

        def wait():
            if not waited:
                self._wait(key, what)
                waited.append(True)

        return wait

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
        beats = None  # read at the first look: a short wait never pays for it
        pause, look = _POLL_FIRST, time.monotonic() + _LOOK_EVERY
        slow_down = time.monotonic() + _POLL_FAST_FOR
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
            now = self._heartbeats()
            if now != beats:  # a rank is still working: wait on
                beats, deadline = now, time.monotonic() + self.timeout
            elif time.monotonic() > deadline:
                self._give_up(key, what)
                return

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

    def run(self, fn, *, what, here=True, gate=None):
        """Run ``fn`` on the ranks where ``here`` is true, and agree on the outcome.

        Every rank starts once all have arrived, and returns only once ``fn``
        finished wherever it ran, so a file written by the main process is
        complete when any rank returns.
        If ``fn`` failed anywhere, every rank raises: the failing one its own
        exception, the others a :class:`DistributedError` naming it.

        Parameters
        ----------
        gate : callable or None (default=None)
          For a ``fn`` whose effects become visible at one point, such as a
          write that ends with a rename: ``gate(wait)`` gives a context in
          which ``fn`` calls ``wait()`` just before that point. ``fn`` then
          starts on arrival and does its work while the other ranks arrive;
          nothing becomes visible before all have.

        """
        with self.session(what):
            early = gate is not None and here and self.distributed
            if early:
                arrived = self._arrive(what)
            else:
                self.barrier(what)
            if here and self.distributed:
                with self._heartbeat.beating(self._open[-1][0] + "/alive"):
                    if early:
                        # no heartbeat while waiting at the gate: this rank
                        # would see its own beats and wait forever
                        with gate(self._heartbeat.paused(arrived)):
                            result = fn()
                    else:
                        result = fn()
            else:
                result = fn() if here else None
            if early:
                arrived()  # a fn that never reached the gate
            self.barrier(what)
        return result


def _passed():
    pass


class _Heartbeat:
    """Beats under a key while a block runs, so that ranks waiting for this
    one know it is working rather than gone.

    One thread per coordinator, started on first use and idle between
    blocks: starting a thread for every save would cost more than a small
    save's barriers.
    """

    def __init__(self, store, interval):
        self.store = store
        self.interval = interval
        self.key = None
        self.working = threading.Event()
        self.thread = None

    def _beat(self):
        while True:
            self.working.wait()  # a block runs
            time.sleep(self.interval)
            key = self.key
            if self.working.is_set() and key is not None:
                try:
                    self.store.add(key, 1)
                except Exception:  # pylint: disable=broad-except
                    return  # the store is gone: the group is being torn down

    def paused(self, wait):
        """``wait``, wrapped to run without beats."""

        def paused_wait():
            self.working.clear()
            try:
                wait()
            finally:
                self.working.set()

        return paused_wait

    @contextlib.contextmanager
    def beating(self, key):
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._beat, daemon=True, name="accel_mixin-heartbeat"
            )
            self.thread.start()
        self.key = key
        self.working.set()
        try:
            yield
        finally:
            self.working.clear()
            self.key = None


class _Section:
    """The context of a section: entered on every batch, so a plain class."""

    __slots__ = ("coordinator", "key", "what")

    def __init__(self, coordinator, key, what):
        self.coordinator = coordinator
        self.key = key
        self.what = what

    def __enter__(self):
        self.coordinator._open.append([self.key, 0, self.what])  # pylint: disable=protected-access
        return self

    def __exit__(self, exc_type, exc, traceback):
        coordinator = self.coordinator
        coordinator._open.pop()  # pylint: disable=protected-access
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


def coordinator_for(accelerator):
    """The process's coordinator for the accelerator's process group.

    One per process group, shared by every net: ranks number sections in the
    order they reach them, whichever net reaches them.

    """
    # without the store, barriers could not wait: fail loudly instead
    store = default_store() if accelerator.num_processes > 1 else None
    key = (accelerator.num_processes, accelerator.process_index, id(store))
    if key not in _COORDINATORS:
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
