"""A grid search with checkpoints, run the ways an interrupted search is tested.

Usage: search_run.py MODE DIRNAME
  full    the whole search in one go
  crash   the same search, killed when the third fit's second epoch begins
  rerun   the same script again: finished fits resume finished, the third
          resumes where it was, the rest train

2 candidates x 2 folds and the refit. Every fit seeds its module, as a
reproducible search does, so that the fits that had not started train the
same after the crash as before it.
"""

import os
import sys

import torch
from common import AcceleratedNet, make_accelerator, make_data, report
from sklearn.model_selection import GridSearchCV
from skorch.callbacks import Callback

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

MODE, DIRNAME = sys.argv[1], sys.argv[2]
TRAINED = []  # epochs trained by each fit of this process, in order


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
    """Counts the epochs each fit trains; in 'crash' mode, dies in the third fit."""

    in_run_identity = False

    def on_train_begin(self, net, **kwargs):
        TRAINED.append(0)

    def on_epoch_begin(self, net, **kwargs):
        if MODE == "crash" and len(TRAINED) == 3 and len(net.history) == 2:
            net.wait_for_saves()
            os._exit(3)  # pylint: disable=protected-access
        TRAINED[-1] += 1


accelerator = make_accelerator()
X, y = make_data(240, seed=4, noise=0.1)
callbacks = [Progress(), TrainingCheckpoint(DIRNAME), ResumeTraining(DIRNAME)]
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

report(
    {
        "cv_results": {
            key: [float(v) for v in gs.cv_results_[key]]
            for key in gs.cv_results_
            if "test_score" in key
        },
        "best_params": gs.best_params_,
        "trained": TRAINED,
    }
)
