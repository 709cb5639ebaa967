"""A grid search with checkpoints, interrupted and rerun (``runs_interrupted.py``
runs it, in its launches' phases).

2 candidates x 2 folds and the refit. Every fit seeds its module, as a
reproducible search does, so that the fits that had not started train the
same after the crash as before it.
"""

import torch
from common import AcceleratedNet, make_data
from sklearn.model_selection import GridSearchCV
from skorch.callbacks import Callback

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

TRAINED = []  # epochs trained by each fit of the search, in order
STOP = []  # the search's resume_phases.Stop, if it is to be stopped


class SeededMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(20, 16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 2),
            torch.nn.Softmax(dim=-1),
        )

    def forward(self, X):
        return self.layers(X)


class Progress(Callback):
    """Counts the epochs each fit trains; stops the third fit when its second
    epoch begins, if the search is to be stopped. Module-level state: the
    search clones its callbacks."""

    in_run_identity = False

    def on_train_begin(self, net, **kwargs):
        TRAINED.append(0)

    def on_epoch_begin(self, net, **kwargs):
        if STOP and len(TRAINED) == 3 and len(net.history) == 2:
            STOP[0](net)
        TRAINED[-1] += 1


def search(accelerator, dirname, stop=None):
    """The search with checkpoints in ``dirname``; with ``stop``, stopped in
    its third fit (``stop(net)`` does not return)."""
    TRAINED.clear()
    STOP[:] = [stop] if stop else []
    X, y = make_data(240, seed=4, noise=0.1)
    callbacks = [Progress(), TrainingCheckpoint(dirname), ResumeTraining(dirname)]
    net = AcceleratedNet(
        SeededMLP,
        accelerator=accelerator,
        max_epochs=3,
        batch_size=16,
        verbose=0,
        iterator_train__shuffle=True,
        callbacks=callbacks,
    )
    gs = GridSearchCV(net, {"lr": [0.05, 0.2]}, cv=2, refit=True, error_score="raise")
    gs.fit(X, y)
    return {
        "cv_results": {
            key: [float(v) for v in gs.cv_results_[key]]
            for key in gs.cv_results_
            if "test_score" in key
        },
        "best_params": gs.best_params_,
        "trained": list(TRAINED),
    }
