"""Liveness: file operations that must advance, and ranks that must be there.

``supervised`` runs a save or a load in a worker thread and calls
``on_progress()`` while it advances: while the process reads or writes
(``/proc/self/io``) or the worker computes (copying a memory-mapped file
reads nothing through system calls). After ``io_timeout`` seconds without,
``Stalled`` is raised on every rank, and a worker stuck in a system call
nothing can interrupt (a hung NFS mount) is left behind. Without ``/proc``,
a live worker counts as progress.

``Presence`` sets its rank's key every beat (host, process id, current
call), so the others can tell a rank that is gone.
"""

import atexit
import gc
import itertools
import os
import socket
import threading
import time
import weakref

from accel_mixin.errors import Stalled

__all__ = ["HOST", "Presence", "exited", "supervised"]

HOST = socket.gethostname()

# how often the calling thread looks at the worker: soon for small saves, then less often
_LOOK_FIRST, _LOOK_MAX = 0.001, 0.25


class _Sampler:
    """Samples the process's reads and writes and the worker's CPU time; its
    own reads of ``/proc`` are no progress, so they are taken off."""

    def __init__(self, native_id):
        self.stat = f"/proc/self/task/{native_id}/stat"
        self.own = 0  # bytes this sampler read since the last sample
        self.last = None

    def _read(self, path):
        with open(path, "rb") as f:
            data = f.read()
        self.own += len(data)
        return data

    def advanced(self):
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


def supervised(fn, *, io_timeout, on_progress, what):
    """Return or raise what ``fn()`` does in a worker thread; ``on_progress()``
    while it advances, ``Stalled`` naming ``what`` after ``io_timeout`` s without."""
    outcome = {}

    def work():
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # pylint: disable=broad-except
            outcome["error"] = exc

    worker = threading.Thread(target=work, daemon=True, name="accel_mixin-io")
    worker.start()  # returns once the thread runs, its native_id set
    sampler = _Sampler(worker.native_id)
    sampler.advanced()
    last_progress = time.monotonic()
    look = _LOOK_FIRST
    while True:
        worker.join(look)
        if not worker.is_alive():
            break
        look = min(2 * look, _LOOK_MAX)
        if sampler.advanced():
            last_progress = time.monotonic()
            on_progress()
        elif time.monotonic() - last_progress > io_timeout:
            raise Stalled(
                f"{what} made no progress for {io_timeout:.0f} s: nothing was read or "
                "written (a hung or very slow filesystem?). It is left running in the "
                "background; every rank stops here. io_timeout sets this limit."
            )
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def exited(value):
    """Whether the presence ``value`` is of a process of this machine that ended."""
    fields = value.split("|", 1)[0].split(" ")
    if len(fields) != 3 or fields[1] != HOST or not fields[2].isdigit():
        return False
    try:
        os.kill(int(fields[2]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


_PRESENCES = weakref.WeakSet()


def _stop_at_exit():
    """Stop and join the presence threads while the interpreter still runs.

    A daemon thread returning from a store call once Python finalizes is
    ended by ``pthread_exit``; the unwind meets pybind11's ``noexcept`` GIL
    guard and ``std::terminate`` aborts the process ("terminate called
    without an active exception"). Joined here, before finalization, no
    thread is in a call then; the join is bounded for a dead store.
    """
    for presence in list(_PRESENCES):
        presence.stopped.set()
    for presence in list(_PRESENCES):
        presence.join(timeout=2)
    # DDP wrappers die in reference cycles holding the last references to the
    # process group, whose teardown during finalization's collection aborted
    # processes at exit (1 in 13 launches under load): collect them now
    gc.collect()


class Presence(threading.Thread):
    """Sets the coordinator's presence key every beat; ends with the coordinator
    or the store."""

    def __init__(self, coordinator):
        super().__init__(daemon=True, name="accel_mixin-presence")
        self.coordinator = weakref.ref(coordinator)  # the thread ends with it
        self.key = f"presence/{coordinator.process_index}"
        self.store = coordinator.store
        self.beat = coordinator.beat
        self.count = itertools.count(1)
        self.stopped = threading.Event()
        _PRESENCES.add(self)
        # last registered, first run: before whatever exists by now tears down
        atexit.unregister(_stop_at_exit)
        atexit.register(_stop_at_exit)

    def announce(self, coordinator):
        self.store.set(self.key, f"{next(self.count)} {HOST} {os.getpid()}|{coordinator.where}")

    def run(self):
        while (coordinator := self.coordinator()) is not None:
            try:
                self.announce(coordinator)
            except Exception:  # pylint: disable=broad-except
                return  # the store is gone: the group is being torn down
            del coordinator
            if self.stopped.wait(self.beat):
                return
