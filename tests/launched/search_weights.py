"""A grid search over tensor-valued class weights, with and without
checkpoints (``runs_interrupted.py`` runs it).

2 candidates (criterion__weight [1, 1] and [1, 10]) x 2 folds and the refit.
The candidates differ only in the content of a tensor: before runs were
described by content, the second candidate's folds resumed the first's
finished runs and reported its scores. Every fit seeds its module and no
fit shuffles, so that the searches train alike with and without
checkpoints.
"""

import torch
from common import MLP, AcceleratedNet, make_data
from sklearn.model_selection import GridSearchCV
from skorch.callbacks import Callback

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

TRAINED = []  # epochs trained by each fit of the search, in order


class SeededMLP(MLP):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__()


class Trained(Callback):
    in_run_identity = False

    def on_train_begin(self, net, **kwargs):
        TRAINED.append(0)

    def on_epoch_begin(self, net, **kwargs):
        TRAINED[-1] += 1


def search(accelerator, dirname=None):
    """The search without checkpoints, or with them in ``dirname`` (empty
    the first time; searched again, every fit resumes its own finished run)."""
    TRAINED.clear()
    callbacks = [Trained()]
    if dirname is not None:
        callbacks += [TrainingCheckpoint(dirname), ResumeTraining(dirname)]
    X, y = make_data(240, seed=4, noise=0.1)
    net = AcceleratedNet(
        SeededMLP,
        accelerator=accelerator,
        max_epochs=3,
        batch_size=16,
        lr=0.2,
        verbose=0,
        iterator_train__shuffle=False,
        callbacks=callbacks,
    )
    weights = [torch.tensor([1.0, 1.0]), torch.tensor([1.0, 10.0])]
    gs = GridSearchCV(
        net,
        {"criterion__weight": weights},
        cv=2,
        scoring="neg_log_loss",
        refit=True,
        error_score="raise",
    )
    gs.fit(X, y)
    return {
        "test_scores": {
            key: [float(v) for v in gs.cv_results_[key]]
            for key in gs.cv_results_
            if key.endswith("test_score") and not key.startswith("rank")
        },
        "best_weight": gs.best_params_["criterion__weight"].tolist(),
        "trained": list(TRAINED),
    }
