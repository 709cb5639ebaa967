"""A grid search whose candidates score apart, to compare ranks and layouts.

Usage: search_scores.py BATCH_SIZE

``core_checks.py`` runs the search of several processes in its launch
(``search``).

Run under 2 processes with batch b and under 1 with batch 2 b, the two
searches train alike, to float32 rounding: DDP averages the gradients of two
mean-reduced halves of each batch of 2 b (accelerate gives a process every
other batch of b, in order). What that takes here: no shuffling, no
dropout, skorch's NLLLoss (a mean over the batch), every fit's module seeded
alike, and training sets of whole batches of 2 b = 32, so that no process
pads one: 2 folds of 240 samples leave 120 to train on, of which skorch's
ValidSplit(5) holds out 24 (96 = 3 x 32), and the refit trains on 192.

The score is the log loss, which every candidate's training changes, where
the accuracy of a small problem might not show a difference. Every rank
reports its own search.
"""

import sys

import torch
from common import MLP, AcceleratedNet, make_accelerator, make_data, report
from sklearn.model_selection import GridSearchCV

LRS = [0.02, 0.1, 0.5]


class SeededMLP(MLP):
    """Every fit starts from the same weights, in every layout."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__()


def search(batch_size):
    """The search with ``batch_size`` per process: what every rank reports."""
    X, y = make_data(240, seed=4, noise=0.1)
    net = AcceleratedNet(
        SeededMLP,
        accelerator=make_accelerator(),
        max_epochs=4,
        batch_size=batch_size,
        verbose=0,
        iterator_train__shuffle=False,
    )
    gs = GridSearchCV(
        net, {"lr": LRS}, cv=2, scoring="neg_log_loss", refit=True, error_score="raise"
    )
    gs.fit(X, y)
    return {
        "num_processes": net.accelerator.num_processes,
        "test_scores": {
            key: [float(v) for v in gs.cv_results_[key]]
            for key in gs.cv_results_
            if key.endswith("test_score") and not key.startswith("rank")
        },
        "best_params": gs.best_params_,
        "best_score": float(gs.best_score_),
        "refit_proba": gs.predict_proba(X).tolist(),
    }


if __name__ == "__main__":
    report(search(int(sys.argv[1])))
