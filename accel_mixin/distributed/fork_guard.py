"""Forks that a communication thread cannot wedge.

CPython before 3.9.20, 3.10.15 and 3.11.10 resets the lock of its list of
thread states only after taking it in a forked child (python/cpython#112275):
a thread that held it when the process forked leaves the child waiting for
it forever. torch's communication threads take it without the GIL: a gloo
(or NCCL) work that holds Python objects, its tensors or the context that
``backward`` stashes, makes a thread state to release them when it is
destroyed on that thread. A DataLoader worker forked in that instant never
starts, and its rank waits for its batches until the others time out.
``scripts/fork_defect/run`` counts the children that hang: 39 of 2,000 on
3.11.7 and 45 on 3.10.13, none on 3.12.1 and 3.13.0 (``needed`` agrees).

``guard_forks`` registers, once, a hook that runs before every fork of the
process while the forking thread holds the GIL. While a process group
exists, it waits until no thread without a Python thread state runs, seen
twice in a row with no CPU time taken between. Making a thread state calls
nothing that blocks, so a thread that holds the lock runs or waits for a
CPU; a blocked one waits for work, which only the forking thread queues, or
for the GIL, which that thread keeps from the looks to the fork (they read
``/proc`` through libc calls that keep it, under a long switch interval).
The wait is bounded: past it, the fork goes ahead as it would have.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

# a fork waits at most this long for the threads to rest (a spinning thread pool)
PATIENCE = 0.2
_YIELD = 0.0002
# the first releases of each line that carry the fix
_FIXED: dict[tuple[int, ...], int] = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}

_installed = False


def needed(version: tuple[Any, ...] = sys.version_info) -> bool:
    """Whether this Python's forked children can wait for a lost lock."""
    fixed = _FIXED.get(tuple(version[:2]))
    return version[:2] < (3, 12) and (fixed is None or version[2] < fixed)


def guard_forks() -> None:
    """Have every later fork of this process wait for its native threads to
    rest while a process group exists; once per process, on Pythons that
    need it."""
    global _installed  # pylint: disable=global-statement
    if _installed or not needed() or not os.path.isdir("/proc/self/task"):
        return
    _installed = True
    # process-wide by nature (a fork is the process's): no engine makes a fork
    # wait for torch's native threads, and the defect is CPython's, below them
    os.register_at_fork(before=_before_fork)


def _before_fork() -> None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rest(_native_threads())
    except Exception:  # pylint: disable=broad-except
        pass  # a fork hook must not fail the fork; it forks unguarded


def _native_threads() -> list[int]:
    python = {thread.native_id for thread in threading.enumerate()}
    return [int(tid) for tid in os.listdir("/proc/self/task") if int(tid) not in python]


class _Proc:
    """Reads small ``/proc`` files through libc calls that keep the GIL."""

    def __init__(self) -> None:
        libc = ctypes.PyDLL(None)
        self.open, self.read, self.close = libc.open, libc.read, libc.close
        self.open.argtypes, self.open.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_int
        self.read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
        self.read.restype = ctypes.c_ssize_t
        self.buffer = ctypes.create_string_buffer(1024)

    def __call__(self, path: bytes) -> bytes:
        fd = self.open(path, os.O_RDONLY)
        if fd < 0:
            return b""
        try:
            size = self.read(fd, self.buffer, len(self.buffer))
        finally:
            self.close(fd)
        return self.buffer.raw[: max(size, 0)]


_proc: _Proc | None = None


def _sample(tids: Iterable[int]) -> dict[int, tuple[bool, bytes]]:
    """tid -> (whether it runs or waits for a CPU, its CPU time), of the
    threads that still exist."""
    assert _proc is not None  # rest made it
    seen = {}
    for tid in tids:
        stat = _proc(b"/proc/self/task/%d/stat" % tid)
        schedstat = _proc(b"/proc/self/task/%d/schedstat" % tid)
        if stat and schedstat:
            # after the command name in parentheses, the state comes first
            seen[tid] = (stat.rsplit(b")", 1)[1].split()[0] == b"R", schedstat.split()[0])
    return seen


def rest(tids: Iterable[int], patience: float = PATIENCE) -> bool:
    """Wait until the threads ``tids`` rest; return whether they did within
    ``patience`` seconds. From the last two looks on, no other thread takes
    the GIL but one that asked for it before them and went on waiting past
    the old switch interval."""
    global _proc  # pylint: disable=global-statement
    if _proc is None:
        _proc = _Proc()
    deadline = time.monotonic() + patience
    interval = sys.getswitchinterval()
    sys.setswitchinterval(max(interval, 10 * patience))
    try:
        while True:
            first = _sample(tids)
            second = _sample(tids)
            if first == second and not any(running for running, _ in second.values()):
                return True
            if time.monotonic() > deadline:
                return False
            # a poll only before a fork, bounded by ``patience``: no engine says
            # when its native threads rest; the sleep gives a thread that waits
            # for a CPU one, and another the GIL
            time.sleep(_YIELD)
    finally:
        sys.setswitchinterval(interval)
