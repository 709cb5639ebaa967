"""One job at a time writes a run folder of training states.

The writing job's main process holds an exclusive ``flock`` on
``<folder>/.accel_mixin-writer`` for as long as its fit writes there, and
writes who it is into that file (host, process id, torchrun's or SLURM's job,
since when). The kernel drops the lock when the process ends, however it
ends: nobody polls, and a lock is never stale. A second job that claims the
folder while the first lives is refused and told who writes there; once the
first is gone, the folder is free.

On shared filesystems: Linux's NFS client turns ``flock`` into a lock on the
whole file that the server holds across machines (a machine that dies loses
it once its lease ends, about 90 s on NFSv4); Lustre has it when mounted with
``-o flock``. Where the filesystem has no locks, ``flock`` fails and nothing
is refused; so on an object store (an fsspec URL), which has none.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from types import ModuleType

from accel_mixin.checkpoint import storage

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows: no claims
    fcntl = None

__all__ = ["claim", "release"]

MARKER = ".accel_mixin-writer"
# this process's claims: the folder's real path -> [fd, claims]
_HELD: dict[str, list[int]] = {}


def _who() -> str:
    jobs = [
        f"{label} {os.environ[name]}"
        for name, label in (("TORCHELASTIC_RUN_ID", "torchrun run"), ("SLURM_JOB_ID", "SLURM job"))
        if os.environ.get(name, "none") != "none"
    ]
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return ", ".join([f"process {os.getpid()} on {socket.gethostname()}", *jobs, f"since {since}"])


def claim(folder: str | os.PathLike[str]) -> str | None:
    """Claim ``folder`` for this process; None once it holds it, or what
    the marker says of the live process that holds it instead."""
    if storage.is_url(folder):
        return None
    key = os.path.realpath(folder)
    if key in _HELD:
        _HELD[key][1] += 1
        return None
    if fcntl is None:
        return None
    name = os.path.join(folder, MARKER)
    for _ in range(3):  # a marker its holder removed meanwhile is made anew
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError:
            return None  # the saves say why they cannot write there
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            return holder or "a process that is starting"
        except OSError:  # a filesystem without locks
            os.close(fd)
            return None
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(fd), os.stat(name)):
                break
        os.close(fd)
    else:
        return None
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, _who().encode(), 0)
    _HELD[key] = [fd, 1]
    return None


def release(folder: str | os.PathLike[str]) -> None:
    """Give up a claim of ``folder``; the last one removes the marker."""
    key = os.path.realpath(folder)
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1]:
        return
    del _HELD[key]
    with contextlib.suppress(OSError):  # while locked: no one takes the file being removed
        os.unlink(os.path.join(folder, MARKER))
    os.close(held[0])
