"""Preemption notices with polls far apart: every rank still stops at one batch.

The fits of ``midepoch_run.py``'s scenarios of these names (``MODES``):

  fast_one  polls as far apart as they go (``max_interval`` batches, as for
            fast batches); rank 1 gets SIGTERM during batch 100 of epoch 2
  fast_all  the same, every rank gets SIGTERM during that batch
  skewed    the clock each rank measures its pace with runs 12 times faster
            on rank 0 than on rank 1 (1 ms a batch against 12 ms): the ranks
            keep polling together only if they agree on the interval; rank 0
            gets SIGTERM during batch 100 of epoch 2

Each rank reports where (epoch, batches done) it started every poll.
"""

import os
import signal

import torch
import torch.distributed as dist
from common import MLP, AcceleratedNet, make_accelerator, make_data
from midepoch_scenarios import patched
from skorch.callbacks import Callback

import accel_mixin.distributed.preemption
from accel_mixin import Preempted
from accel_mixin.callbacks import TrainingCheckpoint
from accel_mixin.distributed.preemption import NoticeBoard

MODES = ("fast_one", "fast_all", "skewed")
NOTICE = (2, 100)


class RecordingDist:
    """torch.distributed for the notice board, noting where each poll starts."""

    def __init__(self):
        self.polls, self.net = [], None

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, *args, **kwargs):
        self.polls.append((len(self.net.history), len(self.net.history[-1]["batches"])))
        return dist.all_reduce(*args, **kwargs)


class Batches(Callback):
    """Counts training batches, notes the last one, sends the notice."""

    in_run_identity = False

    def __init__(self, receives):
        self.receives = receives
        self.done, self.last_ = 0, None

    def on_batch_end(self, net, training=False, **kwargs):
        if not training:
            return
        self.done += 1
        self.last_ = (len(net.history), len(net.history[-1]["batches"]))
        if self.last_ == NOTICE and self.receives:
            os.kill(os.getpid(), signal.SIGTERM)


def fit(mode, folder):
    """One fit of ``mode`` in ``folder``: where each poll started, where
    training stopped."""
    accelerator = make_accelerator()
    rank = accelerator.process_index
    recording = RecordingDist()
    batches = Batches(receives={"fast_one": rank == 1, "fast_all": True, "skewed": rank == 0}[mode])
    if mode == "skewed":
        step = 0.001 if rank == 0 else 0.012
        pace = {"clock": staticmethod(lambda: batches.done * step)}
    else:
        # any pace asks for polls further apart than max_interval allows
        pace = {"interval_seconds": 1e9}
    torch.manual_seed(0)
    recording.net = net = AcceleratedNet(
        MLP,
        accelerator=accelerator,
        max_epochs=3,
        batch_size=4,
        train_split=None,
        verbose=0,
        callbacks=[TrainingCheckpoint(folder), batches],
    )
    preempted = None
    with patched(accel_mixin.distributed.preemption, dist=recording), patched(NoticeBoard, **pace):
        try:
            net.fit(*make_data(1600))
        except Preempted as exc:
            preempted = str(exc)
    return {
        "preempted": preempted,
        "stopped_at": batches.last_,
        "polls": recording.polls,
        "notice": NOTICE,
        "max_interval": NoticeBoard.max_interval,
        "batches_per_epoch": -(-1600 // (4 * accelerator.num_processes)),
    }
