"""Whether a file operation makes progress, and a bound on how long it may not.

A save or a load that several processes wait for runs in a worker thread
(``supervised``) while the calling thread watches it: every time the work
advances, ``on_progress()`` is called (the coordinator tells the waiting
ranks so); when it has not advanced for ``io_timeout`` seconds, ``Stalled``
is raised in the calling thread. The worker may be stuck in a system call
that nothing can interrupt (a hung NFS or FUSE mount); it is left behind,
and the error ends the operation on every rank instead of leaving them all
waiting forever.

Progress is what the process reads and writes (``rchar`` and ``wchar`` of
``/proc/self/io``, which count every read and write of every thread) and
the worker thread's own CPU time (copying a memory-mapped file into the
model's parameters reads nothing through system calls). Where ``/proc``
is missing, a worker that is alive counts as making progress, as a
heartbeat would.
"""

import threading
import time

from accel_mixin.errors import Stalled

__all__ = ["Stalled", "supervised"]

# how often the calling thread looks at the worker: soon for small saves,
# then less often
_LOOK_FIRST, _LOOK_MAX = 0.001, 0.25


class _Sampler:
    """Samples what the process read and wrote and what the worker thread
    computed; reading ``/proc`` counts as reading, so its own reads are
    taken off."""

    def __init__(self, native_id):
        self.stat = f"/proc/self/task/{native_id}/stat"
        self.own = 0  # bytes this sampler read since the last sample
        self.last = None

    def _read(self, path):
        with open(path, "rb") as f:
            data = f.read()
        self.own += len(data)
        return data

    def sample(self):
        """(read + written bytes of others, worker CPU ticks), or None."""
        try:
            io = dict(
                line.split(b":", 1)
                for line in self._read("/proc/self/io").splitlines()
                if b":" in line
            )
            # after the command name in parentheses: utime and stime are the
            # 12th and 13th fields
            fields = self._read(self.stat).rsplit(b")", 1)[1].split()
            moved = int(io[b"rchar"]) + int(io[b"wchar"])
            ticks = int(fields[11]) + int(fields[12])
        except (OSError, KeyError, IndexError, ValueError):
            return None
        return moved, ticks

    def advanced(self):
        """Whether the work advanced since the last call (True if unknown)."""
        # what the previous samples read of /proc is no progress; this
        # sample's reads show in the next
        own_before, self.own = self.own, 0
        now = self.sample()
        if now is None:
            return True
        last, self.last = self.last, now
        if last is None:
            return True
        return now[0] - last[0] > own_before or now[1] != last[1]


def supervised(fn, *, io_timeout, on_progress, what):
    """Run ``fn()`` in a worker thread; return what it returns or raise what
    it raised.

    Parameters
    ----------
    fn : callable
      The file operation.

    io_timeout : float
      Seconds the operation may go without progress.

    on_progress : callable
      Called without arguments, at most every quarter of a second, while
      the operation advances.

    what : str
      The operation, for the error, e.g. ``'save_params of params.pt'``.

    Raises
    ------
    Stalled
      If the operation made no progress for ``io_timeout`` seconds.

    """
    outcome = {}
    started = threading.Event()

    def work():
        outcome["tid"] = threading.get_native_id()
        started.set()
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # pylint: disable=broad-except
            outcome["error"] = exc

    worker = threading.Thread(target=work, daemon=True, name="accel_mixin-io")
    worker.start()
    started.wait()
    sampler = _Sampler(outcome["tid"])
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
