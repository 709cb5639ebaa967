"""What ResumeTraining tells the user, fit after fit in one launch.

Usage: announced_run.py DIRNAME

Each scenario is a check run after a marker line ``=== <name>`` on both
streams, so that the test cuts every rank's own stdout and stderr into the
scenarios' parts and reads what each printed or warned there:

  first         TrainingCheckpoint and ResumeTraining in an empty folder
  resumed       the same script again, longer: resumes after epoch 2
  quiet         again with verbose=0: resumes, says nothing
  other         another learning rate in that folder: a run of its own
  logged        yet another, its sink a logger configured at start-up (its
                handler writes to the process's stdout whatever fit silences)
  logged-again  the same: resumes, through the logger
  interrupted   states inside epochs, stopped in epoch 2 after batch 3
  midepoch      resumes after batch 2 of epoch 2
  legacy        a folder holding a training state outside run folders
  misspelt      ResumeTraining's folder is not TrainingCheckpoint's
  unsaved       ResumeTraining alone, with nothing to resume
  reader        ResumeTraining alone, resuming states that another fit saved
"""

import logging
import os
import shutil
import sys
from pathlib import Path

from common import MLP, AcceleratedNet, Checks, make_accelerator, make_data, report
from skorch.callbacks import Callback

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

DIRNAME = Path(sys.argv[1])
# as a user configures logging: the handler keeps this process's stdout
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="LOG %(message)s")
LOGGER = logging.getLogger("announced")

accelerator = make_accelerator()
X, y = make_data(200)


class Interrupt(Exception):
    """The crash of the interrupted scenario."""


class StopAt(Callback):
    """Raises on every rank after the training batch ``batch`` of ``epoch``."""

    in_run_identity = False

    def __init__(self, epoch, batch):
        self.epoch, self.batch = epoch, batch

    def on_batch_end(self, net, training=False, **kwargs):
        done = len(net.history[-1]["batches"])
        if training and len(net.history) == self.epoch and done == self.batch:
            raise Interrupt(f"stopped after batch {done} of epoch {self.epoch}")


def fit(*callbacks, max_epochs=2, lr=0.1, verbose=1):
    net = AcceleratedNet(
        MLP,
        accelerator=accelerator,
        max_epochs=max_epochs,
        lr=lr,
        batch_size=16,
        verbose=verbose,
        callbacks=list(callbacks),
    )
    net.fit(X, y)
    resume = dict(net.callbacks_).get("ResumeTraining")
    return {
        "resumed_from": resume.resumed_from_ and os.path.relpath(resume.resumed_from_, DIRNAME),
        "epochs": len(net.history),
    }


def both(folder, sink=print, **kwargs):
    folder = DIRNAME / folder
    return fit(TrainingCheckpoint(folder), ResumeTraining(folder, sink=sink), **kwargs)


def interrupted():
    folder = DIRNAME / "inside"
    try:
        fit(TrainingCheckpoint(folder, every_n_batches=2), ResumeTraining(folder), StopAt(2, 3))
    except Interrupt as exc:
        return str(exc)
    raise AssertionError("the fit went on past its stop")


def legacy():
    if accelerator.is_main_process:
        state = min((DIRNAME / "first").glob("run-*/training-state-*"))
        (DIRNAME / "legacy").mkdir()
        shutil.copytree(state, DIRNAME / "legacy" / state.name)
    accelerator.wait_for_everyone()
    return both("legacy")


SCENARIOS = {
    "first": lambda: both("first"),
    "resumed": lambda: both("first", max_epochs=3),
    "quiet": lambda: both("first", max_epochs=4, verbose=0),
    "other": lambda: both("first", lr=0.05),
    "logged": lambda: both("first", sink=LOGGER.info, lr=0.2),
    "logged-again": lambda: both("first", sink=LOGGER.info, lr=0.2, max_epochs=3),
    "interrupted": interrupted,
    "midepoch": lambda: fit(
        TrainingCheckpoint(DIRNAME / "inside", every_n_batches=2),
        ResumeTraining(DIRNAME / "inside"),
    ),
    "legacy": legacy,
    "misspelt": lambda: fit(
        TrainingCheckpoint(DIRNAME / "misspelt"), ResumeTraining(DIRNAME / "mispelt")
    ),
    "unsaved": lambda: fit(ResumeTraining(DIRNAME / "unsaved")),
    "reader": lambda: fit(ResumeTraining(DIRNAME / "first"), max_epochs=5),
}

checks = Checks()
for name, scenario in SCENARIOS.items():
    for stream in (sys.stdout, sys.stderr):
        print(f"=== {name}", file=stream, flush=True)
    checks.run(scenario, name=name)
report({"checks": checks.results})
