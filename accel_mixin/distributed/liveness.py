"""Liveness: file operations that must advance, and ranks that must be there.

``supervised`` runs a save or a load in a worker thread and calls
``on_progress()`` while it advances: while the process reads or writes
(``/proc/self/io``) or the worker computes (copying a memory-mapped file
reads nothing through system calls). After ``io_timeout`` seconds without,
``Stalled`` is raised on every rank, and a worker stuck in a system call
nothing can interrupt (a hung NFS mount) is left behind. Without ``/proc``,
a live worker counts as progress.

A rank is *gone* only when its process has ended; one that is paused or
busy in a call that holds the GIL lives, and the others wait for it up to
their timeout. Two signs say so, neither of which needs the dead rank's
GIL, nor its hostname:

- ``Lifelines``: each rank listens on a TCP port and connects to every
  other rank's. A listener sends its rank's token once, which proves the
  line reaches that rank; from then on the kernel alone keeps the line, and
  resets it when the process ends, however it ends (SIGKILL too), on any
  machine or PID namespace. A line that never carried the token (an address
  that does not reach the rank) proves nothing either way.
- ``exited``: the process id of a rank that runs on this boot of this
  machine, in this PID namespace, is no longer a process. This covers the
  second before the lines are up.

``Presence`` sets its rank's key every beat (a counter and the current
call), which says where a rank is and whether it still answers.
"""

import atexit
import contextlib
import errno
import functools
import gc
import itertools
import os
import socket
import threading
import time
import weakref

from accel_mixin.errors import Stalled

__all__ = ["Lifelines", "Presence", "exited", "process_identity", "supervised"]

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


def _read(path):
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _identity(pid=None):
    """This process as no other process anywhere is: the machine's boot, the
    PID namespace and the process id; None where the system does not say.
    Read once per process (``pid``): a reading would count as a save's I/O."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    if not boot or not namespace:
        return None
    return f"{boot}/{namespace.replace(' ', '')}/{pid}"


def process_identity():
    """``boot/pid-namespace/pid`` of this process, or ``-`` where unknown."""
    return _identity(os.getpid()) or "-"


def exited(identity, zombies=True):
    """Whether ``identity`` (``process_identity()`` of a rank) names a process
    of this boot and PID namespace that has ended; False where it cannot tell
    (another machine, another namespace, or no identity). ``zombies``: look
    whether it ended but is not collected yet (a read of ``/proc``)."""
    mine = _identity(os.getpid())
    where, _, pid = identity.rpartition("/")
    if mine is None or where != mine.rpartition("/")[0] or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    if not zombies:
        return False
    # a zombie has ended too: its parent (a launcher that looks seldom) has
    # not collected it yet
    stat = _read(f"/proc/{pid}/stat")
    return stat is not None and stat.rpartition(")")[2].split()[:1] == ["Z"]


def _local_address(store):
    """The address family and address of this machine that reaches the
    store's host (where the others reach it too); loopback without one."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host = getattr(store, "host", None)
    if host:
        with contextlib.suppress(OSError, IndexError):
            family, _, _, _, sockaddr = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(sockaddr)  # chooses the route; sends nothing
                return family, probe.getsockname()[0]
    return socket.AF_INET, "127.0.0.1"


_LIFELINES = weakref.WeakSet()
_CONNECT_TIMEOUT, _CONNECT_TRIES = 2.0, 5
# how long the presence thread looks often while lines wait for their proof
_PROVE_FOR = 10.0


class _Line:
    __slots__ = ("sock", "token", "verified")

    def __init__(self, sock, token):
        self.sock, self.token, self.verified = sock, token, False


class Lifelines:
    """A TCP line to each other rank, which the kernel resets when that
    rank's process ends (see the module's docstring).

    ``serve`` and ``connect`` run in the presence thread, once a beat, until
    every line is up; ``ended`` may be called from any thread.
    """

    def __init__(self, store, rank, num_processes):
        self.store = store
        self.peers = [r for r in range(num_processes) if r != rank]
        self.token = f"{rank}-{os.urandom(8).hex()}\n".encode()
        self.lines = {}  # rank -> _Line
        self.tries = dict.fromkeys(self.peers, 0)
        self.accepted = []  # kept open: closing one would tell its peer we ended
        self.lock = threading.Lock()
        family, host = _local_address(store)
        self.listener = socket.create_server((host, 0), family=family, backlog=num_processes)
        self.listener.setblocking(False)
        port = self.listener.getsockname()[1]
        store.set(f"lifeline/{rank}", f"{port} {self.token.decode().strip()} {host}")
        _LIFELINES.add(self)

    def serve(self):
        """Accept the lines of the others and send each this rank's token."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # none waiting (BlockingIOError), or closed
                return
            with contextlib.suppress(OSError):
                conn.sendall(self.token)  # a few bytes: the send buffer takes them
            self.accepted.append(conn)

    def connect(self):
        """Connect to the ranks whose address is known and whose line is not up."""
        for rank in self.peers:
            if rank in self.lines or self.tries[rank] >= _CONNECT_TRIES:
                continue
            key = f"lifeline/{rank}"
            if not self.store.check([key]):
                continue
            port, token, host = self.store.get(key).decode().split(" ", 2)
            self.tries[rank] += 1
            try:
                sock = socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT)
            except OSError:
                continue  # refused or unreachable: that proves nothing; tried again
            sock.setblocking(False)
            with self.lock:
                self.lines[rank] = _Line(sock, f"{token}\n".encode())

    def ended(self):
        """The ranks whose proven line the kernel closed: their process ended."""
        with self.lock:
            return [rank for rank, line in list(self.lines.items()) if self._closed(rank, line)]

    def _closed(self, rank, line):
        try:
            data = line.sock.recv(len(line.token), socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return False  # open, nothing to read: alive, or not yet proven
        except OSError as exc:
            if exc.errno not in (errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE):
                return False
            data = b""  # reset by the other end's kernel
        if line.verified:
            return data == b""
        if data and len(data) < len(line.token) and line.token.startswith(data):
            return False  # the rest of the token is on its way
        if data != line.token:
            # not the rank's listener (an address that does not reach it), or
            # closed before it answered: no proof either way
            del self.lines[rank]
            line.sock.close()
            return False
        line.sock.recv(len(line.token))  # proven: from now on a close means an end
        line.verified = True
        return self._closed(rank, line)

    def proven(self):
        """Whether every line that can be is up and proven."""
        return all(
            (rank in self.lines and self.lines[rank].verified) or self.tries[rank] >= _CONNECT_TRIES
            for rank in self.peers
        )

    def close(self):
        _LIFELINES.discard(self)
        with self.lock:
            socks = [line.sock for line in self.lines.values()] + self.accepted + [self.listener]
            self.lines, self.accepted = {}, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()


def _close_in_child():
    """A forked child (a DataLoader worker) must not hold the lines: they
    would outlive its parent, which would not look ended to the others."""
    for lifelines in list(_LIFELINES):
        for sock in [line.sock for line in lifelines.lines.values()] + [
            *lifelines.accepted,
            lifelines.listener,
        ]:
            with contextlib.suppress(OSError):
                sock.close()
    _LIFELINES.clear()


os.register_at_fork(after_in_child=_close_in_child)


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
    """Sets the coordinator's presence key every beat and keeps its lifelines;
    ends with the coordinator or the store, closing the lifelines."""

    def __init__(self, coordinator):
        super().__init__(daemon=True, name="accel_mixin-presence")
        self.coordinator = weakref.ref(coordinator)  # the thread ends with it
        self.key = f"presence/{coordinator.process_index}"
        self.store = coordinator.store
        self.beat = coordinator.beat
        self.count = itertools.count(1)
        self.identity = process_identity()
        self.stopped = threading.Event()
        _PRESENCES.add(self)
        # last registered, first run: before whatever exists by now tears down
        atexit.unregister(_stop_at_exit)
        atexit.register(_stop_at_exit)

    def announce(self, coordinator):
        self.store.set(self.key, f"{next(self.count)} {self.identity}|{coordinator.where}")

    def run(self):
        self.started = time.monotonic()
        lifelines = None
        try:
            while (coordinator := self.coordinator()) is not None:
                try:
                    self.announce(coordinator)
                    lifelines = coordinator.lifelines
                    if lifelines is not None:
                        lifelines.serve()
                        lifelines.connect()
                        lifelines.ended()  # proves the new lines
                except Exception:  # pylint: disable=broad-except
                    return  # the store is gone: the group is being torn down
                del coordinator
                # until every line is proven, soon again: a rank that ends
                # early is told only by a proven line on another machine
                pending = (
                    lifelines is not None
                    and time.monotonic() < self.started + _PROVE_FOR
                    and not lifelines.proven()
                )
                if self.stopped.wait(min(self.beat, 0.05) if pending else self.beat):
                    return
        finally:
            if lifelines is not None:
                lifelines.close()
