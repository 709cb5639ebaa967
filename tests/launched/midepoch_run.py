"""One training script, run the ways resuming inside an epoch is tested.

Usage: midepoch_run.py DIRNAME SCENARIO [SCENARIO ...]

Each scenario is one fit, a check of its own (``common.Checks``), run in the
order given, in a folder of its own (``DIRNAME/SCENARIO``):

  full          trains 4 epochs in one go, without checkpoints
  crash         TrainingCheckpoint(every_n_batches=3); every rank dies after
                training batch 8 of epoch 2, as a lost machine would
  notice_one    rank 1 (or the only rank) gets SIGTERM during batch 5 of
                epoch 2; every rank stops at one batch, saves and raises
                Preempted
  notice_all    rank 0 sends SIGTERM to torchrun, which forwards it to every
                worker, during batch 3 of epoch 3
  notice_last   SIGTERM during the last training batch of epoch 2: training
                stops at the end of epoch 2
  notice_mixed  as notice_one, but only rank 0 handles SIGTERM, and gets it
  quiet         TrainingCheckpoint(signals=()) on every rank: after the
                first poll of the fit, no rank polls for notices
  elastic       under torchrun --max-restarts: in the first attempt, rank 1
                SIGKILLs itself after batch 8 of epoch 2; torchrun restarts
                every worker, which resume and finish
  resume:NAME   the same script again on NAME's folder, with ResumeTraining:
                goes on exactly
  fast_one, fast_all, skewed
                notices with polls far apart (notice_bound.py)

A scenario that ends its process (crash, notice_all, elastic's first
attempt) comes last; the report names the scenario under way
(``midepoch_scenarios.py``).

Shuffled data with a ragged last batch, dropout, gradient accumulation, a
CyclicLR stepped per batch and a training score cached per batch all have
to continue exactly. With ``ACCEL_TEST_FSDP=1`` the module is sharded by
FSDP2 (the test-only ``make_fsdp_accelerator``).
"""

import os
import signal
import sys
import time

import notice_bound
import torch
import torch.distributed as dist
from common import (
    AcceleratedNet,
    DropoutMLP,
    fresh_state,
    make_accelerator,
    make_data,
    make_fsdp_accelerator,
)
from midepoch_scenarios import patched, run_scenarios
from skorch.callbacks import Callback, EpochScoring, LRScheduler

import accel_mixin.distributed.preemption
from accel_mixin import Preempted
from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint
from accel_mixin.distributed.preemption import NoticeBoard

DIRNAME, SCENARIOS = sys.argv[1], sys.argv[2:]
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SHARDED = os.environ.get("ACCEL_TEST_FSDP") == "1"


class CountingDist:
    """torch.distributed for the notice board, counting its all-reduces."""

    def __init__(self):
        self.all_reduces = 0

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, *args, **kwargs):
        self.all_reduces += 1
        return dist.all_reduce(*args, **kwargs)


class At(Callback):
    """Acts after a given training batch of a given epoch (1-based)."""

    in_run_identity = False  # not part of what is trained

    def __init__(self, epoch, batch, action):
        self.epoch, self.batch, self.action = epoch, batch, action

    def on_batch_end(self, net, training=False, **kwargs):
        batches = net.history[-1]["batches"]
        if training and len(net.history) == self.epoch and len(batches) == self.batch:
            self.action(net)


class Stops(Callback):
    """Records where training was when Preempted left it."""

    in_run_identity = False

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.last_ = (len(net.history), len(net.history[-1]["batches"]))


def last_rank(net):
    return net.accelerator.process_index == net.accelerator.num_processes - 1


def die(net):
    net.wait_for_saves()
    os._exit(3)  # pylint: disable=protected-access


def term_self(net):
    if last_rank(net):
        os.kill(os.getpid(), signal.SIGTERM)


def term_rank0(net):
    if net.accelerator.process_index == 0:
        os.kill(os.getpid(), signal.SIGTERM)


def term_launcher(net):
    if net.accelerator.process_index == 0:
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(0.5)  # torchrun forwards it to every worker meanwhile


def kill_once(net):
    if ATTEMPT == 0 and last_rank(net):
        os.kill(os.getpid(), signal.SIGKILL)


X, y = make_data(333, noise=0.2, seed=3)


def fit(mode, folder):
    """One fit of the scenario ``mode`` in ``folder``: what the tests compare."""
    if SHARDED:
        fresh_state()
        accelerator = make_fsdp_accelerator(gradient_accumulation_steps=2)
    else:
        accelerator = make_accelerator(gradient_accumulation_steps=2)
    rank = accelerator.process_index
    callbacks = [
        LRScheduler(
            torch.optim.lr_scheduler.CyclicLR,
            base_lr=0.01,
            max_lr=0.3,
            step_size_up=7,
            step_every="batch",
        ),
        EpochScoring("accuracy", on_train=True, name="train_acc"),
    ]
    every = {"crash": 3, "resume": 3, "elastic": 3}.get(mode)
    if mode != "full":
        callbacks += [
            TrainingCheckpoint(
                folder,
                every_n_batches=every,
                keep_last=3,
                signals=()
                if mode == "quiet" or (mode == "notice_mixed" and rank)
                else (signal.SIGTERM,),
            ),
            ResumeTraining(folder),
        ]
    train_batches = -(-int(len(X) * 0.8) // (16 * accelerator.num_processes))
    callbacks += {
        "crash": [At(2, 8, die)],
        "notice_one": [At(2, 5, term_self)],
        "notice_all": [At(3, 3, term_launcher)],
        "notice_mixed": [At(2, 5, term_rank0)],
        "notice_last": [At(2, train_batches, term_self)],
        "elastic": [At(2, 8, kill_once)],
    }.get(mode, [])
    callbacks.append(stops := Stops())

    torch.manual_seed(0)
    net = AcceleratedNet(
        DropoutMLP,
        accelerator=accelerator,
        max_epochs=4,
        lr=0.5,
        batch_size=16,
        iterator_train__shuffle=True,
        verbose=0,
        callbacks=callbacks,
    )
    preempted = None
    # a poll after every batch, whatever the pace: the notices above stop at
    # batches known in advance (notice_bound.py tests longer intervals)
    polls = CountingDist()
    with (
        patched(accel_mixin.distributed.preemption, dist=polls),
        patched(NoticeBoard, max_interval=1),
    ):
        try:
            net.fit(X, y)
        except Preempted as exc:
            preempted = str(exc)

    checkpoint = dict(net.callbacks_).get("TrainingCheckpoint")
    return {
        "history": [{k: v for k, v in row.items() if "dur" not in k} for row in net.history],
        "params": [full(p).numpy().tolist() for p in net.module_.parameters()],
        "preempted": preempted,
        "stopped_at": stops.last_,
        "train_batches": train_batches,
        "handler_after_fit": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "resumed_from": (
            os.path.basename(dict(net.callbacks_)["ResumeTraining"].resumed_from_ or "")
            if mode != "full"
            else None
        ),
        "files": sorted(os.listdir(checkpoint.run_folder_)) if checkpoint else [],
        "attempt": ATTEMPT,
        "notice_polls": polls.all_reduces,
    }


def full(param):
    """The whole tensor (under FSDP2, gathered from every rank's shard)."""
    param = param.detach()
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def scenario(name):
    if name in notice_bound.MODES:
        return notice_bound.fit(name, os.path.join(DIRNAME, name))
    mode, _, of = name.partition(":")
    return fit(mode, os.path.join(DIRNAME, of or mode))


run_scenarios(SCENARIOS, scenario, attempt=ATTEMPT)
