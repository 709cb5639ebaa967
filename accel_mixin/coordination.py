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
"""
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ['Coordinator', 'DistributedError', 'coordinator_for', 'failure_message']

# polls start fast and slow down: a long wait (a big save) costs little CPU
_POLL_FIRST, _POLL_MAX = 0.0005, 0.02


class DistributedError(RuntimeError):
    """Raised on every rank when a collective section failed on another rank."""


def failure_message(what, rank, exc):
    """How the other ranks learn of ``exc``: the operation, the rank, the error."""
    return f'{what} failed on rank {rank}: {type(exc).__name__}: {exc}'


def _default_store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


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
        self.store = None if store is None else dist.PrefixStore('accel_mixin', store)
        self._generation = 0
        # the sections this rank is in, outermost first: [key, children so far]
        self._open = []

    @property
    def distributed(self):
        return self.store is not None

    def session(self, what):
        """A top-level section; a new generation of keys unless nested."""
        if self._open:
            return self.section(what)
        self._generation += 1
        return _Section(self, f'g{self._generation}', what)

    def section(self, what):
        """Run a block on every rank; an error leaving it reaches every rank."""
        if not self._open:  # outside any session: a session of its own
            return self.session(what)
        return _Section(self, self._child('s'), what)

    def _child(self, kind):
        parent = self._open[-1]
        parent[1] += 1
        return f'{parent[0]}/{kind}{parent[1]}'

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
            self.store.compare_set(key + '/failed', '', message)
        except Exception:  # pylint: disable=broad-except
            pass  # the store is gone: the launcher is tearing the group down

    def failure(self):
        """The failure of a section this rank is in, innermost first, or None."""
        for key, _ in reversed(self._open):
            key += '/failed'
            if self.store.check([key]):
                return self.store.get(key).decode()
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
        if not self._open:
            with self.session(what):
                self.barrier(what)
            return
        key = self._child('b')
        self.store.add(key, 1)
        deadline = time.monotonic() + self.timeout
        pause = _POLL_FIRST
        while True:
            # arrivals first: once all arrived the barrier is passed, even if
            # a faster rank has failed since, after it
            if self.store.add(key, 0) >= self.num_processes:
                return
            failure = self.failure()
            if failure is not None:
                raise DistributedError(failure)
            if time.monotonic() > deadline:
                raise DistributedError(
                    f'{what}: rank {self.process_index} waited {self.timeout:.0f} s for '
                    'the other ranks, which neither arrived nor reported a failure')
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX)

    def run(self, fn, *, what, here=True):
        """Run ``fn`` on the ranks where ``here`` is true, and agree on the outcome.

        Every rank starts once all have arrived, and returns only once ``fn``
        finished wherever it ran, so a file written by the main process is
        complete when any rank returns.
        If ``fn`` failed anywhere, every rank raises: the failing one its own
        exception, the others a :class:`DistributedError` naming it.

        """
        with self.session(what):
            self.barrier(what)
            result = fn() if here else None
            self.barrier(what)
        return result


class _Section:
    """The context of a section: entered on every batch, so a plain class."""
    __slots__ = ('coordinator', 'key', 'what')

    def __init__(self, coordinator, key, what):
        self.coordinator = coordinator
        self.key = key
        self.what = what

    def __enter__(self):
        self.coordinator._open.append([self.key, 0])  # pylint: disable=protected-access
        return self

    def __exit__(self, exc_type, exc, traceback):
        coordinator = self.coordinator
        coordinator._open.pop()  # pylint: disable=protected-access
        # a stop every rank takes, or the echo of another rank's error, is
        # not this rank's failure
        if exc_type is not None and not issubclass(
                exc_type, (KeyboardInterrupt, DistributedError, GeneratorExit)):
            coordinator._publish(  # pylint: disable=protected-access
                self.key, failure_message(self.what, coordinator.process_index, exc))
        return False


_COORDINATORS = {}


def coordinator_for(accelerator):
    """The process's coordinator for the accelerator's process group.

    One per process group, shared by every net: ranks number sections in the
    order they reach them, whichever net reaches them.

    """
    store = _default_store() if accelerator.num_processes > 1 else None
    key = (accelerator.num_processes, accelerator.process_index, id(store))
    if key not in _COORDINATORS:
        handler = getattr(accelerator, 'init_handler', None)
        timeout = getattr(handler, 'timeout', None) or timedelta(minutes=30)
        _COORDINATORS.clear()  # an older process group is gone
        _COORDINATORS[key] = Coordinator(
            accelerator.num_processes, accelerator.process_index,
            timeout=timeout.total_seconds(), store=store)
    return _COORDINATORS[key]
