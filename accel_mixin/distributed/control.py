"""Collective sections that fail fast on every rank, agreed through gloo.

A section is a block that every rank runs, in the same order. Its barriers
are collectives on a gloo group of the coordinator's own (made with it, on
every rank alike): gloo's own dissemination barrier, log2(N) rounds of one
send and one receive per rank, carrying the maximum of every rank's outcome,
the same on every rank: passed, failed on a rank (whose message follows by
one broadcast), or ranks in different calls. Every rank, not rank 0 alone
as with ``monitored_barrier``, names a dead or missing peer: a closed
connection rides on the outcome to every survivor, and a barrier that waited
in vain ends in a census of who arrived, on the job's store.

A run on one writer that every rank knows (``save_params``'s main process)
starts writing as the ranks meet, and ends with the writer's message to each
other rank, in place of a second barrier: N-1 sends on the writer and one
receive on each other rank, one hop, where a barrier takes log2(N) rounds
on every rank. A waiting rank learns at once if the writer's process ends.

A rank whose section raised enters the barrier the others wait in, carrying
its failure. Every rank marks the sections it learned the failure in, from
the failing rank's depth down: their later barriers raise without a
collective, and each raises as it ends even if a callback swallowed the
error there, so that every rank leaves them after the same number of
barriers. An error leaving a section where it was not learned is carried
there too, as it was first named: a rank that swallowed it deeper
(``LoadInitState`` swallows a missing file) meets it at its next barrier.
A carried failure waits for the others at most ``_CARRY`` seconds: they may
be in a collective of the data (DDP's) instead, which ends as the failing
rank's process ends.

A rank whose process ends closes its connections: gloo raises at once,
"Connection closed by peer [ADDR]:PORT", and a table of every rank's
sockets, gathered once, turns it into the rank. A rank that lives but does
not answer (paused, or holding the GIL) keeps its sockets: it is waited for.
A waiting rank sleeps in gloo's transport; nothing polls.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import os
import re
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast, overload

import numpy
import torch
import torch.distributed as dist

from accel_mixin.distributed.io_watchdog import Watchdog
from accel_mixin.distributed.object_gather import ObjectGather
from accel_mixin.errors import DistributedError, Preempted
from accel_mixin.internals import default_store

if TYPE_CHECKING:
    from accelerate import Accelerator

    class _Gloo(Protocol):
        """The collectives of torch's ``ProcessGroupGloo`` used here, which
        torch's type stubs leave out (its ``Backend``'s, in C++)."""

        def allgather(
            self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]
        ) -> dist.Work: ...

        def broadcast(
            self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions
        ) -> dist.Work: ...

        def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

        def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work: ...

        def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work: ...

    class _Appending(Protocol):
        """``Store.append``, which torch's type stubs leave out."""

        def append(self, key: str, value: str) -> None: ...


__all__ = ["Control", "agreed_failure", "coordinator_for", "failure_message", "own_sockets"]

T = TypeVar("T")

COLLECTIVE = (
    "fit, partial_fit, predict, predict_proba, forward, score, save_params, "
    "load_params, save_state, load_state, wait_for_saves, wait_for_everyone"
)
# a failure message travels in a tensor of this many bytes
_MESSAGE_BYTES = 4096
# the ranks that wait for a run's writer: it ends by its own io_timeout, and
# a dead writer closes its connections, so this only caps a writer paused for good
_WRITER_CAP = timedelta(days=1)
# gloo: "Connection closed by peer [ADDR]:PORT", or "Read error [ADDR]:PORT:
# Connection reset by peer" (a peer killed while this rank reads)
_CLOSED = re.compile(r"Connection (?:closed|reset) by peer")
_PEER = re.compile(r"\[([^\]/][^\]]*)\]:(\d+)")
_ARRIVAL = 1  # the tag of a barrier's outcomes
_TOLD = 2  # the tag of a writer's outcome
# how long a rank whose section raised waits for the others to meet its failure
_CARRY = 10.0
# a failure of the rank's own beats one that only echoes another's (a timeout)
_OWN, _ECHO = 2, 1


def failure_message(what: str, rank: int, exc: BaseException) -> str:
    """How the other ranks learn of ``exc``: the operation, the rank, the error."""
    return f"{what} failed on rank {rank}: {type(exc).__name__}: {exc}"


def namespace() -> str:
    """This attempt's prefix: launchers may keep one store across restarts."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"accel_mixin/{run}/{attempt}" if run else f"accel_mixin/{attempt}"


def own_sockets() -> list[tuple[str, int]]:
    """This process's TCP sockets as ``(address, port)``, read from ``/proc``
    (Linux); empty elsewhere, where a dead peer goes unnamed."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    found: list[tuple[str, int]] = []
    for name, width in (("/proc/self/net/tcp", 4), ("/proc/self/net/tcp6", 16)):
        with contextlib.suppress(OSError):
            with open(name, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
            for row in rows:
                fields = row.split()
                if fields[9] in inodes:
                    address, port = fields[1].split(":")
                    found.append((_address(address, width), int(port, 16)))
    return found


def _address(hexed: str, width: int) -> str:
    """``/proc/net/tcp``'s address: 32-bit words in the host's byte order."""
    raw = bytes.fromhex(hexed)
    words = b"".join(
        struct.pack("=I", int.from_bytes(raw[i : i + 4], "big")) for i in range(0, width, 4)
    )
    family = 2 if width == 4 else 10  # AF_INET, AF_INET6
    import socket  # pylint: disable=import-outside-toplevel

    text = socket.inet_ntop(family, words)
    return text[7:] if text.startswith("::ffff:") else text


def _ports(port: int) -> set[int]:
    """gloo prints a peer's port in network byte order: both readings."""
    return {port, struct.unpack("<H", struct.pack(">H", port))[0]}


def _encode(text: str, size: int = _MESSAGE_BYTES) -> torch.Tensor:
    data = text.encode()[:size]
    tensor = torch.zeros(size, dtype=torch.uint8)
    if data:
        tensor[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return tensor


def _decode(tensor: torch.Tensor) -> str:
    return bytes(tensor.tolist()).rstrip(b"\0").decode(errors="replace")


def _unless_closed(
    posts: Sequence[tuple[int, Callable[[], dist.Work]]], deadline: float
) -> list[int]:
    """Post each peer's operation, then wait for each until ``deadline``;
    return the peers whose connection closed (gloo says so as an operation is
    posted or waited for). Any other error of gloo's is raised, a timeout
    past ``deadline`` among them."""
    closed: list[int] = []
    works: list[tuple[int, dist.Work]] = []
    for peer, post in posts:
        try:
            works.append((peer, post()))
        except RuntimeError as exc:
            if not _CLOSED.search(str(exc)):
                raise
            closed.append(peer)
    for peer, work in works:
        try:
            work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as exc:
            if not _CLOSED.search(str(exc)):
                raise
            closed.append(peer)
    return closed


def _agreed(message: str) -> DistributedError:
    """A failure every rank learned in the same barrier: no more collectives."""
    exc = DistributedError(message)
    exc.agreed = True
    return exc


def agreed_failure(exc: BaseException) -> bool:
    """Whether every rank learned ``exc`` in one barrier: no collective follows."""
    return getattr(exc, "agreed", False)


class Control:
    """Fail-fast sessions, sections and barriers for one process group.

    ``timeout`` is the seconds a barrier waits for the others; without a
    ``store`` (one process) barriers return at once and failures just raise.
    """

    def __init__(
        self,
        num_processes: int,
        process_index: int,
        timeout: float = 1800.0,
        store: dist.Store | None = None,
    ) -> None:
        self.num_processes = num_processes
        self.process_index = process_index
        self.timeout = timeout
        self.store = store
        self.alone: str | None = None
        # the sections this rank is in: [what, (own failure, its exception)
        # noted by fail(), failure agreed in it]
        self._open: list[list[Any]] = []
        self._group: _Gloo | None = None
        # (address, port) -> rank, of every rank's sockets
        self._peers: dict[tuple[str, int], int] = {}
        # what -> the error of a group left unusable
        self._broken: Callable[[str], DistributedError] | None = None
        self._sessions = 0
        # (session, call) of the last barrier every rank was in
        self._met: tuple[int, str] | None = None
        # this rank's failure that a barrier carried, and its message: (exc, message)
        self._carried: tuple[BaseException | None, str] = (None, "")
        self._watchdog = Watchdog()
        self._gather = ObjectGather()
        self._barriers = 0  # the barriers this rank entered: the census's key
        # a barrier's outcome held and received, and each as a tensor
        self._rows: tuple[numpy.ndarray[Any, Any], list[torch.Tensor]] | None = None

    @property
    def distributed(self) -> bool:
        return self.store is not None

    @contextlib.contextmanager
    def running_alone(self, who: str) -> Iterator[None]:
        """Within the block only this rank runs ``who``: a collective call
        there would wait for ranks that never come, so it raises at once."""
        previous, self.alone = self.alone, who
        try:
            yield
        finally:
            self.alone = previous

    def _refuse_alone(self, what: str) -> None:
        if self.alone is not None:
            raise DistributedError(
                f"{what} is a collective call, which every rank must make, but "
                f"{self.alone} runs on the main process only; give it "
                "main_process_only=False to run it on every rank"
            )

    def session(self, what: str) -> _Section:
        """A top-level section (or a section, when nested)."""
        self._refuse_alone(what)
        return _Section(self, what)

    def section(self, what: str) -> _Section:
        """Run a block on every rank; an error leaving it reaches every rank."""
        return _Section(self, what)

    def fail(self, what: str, exc: BaseException) -> None:
        """Fail the current section for an error this rank caught and acts on
        later: every rank raises at the next barrier."""
        if self._open and self._open[-1][1] is None:
            self._open[-1][1] = (failure_message(what, self.process_index, exc), exc)

    # -- the group ----------------------------------------------------------

    def group(self) -> _Gloo:
        """The control group, made (and its peers' sockets gathered) once."""
        if self._group is None:
            # made only where distributed: with a store
            store = dist.PrefixStore(f"{namespace()}/control", cast(dist.Store, self.store))
            self._group = cast(
                "_Gloo",
                dist.ProcessGroupGloo(
                    store, self.process_index, self.num_processes, timedelta(seconds=self.timeout)
                ),
            )
            self._gather_peers()
        return self._group

    def _all_texts(self, text: str, size: int = _MESSAGE_BYTES) -> list[str]:
        """Every rank's ``text`` (at most ``size`` bytes), by rank."""
        gathered = [torch.zeros(size, dtype=torch.uint8) for _ in range(self.num_processes)]
        self.group().allgather([gathered], [_encode(text, size)]).wait()
        return [_decode(row) for row in gathered]

    def _gather_peers(self) -> None:
        mine = ";".join(f"{address},{port}" for address, port in own_sockets())
        for rank, row in enumerate(self._all_texts(mine, _MESSAGE_BYTES * 4)):
            for entry in filter(None, row.split(";")):
                address, _, port = entry.rpartition(",")
                if rank != self.process_index:
                    self._peers[(address, int(port))] = rank

    def gone(self, exc: BaseException) -> int | None:
        """The rank whose closed connection ``exc`` (gloo's error) names, or None."""
        text = str(exc)
        if not _CLOSED.search(text):
            return None
        for address, port in _PEER.findall(text):
            for reading in _ports(int(port)):
                rank = self._peers.get((address, reading))
                if rank is not None:
                    return rank
        return -1  # a peer's connection closed, whose rank the table lacks

    def _break(self, make: Callable[[str], DistributedError], what: str) -> DistributedError:
        """Keep ``make(what)``, the error of every later call, and return it."""
        self._broken = make
        return make(what)

    def _lost(self, what: str, exc: BaseException) -> DistributedError | None:
        rank = self.gone(exc)
        return None if rank is None else self._break(functools.partial(self._gone, rank=rank), what)

    def _failed(
        self, what: str, exc: RuntimeError, wait: timedelta, missing: Sequence[int] = ()
    ) -> DistributedError:
        """gloo's error ``exc`` in ``what``: a peer gone, or else a wait in vain
        (for ``missing``, where known); every later call raises it too."""
        return self._lost(what, exc) or self._break(
            lambda later: self._timed_out(later, wait, missing), what
        )

    def _gone(self, what: str, rank: int) -> DistributedError:
        who = f"rank {rank}" if rank >= 0 else "a rank"
        return _agreed(
            f"{what}: {who} is gone (its process ended), last seen "
            f"{self._where()}; the other ranks cannot go on without it. Its own "
            "output says why it ended."
        )

    def _where(self) -> str:
        if self._met is None:
            return "before any collective call"
        session, call = self._met
        return f"in {call}" if self._open and session == self._sessions else f"after {call}"

    def gather(self, site: str, obj: T) -> list[T]:
        """Every rank's ``obj``, by rank, in one all-gather on the control
        group (``object_gather``); ``site`` names the call."""
        if not self.distributed:
            return [obj]
        return self._collective(
            site, lambda: self._gather(self.group(), self.num_processes, site, obj)
        )

    def total(self, site: str, values: Sequence[int]) -> Callable[[], list[int]]:
        """Start summing ``values`` over the ranks, in one all-reduce on the
        control group (data that does not grow with the number of ranks);
        return what waits for the sums. Until then the caller may compute:
        the transport sums meanwhile."""
        if not self.distributed:
            return lambda: list(values)
        tensor = torch.tensor(values, dtype=torch.int64)
        work = self._collective(site, lambda: self.group().allreduce([tensor]))

        def sums() -> list[int]:
            self._collective(site, work.wait)
            return [int(value) for value in tensor.tolist()]

        return sums

    def _collective(self, site: str, call: Callable[[], T]) -> T:
        self._refuse_alone(site)
        if self._broken is not None:
            raise self._broken(site)
        try:
            return call()
        except RuntimeError as exc:
            # named after the call it serves, which the user made
            what = self._open[-1][0] if self._open else site
            raise self._failed(what, exc, timedelta(seconds=self.timeout)) from exc

    # -- barriers -----------------------------------------------------------

    def barrier(
        self,
        what: str,
        patience: float | None = None,
        failure: tuple[int, str] | None = None,
        flag: int = 0,
    ) -> int:
        """Wait for every rank, or raise ``DistributedError`` if a rank failed
        in a section this rank is in, or did not arrive within ``patience``
        seconds (default: the timeout). Return the largest ``flag`` (at least
        0) any rank gave: a question every rank asks at the barrier rides on
        it without a collective of its own."""
        if not self.distributed:
            return flag
        self._refuse_alone(what)
        if self._broken is not None:
            raise self._broken(what)
        if not self._open:
            with self.session(what):
                return self.barrier(what, patience, flag=flag)
        agreed = next((entry[2] for entry in self._open if entry[2] is not None), None)
        if agreed is not None and failure is None:
            raise _agreed(agreed)  # the others left this section: no collective
        if failure is None and self._open[-1][1] is not None:
            (message, exc), self._open[-1][1] = self._open[-1][1], None
            self._carried = (exc, message)
            failure = (_OWN, message)  # its exception, raised later, is no news
        wait = timedelta(seconds=self.timeout if patience is None else patience)
        try:
            outcome, flag = self._agree(what, wait, failure, flag)
        except RuntimeError as exc:
            if agreed_failure(exc):
                raise
            raise self._failed(what, exc, wait) from exc
        self._met = (self._sessions, self._open[0][0])
        if outcome is not None and failure is None:
            raise outcome
        return flag

    def _agree(
        self, what: str, wait: timedelta, failure: tuple[int, str] | None, flag: int
    ) -> tuple[DistributedError | None, int]:
        group = self.group()
        call = zlib.crc32(self._open[0][0].encode()) & 0x7FFFFFFF
        priority, message = failure or (0, "")
        # the failing rank of the highest priority, the lowest of them
        rank_code = priority * (self.num_processes + 1) + (
            self.num_processes - self.process_index if priority else 0
        )
        depth = len(self._open) if priority else 0
        outcome = self._arrive(what, wait, (rank_code, call, -call, depth, max(0, flag)))
        flag = outcome[4]
        if outcome[1] != -outcome[2]:
            mismatch = self._mismatch(what)
            for entry in self._open:  # every rank leaves its call at once
                entry[2] = str(mismatch)
            return mismatch, flag
        if outcome[0] == 0:
            return None, flag
        root = self.num_processes - outcome[0] % (self.num_processes + 1)
        text = _encode(message if root == self.process_index else "")
        broadcast = dist.BroadcastOptions()
        broadcast.rootRank, broadcast.timeout = root, wait
        group.broadcast([text], broadcast).wait()
        message = _decode(text)
        # fail the sections from the failing rank's down: see the module's docstring
        for entry in self._open[max(0, outcome[3] - 1) :]:
            entry[2] = message
        return _agreed(message), flag

    def _arrive(self, what: str, wait: timedelta, mine: tuple[int, ...]) -> list[int]:
        """Return the elementwise maximum of every rank's outcome (``mine``
        here), the same on every rank, in ceil(log2 N) rounds: in round i a
        rank sends what it holds to rank + 2^i and receives from rank - 2^i
        (gloo's own barrier is this dissemination barrier; the maximum rides
        on it). A peer whose connection closed is passed on in the outcome, so
        every survivor names it at once. A rank not heard from within ``wait``
        is found by a census (``_census``), which names who did not arrive."""
        n, me = self.num_processes, self.process_index
        if self._rows is None:
            # what this rank holds and what it receives, made once: a round's
            # only tensor operations are a send, a receive and their waits
            table = numpy.zeros((2, len(mine) + 1), dtype=numpy.int64)
            self._rows = (table, list(torch.from_numpy(table)))
        table, (held, received) = self._rows
        table[0] = (*mine, 0)  # the last column: 2 + the rank of a closed peer
        self._barriers += 1
        deadline = time.monotonic() + wait.total_seconds()
        for step in (1 << i for i in range((n - 1).bit_length())):
            source, target = (me - step) % n, (me + step) % n
            try:
                closed = self._swap(held, received, source, target, deadline)
            except RuntimeError as exc:
                self._rows = None  # gloo may still write into them
                raise self._break(self._census(wait), what) from exc
            if closed:
                table[0, -1] = max(int(table[0, -1]), *(2 + peer for peer in closed))
            if source in closed:
                table[1] = 0  # nothing came
            numpy.maximum(table[0], table[1], out=table[0])
        if table[0, -1]:
            raise self._break(functools.partial(self._gone, rank=int(table[0, -1]) - 2), what)
        return cast("list[int]", table[0, :-1].tolist())

    def _swap(
        self,
        held: torch.Tensor,
        received: torch.Tensor,
        source: int,
        target: int,
        deadline: float,
    ) -> list[int]:
        """One round: send ``held`` to ``target``, receive ``received`` from
        ``source``; return the peers whose connection closed. The send is
        waited for even after the receive failed: gloo drops the send of a
        Work nobody holds, and its target would wait for it."""
        group = self.group()
        return _unless_closed(
            [
                (source, lambda: group.recv([received], source, _ARRIVAL)),
                (target, lambda: group.send([held], target, _ARRIVAL)),
            ],
            deadline,
        )

    def _census(self, wait: timedelta) -> Callable[[str], DistributedError]:
        """After a barrier waited in vain, name the ranks that did not arrive:
        each rank that timed out adds its rank to one key of the job's store
        and waits up to ``wait`` (long enough for a rank that arrived later,
        whose own wait ends later) until all have. A gloo pair that timed out
        is closed, so the census cannot go through the group; the store
        answers a wait when its key is set, and is asked O(1) times per rank,
        once, on the way out of a failed barrier."""
        store = dist.PrefixStore(
            f"{namespace()}/census/{self._barriers}", cast(dist.Store, self.store)
        )
        cast("_Appending", store).append("here", f"{self.process_index},")
        if store.add("count", 1) == self.num_processes:
            store.set("all", "1")
        with contextlib.suppress(RuntimeError):  # DistStoreError: not all came
            store.wait(["all"], wait)
        here = {int(rank) for rank in store.get("here").decode().split(",") if rank}
        missing = [rank for rank in range(self.num_processes) if rank not in here]
        return lambda later: self._timed_out(later, wait, missing)

    def _mismatch(self, what: str) -> DistributedError:
        mine = self._open[0][0]
        other = next((c for c in self._all_texts(mine) if c != mine), mine)
        return _agreed(
            f"{mine} on rank {self.process_index} met {other} on another rank: every "
            f"rank must make the same collective calls, in the same order ({COLLECTIVE}); "
            'a call under "if accelerator.is_main_process:" leaves the other ranks behind'
        )

    def _timed_out(
        self, what: str, wait: timedelta, missing: Sequence[int] = ()
    ) -> DistributedError:
        ranks = ", ".join(map(str, missing))
        named = (
            f" Rank {ranks} did not arrive: its process lives (a dead one would have "
            "been named at once), but it has not answered (paused, busy in a call that "
            "holds the GIL, or in another call)."
            if missing
            else ""
        )
        return _agreed(
            f"{what}: rank {self.process_index} waited {wait.total_seconds():.0f} s for the "
            f"other ranks, which neither arrived nor reported a failure.{named} Every "
            f"rank must make the same collective calls ({COLLECTIVE}); the process "
            "group's timeout (InitProcessGroupKwargs) sets how long a rank is waited for"
        )

    # where ``here`` is left true, every rank gets ``fn``'s value
    @overload
    def run(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        here: Literal[True] = ...,
        io_timeout: float | None = ...,
        files: str | None = ...,
        writer: int | None = ...,
    ) -> T: ...

    @overload
    def run(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        here: bool,
        io_timeout: float | None = ...,
        files: str | None = ...,
        writer: int | None = ...,
    ) -> T | None: ...

    def run(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        here: bool = True,
        io_timeout: float | None = None,
        files: str | None = None,
        writer: int | None = None,
    ) -> T | None:
        """Run ``fn`` on the ranks where ``here`` is true, and agree on the outcome.

        Every rank starts once all arrived and returns once ``fn`` finished
        wherever it ran. If it failed anywhere, every rank raises: the failing
        one its exception, the others a ``DistributedError`` naming it.
        ``io_timeout`` (default: the timeout) bounds a stall of ``fn`` on the
        rank that runs it; ``files`` names them in its error.

        With ``writer``, the one rank that runs ``fn`` (``here`` is ignored),
        ``fn`` starts there before the others arrived, and the writer tells
        each other rank its outcome: for a write that replaces its files
        atomically, which a rank still reading the previous ones does not see.
        """
        io_timeout = self.timeout if io_timeout is None else io_timeout
        name = what if files is None else f"{what} of {files}"
        with self.session(what):
            if writer is not None and self.distributed:
                return self._run_on(writer, fn, what, name, io_timeout)
            self.barrier(what)
            if here and self.distributed:
                result: T | None = self._watchdog.run(fn, io_timeout=io_timeout, what=name)
            else:
                result = fn() if here else None
            self.barrier(what, _WRITER_CAP.total_seconds())
        return result

    def _run_on(
        self, writer: int, fn: Callable[[], T], what: str, name: str, io_timeout: float
    ) -> T | None:
        """``run`` with one writer: it writes while the ranks meet, then sends
        each other rank its outcome, where a second barrier would take every
        rank through log2(N) rounds. A rank waits for the writer only, and
        learns at once if its process ends."""
        if self.process_index != writer:
            self.barrier(what)
            message = self._told(what, writer)
            if message:
                self._open[-1][2] = message  # learned here: the section raises no more
                raise _agreed(message)
            return None
        job = self._watchdog.start(fn)
        try:
            self.barrier(what)
        except BaseException:
            # no write outlives the call; its outcome is moot, the others left
            with contextlib.suppress(Exception):
                job.result(io_timeout=io_timeout, what=name)
            raise
        try:
            result = job.result(io_timeout=io_timeout, what=name)
        except Exception as exc:
            message = failure_message(what, self.process_index, exc)
            self._tell(message)
            self._open[-1][2] = message  # the others learned it: its section is done
            raise
        self._tell("")
        return result

    def _tell(self, message: str) -> None:
        """Send ``message`` ('' for success) to every other rank. A peer whose
        process ended meanwhile is skipped: the others may not wait on it,
        and the next collective call names it."""
        text, group = _encode(message), self.group()
        _unless_closed(
            [
                (peer, functools.partial(group.send, [text], peer, _TOLD))
                for peer in range(self.num_processes)
                if peer != self.process_index
            ],
            time.monotonic() + self.timeout,
        )

    def _told(self, what: str, writer: int) -> str:
        """The writer's message, however long its write takes."""
        text = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        try:
            self.group().recv([text], writer, _TOLD).wait(_WRITER_CAP)
        except RuntimeError as exc:
            raise self._failed(what, exc, _WRITER_CAP, [writer]) from exc
        return _decode(text)


class _Section:
    """The context of a section: entered on every batch, so a plain class."""

    __slots__ = ("control", "what")

    def __init__(self, control: Control, what: str) -> None:
        self.control, self.what = control, what

    # pylint: disable=protected-access
    def __enter__(self) -> _Section:
        control = self.control
        if not control._open:
            control._sessions += 1
        control._open.append([self.what, None, None])
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:
        control = self.control
        try:
            agreed = control._open[-1][2]
            if exc_type is None and agreed is not None:
                # a failing rank left this section after the barrier this rank
                # learned it in: leave it failed too, without another barrier
                raise _agreed(agreed)
            # a stop every rank takes is no news, nor a failure every rank
            # learned in this section or one around it (which the others left)
            if (
                exc_type is None
                or issubclass(exc_type, (KeyboardInterrupt, GeneratorExit, Preempted))
                or not control.distributed
                or any(entry[2] is not None for entry in control._open)
            ):
                return False
            lost = control._lost(self.what, exc) if isinstance(exc, RuntimeError) else None
            if lost is not None:
                raise lost from exc
            # a failure learned in an inner section is carried as it is: a rank
            # that swallowed it there (LoadInitState, Checkpoint) and went on
            # waits in a barrier of this one
            carried, carried_message = control._carried
            noted = control._open[-1][1]  # noted by fail() before it rose
            if exc is carried:
                priority, message = _ECHO, carried_message
            elif isinstance(exc, DistributedError):
                priority, message = _ECHO, str(exc)
            else:
                priority = _OWN
                message = (
                    noted[0]
                    if noted
                    # exc_type is not None: neither is exc
                    else failure_message(self.what, control.process_index, cast(BaseException, exc))
                )
            control._carried = (exc, message)
            with contextlib.suppress(DistributedError):
                control.barrier(
                    self.what, min(control.timeout, _CARRY), failure=(priority, message)
                )
            return False
        finally:
            control._open.pop()


def _collect_at_exit() -> None:
    """DDP wrappers die in reference cycles holding the last references to
    the process group, whose teardown during finalization's collection
    aborted processes at exit (1 in 13 launches under load): collect them
    while the interpreter still runs."""
    gc.collect()


# one per process group, as process-wide as the group itself: every net in
# the process shares its control group, which every rank makes together once
# (a collective, N sockets); torch keeps no side group per process group
_COORDINATORS: dict[tuple[int, int, int], Control] = {}


def coordinator_for(accelerator: Accelerator) -> Control:
    """The process's coordinator for the accelerator's process group, shared by
    every net; its control group is made now, on every rank alike."""
    # without the store, barriers could not wait: fail loudly instead
    store = default_store() if accelerator.num_processes > 1 else None
    key = (accelerator.num_processes, accelerator.process_index, id(store))
    if key not in _COORDINATORS:
        handler = getattr(accelerator, "init_handler", None)
        timeout = getattr(handler, "timeout", None) or timedelta(minutes=30)
        _COORDINATORS.clear()  # an older process group is gone
        control = Control(
            accelerator.num_processes, accelerator.process_index, timeout.total_seconds(), store
        )
        if control.distributed:
            control.group()
            atexit.unregister(_collect_at_exit)  # registered once
            atexit.register(_collect_at_exit)
        _COORDINATORS[key] = control
    return _COORDINATORS[key]
