"""Exact resume for every DataLoader setup: each case fits 4 epochs in one
go, and again interrupted (at an epoch's end, or inside an epoch) and
resumed by a new net, with other seeds, as a rerun of the script would.

Usage: resume_loaders.py DIRNAME [CASE ...]

Every case reports each batch's loss, each epoch's losses and the weights of
both runs; the test compares them bit for bit.
"""

import os
import sys

import numpy as np
import torch
from accelerate.utils import set_seed
from common import AcceleratedNet, DropoutMLP, make_accelerator, make_data, report
from skorch.callbacks import Callback

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

DIRNAME = sys.argv[1]
accelerator = make_accelerator()
X, y = make_data(333, noise=0.2, seed=3)


def generator(seed=7):
    return torch.Generator().manual_seed(seed)


def loaders(num_workers=0, persistent=False, **train):
    """The training and validation loaders' settings, workers on both."""
    workers = {"num_workers": num_workers}
    if num_workers:
        workers["persistent_workers"] = persistent
    settings = {f"iterator_train__{k}": v for k, v in {**workers, **train}.items()}
    settings.update({f"iterator_valid__{k}": v for k, v in workers.items()})
    return settings


# name -> net settings: workers 0 and 2, persistent or not, a seeded
# generator or none, shuffled or not, a sampler of the user's
LOADERS = {
    "w0": lambda: loaders(shuffle=True),
    "w0-generator": lambda: loaders(shuffle=True, generator=generator()),
    "w0-ordered": lambda: loaders(shuffle=False),
    "w2": lambda: loaders(2, shuffle=True),
    "w2-persistent": lambda: loaders(2, persistent=True, shuffle=True),
    "w2-persistent-generator": lambda: loaders(
        2, persistent=True, shuffle=True, generator=generator()
    ),
    "w2-persistent-ordered": lambda: loaders(2, persistent=True, shuffle=False),
    "sampler": lambda: {
        "train_split": None,
        "iterator_train__sampler": torch.utils.data.RandomSampler(
            range(len(X)), generator=generator(3)
        ),
    },
}
# where the first run stops: (epoch, training batch), 1-based; batch None
# stops as the epoch begins, after the state of the epoch before was saved
STOPS = {"epoch": (3, None), "inside": (2, 5)}


class StopAt(Callback):
    """Interrupts training, as Ctrl-C would (skorch ends fit on it)."""

    in_run_identity = False

    def __init__(self, epoch, batch):
        self.epoch, self.batch = epoch, batch

    def on_epoch_begin(self, net, **kwargs):
        if self.batch is None and len(net.history) == self.epoch:
            raise KeyboardInterrupt

    def on_batch_end(self, net, training=False, **kwargs):
        done = len(net.history[-1]["batches"])
        if training and len(net.history) == self.epoch and done == self.batch:
            raise KeyboardInterrupt


def fit(case, callbacks, seed):
    set_seed(seed)
    net = AcceleratedNet(
        DropoutMLP,
        accelerator=accelerator,
        max_epochs=4,
        lr=0.3,
        batch_size=16,
        verbose=0,
        callbacks=callbacks,
        **LOADERS[case](),
    )
    net.fit(X, y)
    return net


def outcome(net):
    return {
        "epochs": [
            {k: v for k, v in row.items() if k in ("train_loss", "valid_loss")}
            for row in net.history
        ],
        "batches": [
            [b["train_loss"] for b in row["batches"] if "train_loss" in b] for row in net.history
        ],
        "weights": [p.detach().numpy().tolist() for p in net.module_.parameters()],
    }


results = {}
for case in sys.argv[2:] or LOADERS:
    uninterrupted = outcome(fit(case, [], seed=0))
    for stop, (epoch, batch) in STOPS.items():
        folder = os.path.join(DIRNAME, f"{case}-{stop}")
        every = 2 if batch else None
        fit(case, [TrainingCheckpoint(folder, every_n_batches=every), StopAt(epoch, batch)], seed=0)
        resumed = fit(
            case,
            [TrainingCheckpoint(folder, every_n_batches=every), ResumeTraining(folder)],
            seed=1234,  # a rerun starts from other generators: the state restores them
        )
        results[f"{case}/{stop}"] = {
            "uninterrupted": uninterrupted,
            "resumed": outcome(resumed),
            "resumed_from": os.path.basename(
                dict(resumed.callbacks_)["ResumeTraining"].resumed_from_ or ""
            ),
        }
    np.random.seed(0)

report(results)
