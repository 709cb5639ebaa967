"""Preemption notices: a scheduler's signal, and every rank stopping together.

Clusters and spot machines give notice before they stop a job: SIGTERM
(Kubernetes, torchrun, which forwards it to every worker, SLURM at the
time limit) or SIGUSR1 with SLURM's ``--signal``. While ``fit`` runs,
``TrainingCheckpoint`` handles the signals it is given: the handler only
notes the notice. After every training batch the ranks combine their notes
in one small all-reduce, started without waiting and read one batch later,
so every rank learns of a notice at the same batch, at most two batches
after it arrived on any rank, whether one rank got the signal or all did.
The first poll of a fit waits for its all-reduce, which also tells every
rank whether any of them handles signals: where none does, no rank polls
again, and training pays nothing for notices that cannot come.
"""

import signal
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

from accel_mixin.coordination import Preempted

__all__ = ["NoticeBoard", "Preempted", "can_handle", "handling_signals"]


class NoticeBoard:
    """The notices one fit receives, and the ranks' agreement on them.

    Parameters
    ----------
    accelerator : accelerate.Accelerator
      The net's accelerator.

    watching : bool (default=True)
      Whether this rank handles signals (``note`` is its handler).

    """

    def __init__(self, accelerator, watching=True):
        self.accelerator = accelerator
        self.watching = watching
        self.received = None  # the number of the signal, once one came
        self._pending = None  # the all-reduce started after the last batch
        self._polling = None  # whether any rank watches; known after the first poll

    def note(self, signum, frame=None):  # pylint: disable=unused-argument
        """The signal handler: remember the notice, nothing else."""
        self.received = signum

    def agreed(self, drain=False):
        """Whether the ranks agree that a notice came; every rank calls it
        once after every training batch and gets the same answer, which
        covers the notices up to the batch before. With ``drain`` (an
        epoch's last batch, where validation follows) it waits for this
        batch's notes too."""
        if self.accelerator.num_processes == 1:
            return self.received is not None
        agreed = False
        if self._polling is None:
            flags = self._flag(self.watching, self.received is not None)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            self._polling, agreed = (bool(flag) for flag in flags.tolist())
        elif self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = bool(flag.item())
        if not self._polling:
            return agreed
        flag = self._flag(self.received is not None)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        if drain:
            self.close()
            agreed = agreed or bool(flag.item())
        return agreed

    def _flag(self, *values):
        return torch.tensor(
            [int(value) for value in values], dtype=torch.int32, device=self.accelerator.device
        )

    def close(self):
        """Wait for the last all-reduce, which every rank started."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


def can_handle(signals):
    """Whether ``handling_signals`` installs handlers for ``signals`` here:
    Python installs them in the main thread only."""
    return bool(signals) and threading.current_thread() is threading.main_thread()


@contextmanager
def handling_signals(signals, handler):
    """Handle ``signals`` with ``handler`` while the block runs, then put the
    previous handlers back. Outside the main thread, where Python cannot
    install handlers, the signals keep theirs."""
    if not can_handle(signals):
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in signals}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
