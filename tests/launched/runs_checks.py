"""Run folders under two real processes: clear errors on every rank
(``runs_interrupted.py`` runs them after its reruns, ``run``).
"""

import warnings
from pathlib import Path

import numpy as np
import torch
from common import MLP, AcceleratedNet, error_and_seconds, make_data
from skorch.callbacks import Callback

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint


class Holding(Callback):
    """A callback whose argument may be anything, for the run identity."""

    def __init__(self, thing=None):
        self.thing = thing


class Augmenting(torch.utils.data.Dataset):
    """Rows with noise from a generator of its own, seeded with ``seed``."""

    def __init__(self, X, y, seed):
        self.X, self.y = X, y
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return self.X[i] + self.rng.normal(size=self.X.shape[1]).astype(np.float32), self.y[i]


def folders(dirname):
    return sorted(p.name for p in dirname.glob("run-*"))


def run(checks, accelerator, dirname):
    """Every check of run folders, in order, in ``dirname``."""
    root = Path(dirname)
    X, y = make_data(200)

    def fit(dirname, run=None, data=(X, y), thing=None, run_name=None):
        net = AcceleratedNet(
            MLP,
            accelerator=accelerator,
            max_epochs=2,
            verbose=0,
            callbacks=[
                Holding(thing),
                TrainingCheckpoint(dirname, run_name=run_name),
                ResumeTraining(dirname, run=run),
            ],
        )
        return net.fit(*data)

    @checks
    def one_run_folder_written_once():
        fit(root / "good")
        return sorted(p.name for p in (root / "good").glob("run-*/*"))

    @checks
    def a_run_that_does_not_exist():
        return error_and_seconds(lambda: fit(root / "good", run="nope"))

    @checks
    def a_failing_fit_leaves_no_run_folder():
        out = error_and_seconds(lambda: fit(root / "failing", run="nope"))
        return {**out, "folders": folders(root / "failing")}

    @checks
    def a_named_run_on_other_data():
        """Named 'baseline' and resumed by that name: other data is a run of its
        own, and each resumes its own run after."""
        resumed = []
        for data in [(X, y), (X + 1, y), (X + 1, y), (X, y)]:
            net = fit(root / "named", run="baseline", data=data, run_name="baseline")
            resumed.append(dict(net.callbacks_)["ResumeTraining"].resumed_from_ is not None)
        return {"resumed": resumed, "folders": folders(root / "named")}

    @checks
    def a_dataset_with_a_generator_seeded_per_rank():
        resumed = []
        for _ in range(2):
            net = fit(root / "augmenting", data=(Augmenting(X, y, accelerator.process_index), y))
            resumed.append(dict(net.callbacks_)["ResumeTraining"].resumed_from_ is not None)
        return {"resumed": resumed, "folders": folders(root / "augmenting")}

    @checks
    def an_edited_manifest():
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            for manifest in (root / "good").glob("run-*/manifest.json"):
                manifest.write_text('{"edited": true}')
        accelerator.wait_for_everyone()
        return error_and_seconds(lambda: fit(root / "good"))

    @checks
    def a_folder_that_is_a_file():
        if accelerator.is_main_process:
            (root / "afile").write_text("")
        accelerator.wait_for_everyone()
        return error_and_seconds(lambda: fit(root / "afile"))

    @checks
    def ranks_with_other_data():
        other = X.copy()
        if not accelerator.is_main_process:
            other[17, 3] += 1  # one value, far from the rows a sample would read
        return error_and_seconds(lambda: fit(root / "other_data", data=(other, y)))

    @checks
    def an_undescribable_value():
        """Each fit starts afresh in one run folder of its own, the same on
        every rank, and the main process says why."""
        folder = root / "opaque"
        fits = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                net = fit(folder, thing=object())
                fits.append(dict(net.callbacks_)["TrainingCheckpoint"].run_folder_)
        return {
            "folders": [Path(path).name for path in fits],
            "on_disk": sorted(p.name for p in folder.glob("run-*/training-state-*")),
            "warnings": [str(w.message) for w in caught if "ResumeTraining" in str(w.message)],
        }
