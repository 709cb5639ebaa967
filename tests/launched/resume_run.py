"""One training, run the ways exact resume is tested, for several scenarios
in one launch (``resume_phases.py``).

Usage: resume_run.py PHASE DIRNAME SCENARIO...
  crash   the check ``full`` trains 6 epochs in one go, without checkpoints;
          then each SCENARIO trains with TrainingCheckpoint in
          DIRNAME/SCENARIO and stops when epoch 4 begins: by an exception,
          the last one by the death of its processes, as a preempted job's
  resume  another launch: each SCENARIO's fit again, with ResumeTraining,
          trains epochs 4 to 6
  SCENARIO  sync, or async (asynchronous writes); state: no training of its
            own, the checks of save_state and load_state (state_checks.py)
            run at the end of the resume

Shuffled data, dropout, gradient accumulation, a StepLR stepped per batch, a
ReduceLROnPlateau and EarlyStopping's counters all have to continue exactly,
and EarlyStopping(load_best=True) has to restore the weights of epoch 2, the
best by a scripted score, from a state saved after epoch 3.
"""

import os
import sys
from pathlib import Path

import state_checks
import torch
from common import AcceleratedNet, Checks, DropoutMLP, make_accelerator, make_data, report
from resume_phases import crash_all, stopped
from skorch.callbacks import Callback, EarlyStopping, LRScheduler

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

PHASE, DIRNAME, SCENARIOS = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
TRAINED = [s for s in SCENARIOS if s != "state"]


class Scripted(Callback):
    """A score that is best after epoch 2, whatever the training does."""

    def on_epoch_end(self, net, **kwargs):
        net.history.record("scripted", [1.0, 0.5, 0.7, 0.8, 0.9, 0.95][len(net.history) - 1])


class Preemption(Callback):
    """Stops training when epoch 4 begins (``resume_phases.Stop``)."""

    in_run_identity = False  # not part of what is trained

    def __init__(self, stop):
        self.stop = stop

    def on_epoch_begin(self, net, **kwargs):
        if len(net.history) == 4:
            self.stop(net)


# one per process, as in a script: accelerate's gradient state is per process
accelerator = make_accelerator(gradient_accumulation_steps=2)
X, y = make_data(500, noise=0.2, seed=3)


def fit(*extra):
    torch.manual_seed(0)  # as the script of every launch did, before each fit
    callbacks = [
        LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=5, gamma=0.9, step_every="batch"),
        (
            "plateau",
            LRScheduler(
                torch.optim.lr_scheduler.ReduceLROnPlateau,
                monitor="valid_loss",
                patience=0,
                factor=0.7,
            ),
        ),
        EarlyStopping(patience=100),
        Scripted(),
        ("best", EarlyStopping(monitor="scripted", patience=100, load_best=True)),
        *extra,
    ]
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
    return net.fit(X, y)


def checkpoint(scenario):
    return TrainingCheckpoint(DIRNAME / scenario, keep_last=2, asynchronous=scenario == "async")


def outcome(net):
    callbacks = dict(net.callbacks_)
    resume = callbacks.get("ResumeTraining")
    return {
        "history": [{k: v for k, v in row.items() if "dur" not in k} for row in net.history],
        "resumed_from": os.path.basename(resume.resumed_from_) if resume else None,
        # the files of this run's folder (TrainingCheckpoint's run_ says which)
        "files": sorted(os.listdir(callbacks["TrainingCheckpoint"].run_folder_))
        if "TrainingCheckpoint" in callbacks
        else [],
        "misses": callbacks["EarlyStopping"].misses_,
        "params": [p.detach().numpy().tolist() for p in net.module_.parameters()][-1],
    }


checks = Checks()
if PHASE == "crash":
    checks.run(lambda: outcome(fit()), name="full")
    crash_all(
        checks,
        {
            s: lambda stop, s=s: stopped(lambda: fit(checkpoint(s), Preemption(stop)))
            for s in TRAINED
        },
    )
for scenario in TRAINED:
    checks.run(
        lambda s=scenario: outcome(fit(checkpoint(s), ResumeTraining(DIRNAME / s))), name=scenario
    )
if "state" in SCENARIOS:
    state_checks.run(checks)
report({"checks": checks.results})
