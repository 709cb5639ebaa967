"""A watchdog on a file operation: it must advance, or every rank stops.

``supervised`` runs a save or a load in a worker thread and watches it
advance: the process reads or writes (``/proc/self/io``), or the worker
computes (copying a memory-mapped file reads nothing through system calls).
After ``io_timeout`` seconds without, ``Stalled`` is raised, and a worker
stuck in a system call nothing can interrupt (a hung NFS mount) is left
behind. Without ``/proc``, a live worker counts as progress. No engine
bounds a write this way: a collective's timeout bounds waiting ranks only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from accel_mixin.errors import Stalled

__all__ = ["supervised"]

T = TypeVar("T")

# how often the calling thread looks at the worker: soon for small saves, then less often
_LOOK_FIRST, _LOOK_MAX = 0.001, 0.25


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


def supervised(fn: Callable[[], T], *, io_timeout: float, what: str) -> T:
    """Return or raise what ``fn()`` does in a worker thread; ``Stalled``
    naming ``what`` after ``io_timeout`` seconds without progress."""
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # pylint: disable=broad-except
            outcome["error"] = exc

    worker = threading.Thread(target=work, daemon=True, name="accel_mixin-io")
    worker.start()  # returns once the thread runs, its native_id set
    # the first sample at the first look: a write shorter than that reads nothing
    sampler = _Sampler(worker.native_id)
    last_progress = time.monotonic()
    look = _LOOK_FIRST
    while True:
        worker.join(look)
        if not worker.is_alive():
            break
        look = min(2 * look, _LOOK_MAX)
        if sampler.advanced():
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > io_timeout:
            raise Stalled(
                f"{what} made no progress for {io_timeout:.0f} s: nothing was read or "
                "written (a hung or very slow filesystem?). It is left running in the "
                "background; every rank stops here. io_timeout sets this limit."
            )
    if "error" in outcome:
        raise outcome["error"]
    # set whenever fn returned
    return cast(T, outcome.get("value"))
