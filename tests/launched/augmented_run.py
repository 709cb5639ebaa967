"""Training on a Dataset that augments at random, crashed and resumed
(``runs_interrupted.py`` runs it, in its launches' phases).

SEEDING  unseeded: the augmentation draws from NumPy's and Python's global
         generators, seeded by the OS (another state in every process and
         on every rank), and from torch's, wherever the launch left it;
         per_rank: all three seeded with the rank, as scripts that want
         each rank to augment differently do

``crash`` trains 5 epochs without checkpoints (the reference, kept in
DIRNAME/reference-rank<r>.json), puts the random number generators back as
they were before it, and trains again with TrainingCheckpoint and
ResumeTraining, stopped when epoch 3 begins; ``resume``, in another launch,
resumes there.

The replica check and the run identity read rows of the Dataset, whose rows
and targets are tensors they can hash: they must neither tell the ranks or
the launches apart by their random draws, nor take draws from training, so
that the fit trains and the resumed history and weights equal the
reference's bit for bit.
"""

import json
import os
import random
from pathlib import Path

import numpy as np
import torch
from common import AcceleratedNet, DropoutMLP, make_data
from resume_phases import stopped
from skorch.callbacks import Callback

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint
from accel_mixin.training.rng import restore_rng, rng_state

RANK = int(os.environ.get("RANK", "0"))


class Augmenting(torch.utils.data.Dataset):
    """Rows with noise from Python's, NumPy's and torch's global generators,
    and tensors for targets, as torchvision-style transforms give."""

    def __init__(self, X, y):
        self.X, self.y = X, y

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        x = torch.as_tensor(self.X[i])
        noise = torch.randn(x.shape) + torch.as_tensor(np.random.normal(size=x.shape))
        return x + 0.1 * noise.float() * random.random(), torch.as_tensor(self.y[i])


class Preemption(Callback):
    """Stops training when epoch 3 begins (``resume_phases.Stop``)."""

    in_run_identity = False

    def __init__(self, stop):
        self.stop = stop

    def on_epoch_begin(self, net, **kwargs):
        if len(net.history) == 3:
            self.stop(net)


def fit(accelerator, callbacks):
    X, y = make_data(300, noise=0.2, seed=3)
    net = AcceleratedNet(
        DropoutMLP,
        accelerator=accelerator,
        max_epochs=5,
        lr=0.5,
        batch_size=32,
        iterator_train__shuffle=True,
        verbose=0,
        callbacks=callbacks,
    )
    return net.fit(Augmenting(X, y), y)


def outcome(net):
    return {
        "history": [{k: v for k, v in row.items() if "dur" not in k} for row in net.history],
        "params": [p.detach().numpy().tolist() for p in net.module_.parameters()],
    }


def seeded(seeding):
    if seeding == "per_rank":
        torch.manual_seed(RANK + 1)
        np.random.seed(RANK + 1)
        random.seed(RANK + 1)


def checkpoints(dirname):
    return [TrainingCheckpoint(dirname / "ckpt"), ResumeTraining(dirname / "ckpt")]


def crash(accelerator, seeding, dirname, stop):
    """The reference, then the same fit with checkpoints, stopped by ``stop``."""
    dirname = Path(dirname)
    seeded(seeding)
    before = rng_state()
    reference = outcome(fit(accelerator, []))
    (dirname / f"reference-rank{RANK}.json").write_text(json.dumps(reference))
    restore_rng(before)
    stopped(lambda: fit(accelerator, [*checkpoints(dirname), Preemption(stop)]))


def resume(accelerator, seeding, dirname):
    """The fit again, resumed; with the reference, to compare."""
    dirname = Path(dirname)
    seeded(seeding)
    net = fit(accelerator, checkpoints(dirname))
    return {
        **outcome(net),
        "reference": json.loads((dirname / f"reference-rank{RANK}.json").read_text()),
        "resumed_from": dict(net.callbacks_)["ResumeTraining"].resumed_from_,
        "runs": sorted(p.name for p in (dirname / "ckpt").glob("run-*")),
    }
