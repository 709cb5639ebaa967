"""Preemption notices: a scheduler's signal, and every rank stopping together.

Clusters give notice before they stop a job: SIGTERM (Kubernetes, torchrun,
SLURM at the time limit) or SIGUSR1 (SLURM's ``--signal``); the handler that
``TrainingCheckpoint`` installs only notes it. The ranks combine their notes
in an all-reduce (a poll) started without waiting and read a batch later.
Polling every batch cost 9% of a fit of fast batches over gloo, so a poll
also carries each rank's pace, and from the slowest every rank computes the
same next batch to poll at: about ``interval_seconds`` of training apart, at
most ``max_interval`` batches. Every rank stops at the same batch, at most
``max_interval + 1`` after a notice; an epoch's end polls and waits. The
first poll also tells whether any rank handles signals; if none, no rank
polls again.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any, Union

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["NoticeBoard", "can_handle", "handling_signals"]

# what signal.signal takes and gives back
_Handler = Union[Callable[[int, Union[FrameType, None]], Any], int, signal.Handlers, None]


class NoticeBoard:
    """The notices one fit receives, and the ranks' agreement on them;
    ``watching``: whether this rank handles signals (``note`` is the handler)."""

    # class attributes, for tests to set
    interval_seconds = 0.5
    max_interval = 64
    clock = staticmethod(time.perf_counter)  # what the pace is measured with

    def __init__(self, accelerator: Accelerator, watching: bool = True) -> None:
        self.accelerator = accelerator
        self.watching = watching
        self.received: int | None = None  # the number of the signal, once one came
        # whether any rank watches; known after the first poll
        self._polling: bool | None = None
        # (work, values, batch): the poll started at that batch
        self._pending: tuple[dist.Work, torch.Tensor, int] | None = None
        self._batches = 0  # training batches of this fit so far
        self._every = 1  # batches between polls, from the last poll's pace
        self._next = 1  # the batch that starts the next poll
        self._since = (0, 0.0)  # (batch, time) of the last poll, for the pace

    def note(self, signum: int, frame: FrameType | None = None) -> None:  # pylint: disable=unused-argument
        """The signal handler: remember the notice, nothing else."""
        self.received = signum

    def agreed(self, drain: bool = False, batch: bool = True) -> bool:
        """Whether the ranks agree that a notice came: the same answer on every
        rank, called after every training batch and, with ``batch=False``, at
        an epoch's end. With ``drain`` it polls and waits, covering every
        notice so far; otherwise it covers those up to the last poll."""
        if self.accelerator.num_processes == 1:
            return self.received is not None
        if batch:
            self._batches += 1
        if self._polling is None:
            flags = self._values(self.watching, self.received is not None)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            self._polling, agreed = (bool(flag) for flag in flags.tolist())
            self._since = (self._batches, self.clock())
            self._next = self._batches + 1
            return agreed
        if not self._polling:
            return False
        agreed = self._read()
        if drain or self._batches >= self._next:
            now = self.clock()
            batches = self._batches - self._since[0]
            # no batch since the last poll (an epoch's end): no pace, 0 on every rank
            pace = (now - self._since[1]) / batches if batches else 0.0
            self._since = (self._batches, now)
            values = self._values(self.received is not None, pace)
            work = dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True)
            self._pending = (work, values, self._batches)
            if drain:
                agreed = self._read() or agreed
        return agreed

    def _read(self) -> bool:
        """Wait for the pending poll; schedule the next from the slowest pace,
        the same on every rank, so that the all-reduces keep matching."""
        if self._pending is None:
            return False
        work, values, started = self._pending
        self._pending = None
        work.wait()
        notice, pace = values.tolist()
        if pace > 0:
            self._every = max(1, min(self.max_interval, int(self.interval_seconds / pace)))
        self._next = started + self._every
        return bool(notice)

    def _values(self, *values: float) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.accelerator.device)

    def close(self) -> None:
        """Wait for the last poll, which every rank started."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


def can_handle(signals: Collection[int]) -> bool:
    """Whether ``handling_signals`` installs handlers here: Python does so in
    the main thread only."""
    return bool(signals) and threading.current_thread() is threading.main_thread()


@contextmanager
def handling_signals(signals: Collection[int], handler: _Handler) -> Iterator[None]:
    """Handle ``signals`` with ``handler`` within the block, then restore the
    previous handlers; outside the main thread the signals keep theirs."""
    if not can_handle(signals):
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in signals}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
