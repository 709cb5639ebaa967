"""One training script, run the ways exact resume is tested.

Usage: resume_run.py MODE DIRNAME [ASYNC]
  full    trains 6 epochs in one go
  crash   trains with TrainingCheckpoint and dies when epoch 4 begins
  resume  the same script again, with ResumeTraining: trains epochs 4 to 6

Shuffled data, dropout, gradient accumulation, a StepLR stepped per batch, a
ReduceLROnPlateau and EarlyStopping's counters all have to continue exactly,
and EarlyStopping(load_best=True) has to restore the weights of epoch 2, the
best by a scripted score, from a state saved after epoch 3.
"""

import os
import sys

import torch
from common import AcceleratedNet, DropoutMLP, make_accelerator, make_data, report
from skorch.callbacks import Callback, EarlyStopping, LRScheduler

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

MODE, DIRNAME = sys.argv[1], sys.argv[2]
ASYNCHRONOUS = len(sys.argv) > 3 and sys.argv[3] == "async"


class Scripted(Callback):
    """A score that is best after epoch 2, whatever the training does."""

    def on_epoch_end(self, net, **kwargs):
        net.history.record("scripted", [1.0, 0.5, 0.7, 0.8, 0.9, 0.95][len(net.history) - 1])


class Preemption(Callback):
    """Dies when epoch 4 begins, as a preempted job would."""

    in_run_identity = False  # not part of what is trained

    def on_epoch_begin(self, net, **kwargs):
        if len(net.history) == 4:
            net.wait_for_saves()
            os._exit(3)  # pylint: disable=protected-access


torch.manual_seed(0)
accelerator = make_accelerator(gradient_accumulation_steps=2)
X, y = make_data(500, noise=0.2, seed=3)
callbacks = [
    LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=5, gamma=0.9, step_every="batch"),
    (
        "plateau",
        LRScheduler(
            torch.optim.lr_scheduler.ReduceLROnPlateau, monitor="valid_loss", patience=0, factor=0.7
        ),
    ),
    EarlyStopping(patience=100),
    Scripted(),
    ("best", EarlyStopping(monitor="scripted", patience=100, load_best=True)),
]
if MODE != "full":
    callbacks.append(TrainingCheckpoint(DIRNAME, keep_last=2, asynchronous=ASYNCHRONOUS))
if MODE == "crash":
    callbacks.append(Preemption())
if MODE == "resume":
    callbacks.append(resume := ResumeTraining(DIRNAME))

net = AcceleratedNet(
    DropoutMLP,
    accelerator=accelerator,
    max_epochs=6,
    lr=0.5,
    batch_size=16,
    iterator_train__shuffle=True,
    verbose=0,
    callbacks=callbacks,
)
net.fit(X, y)

report(
    {
        "history": [{k: v for k, v in row.items() if "dur" not in k} for row in net.history],
        "resumed_from": os.path.basename(resume.resumed_from_) if MODE == "resume" else None,
        # the files of this run's folder (TrainingCheckpoint's run_ says which)
        "files": sorted(os.listdir(dict(net.callbacks_)["TrainingCheckpoint"].run_folder_))
        if MODE != "full"
        else [],
        "misses": dict(net.callbacks_)["EarlyStopping"].misses_,
        "params": [p.detach().numpy().tolist() for p in net.module_.parameters()][-1],
    }
)
