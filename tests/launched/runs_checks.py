"""Run folders under two real processes: clear errors on every rank.

Usage: torchrun --nproc_per_node 2 runs_checks.py DIRNAME
"""

import sys
from pathlib import Path

from common import (
    MLP,
    AcceleratedNet,
    Checks,
    error_and_seconds,
    make_accelerator,
    make_data,
    report,
)

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

DIRNAME = Path(sys.argv[1])
accelerator = make_accelerator()
X, y = make_data(200)
checks = Checks()


def fit(dirname, run=None):
    net = AcceleratedNet(
        MLP,
        accelerator=accelerator,
        max_epochs=2,
        verbose=0,
        callbacks=[TrainingCheckpoint(dirname), ResumeTraining(dirname, run=run)],
    )
    return net.fit(X, y)


@checks
def one_run_folder_written_once():
    fit(DIRNAME / "good")
    return sorted(p.name for p in (DIRNAME / "good").glob("run-*/*"))


@checks
def a_run_that_does_not_exist():
    return error_and_seconds(lambda: fit(DIRNAME / "good", run="nope"))


@checks
def an_edited_manifest():
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for manifest in (DIRNAME / "good").glob("run-*/manifest.json"):
            manifest.write_text('{"edited": true}')
    accelerator.wait_for_everyone()
    return error_and_seconds(lambda: fit(DIRNAME / "good"))


@checks
def a_folder_that_is_a_file():
    if accelerator.is_main_process:
        (DIRNAME / "afile").write_text("")
    accelerator.wait_for_everyone()
    return error_and_seconds(lambda: fit(DIRNAME / "afile"))


report({"checks": checks.results})
