"""A watchdog on a file operation: it must advance, or every rank stops.

``Watchdog.run`` runs a save or a load on a worker thread and watches it
advance: the process reads or writes (``/proc/self/io``), or the worker
computes (copying a memory-mapped file reads nothing through system calls).
After ``io_timeout`` seconds without, ``Stalled`` is raised, and a worker
stuck in a system call nothing can interrupt (a hung NFS mount) is left
behind. Without ``/proc``, a live worker counts as progress. No engine
bounds a write this way: a collective's timeout bounds waiting ranks only.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

from accel_mixin.errors import Stalled

__all__ = ["Job", "Watchdog"]

T = TypeVar("T")

# how often the calling thread samples the worker's progress, more seldom as
# it goes on; a finished operation wakes it at once
_LOOK_FIRST, _LOOK_MAX = 0.01, 0.25


class _Sampler:
    """Samples the process's reads and writes and the worker's CPU time; its
    own reads of ``/proc`` are no progress, so they are taken off."""

    def __init__(self, native_id: int | None) -> None:
        self.stat = f"/proc/self/task/{native_id}/stat"
        self.own = 0  # bytes this sampler read since the last sample
        self.last: tuple[int, int] | None = None

    def _read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            data = f.read()
        self.own += len(data)
        return data

    def advanced(self) -> bool:
        """Whether the work advanced since the last call (True if unknown)."""
        # this sample's own reads show in the next one
        own_before, self.own = self.own, 0
        try:
            io = dict(line.split(b":", 1) for line in self._read("/proc/self/io").splitlines())
            # after the command name in parentheses, utime and stime are the 12th and 13th
            fields = self._read(self.stat).rsplit(b")", 1)[1].split()
            now = int(io[b"rchar"]) + int(io[b"wchar"]), int(fields[11]) + int(fields[12])
        except (OSError, KeyError, IndexError, ValueError):
            return True
        last, self.last = self.last, now
        return last is None or now[0] - last[0] > own_before or now[1] != last[1]


class Watchdog:
    """Runs file operations one at a time on a worker thread of its own, and
    watches each advance. The thread is kept between operations: starting
    one per ``save_params`` cost more than a small model's write. A worker
    left behind in a stalled operation ends after it."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] | None = None
        self._worker: threading.Thread | None = None

    def _start(self) -> tuple[queue.SimpleQueue[Callable[[], None] | None], threading.Thread]:
        jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()

        def serve() -> None:
            for job in iter(jobs.get, None):
                job()
                del job  # waiting for the next, hold nothing of this one (its net)

        worker = threading.Thread(target=serve, daemon=True, name="accel_mixin-io")
        worker.start()  # returns once the thread runs, its native_id set
        self._jobs, self._worker = jobs, worker
        return jobs, worker

    def run(self, fn: Callable[[], T], *, io_timeout: float, what: str) -> T:
        """Return or raise what ``fn()`` does on the worker; ``Stalled``
        naming ``what`` after ``io_timeout`` seconds without progress."""
        return self.start(fn).result(io_timeout=io_timeout, what=what)

    def start(self, fn: Callable[[], T]) -> Job[T]:
        """Start ``fn()`` on the worker; the caller goes on, and collects the
        outcome with the job's ``result``."""
        jobs, worker = self._jobs, self._worker
        if jobs is None or worker is None or not worker.is_alive():  # a forked child's copy
            jobs, worker = self._start()
        job = Job(self, fn, worker.native_id)
        jobs.put(job)
        return job

    def _abandon(self) -> None:
        """Let the worker end once its stalled call returns; the next job gets another."""
        if self._jobs is not None:
            self._jobs.put(None)
        self._jobs = self._worker = None


class Job(Generic[T]):
    """A file operation on the watchdog's worker."""

    def __init__(self, watchdog: Watchdog, fn: Callable[[], T], native_id: int | None) -> None:
        self._watchdog, self._fn = watchdog, fn
        self._outcome: dict[str, Any] = {}
        self._done = threading.Event()
        self._sampler = _Sampler(native_id)

    def __call__(self) -> None:
        try:
            self._outcome["value"] = self._fn()
        except BaseException as exc:  # pylint: disable=broad-except
            self._outcome["error"] = exc
        self._done.set()

    def result(self, *, io_timeout: float, what: str) -> T:
        """Wait for the job: return or raise what ``fn()`` did; ``Stalled``
        naming ``what`` after ``io_timeout`` seconds without progress."""
        # the first sample at the first look: a write shorter than that reads nothing
        last_progress = time.monotonic()
        look = _LOOK_FIRST
        while not self._done.wait(look):
            look = min(2 * look, _LOOK_MAX)
            if self._sampler.advanced():
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > io_timeout:
                self._watchdog._abandon()  # pylint: disable=protected-access
                raise Stalled(
                    f"{what} made no progress for {io_timeout:.0f} s: nothing was read or "
                    "written (a hung or very slow filesystem?). It is left running in the "
                    "background; every rank stops here. io_timeout sets this limit."
                )
        if "error" in self._outcome:
            raise self._outcome["error"]
        # set whenever fn returned
        return cast(T, self._outcome.get("value"))
