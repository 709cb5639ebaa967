"""Epoch scores computed on the main process from cached predictions sent to
it alone; the other ranks keep their own share.

Usage: torchrun --nproc_per_node 3 epoch_scores_checks.py
"""

import pickle

import numpy as np
import torch
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    error_and_seconds,
    make_accelerator,
    make_data,
    report,
)
from sklearn.metrics import accuracy_score
from skorch.callbacks import Callback, Checkpoint, EpochScoring
from skorch.callbacks.scoring import ScoringBase
from skorch.dataset import Dataset
from skorch.helper import predefined_split

accelerator = make_accelerator()
rank, world = accelerator.process_index, accelerator.num_processes
X, y = make_data(400, seed=3)
# 310 = 6 steps of 3 x 16, then 16, 6 and no real samples: rank 2's last batch is padding alone
X_valid, y_valid = make_data(310, seed=4)
checks = Checks()
CALLS = []  # (callback name, rows it scored) on this rank


def counting(name):
    def accuracy(net, X, y):
        proba = net.predict_proba(X)
        CALLS.append((name, len(proba)))
        return accuracy_score(y, proba.argmax(1))

    return accuracy


class OwnEpochEnd(EpochScoring):
    """Overrides on_epoch_end: it may read the predictions its own way."""

    def on_epoch_end(self, net, **kwargs):
        super().on_epoch_end(net, **kwargs)


def make_net(net_cls=AcceleratedNet, **kwargs):
    params = dict(
        module=MLP,
        accelerator=accelerator,
        max_epochs=2,
        lr=0.3,
        batch_size=16,
        verbose=0,
        train_split=predefined_split(Dataset(X_valid, y_valid)),
    )
    params.update(kwargs)
    return net_cls(**params)


class Probe(Callback):
    """Keeps the scorers' caches as the epoch's end left them (skorch clears
    them when training ends)."""

    def __init__(self, *names):
        self.names = names

    def on_epoch_end(self, net, **kwargs):
        callbacks = dict(net.callbacks_)
        self.caches_ = {
            name: (callbacks[name].y_preds_, callbacks[name].y_trues_) for name in self.names
        }


def rows(preds):
    return sum(len(p[0] if isinstance(p, tuple) else p) for p in preds)


@checks
def scored_once_on_main():
    CALLS.clear()
    everywhere = EpochScoring(counting("everywhere"), name="everywhere", lower_is_better=False)
    everywhere.predictions_on_every_rank = True
    net = make_net(
        callbacks=[
            ("on_main", EpochScoring(counting("on_main"), name="on_main", lower_is_better=False)),
            ("everywhere", everywhere),
            ("own", OwnEpochEnd(counting("own"), name="own", lower_is_better=False)),
            # the net's use_caching wins over the callback's
            (
                "net_caches",
                EpochScoring(counting("net_caches"), name="net_caches", use_caching=False),
            ),
            ("probe", Probe("on_main", "everywhere", "own", "net_caches")),
        ],
        use_caching=True,
    )
    net.fit(X, y)
    caches = dict(net.callbacks_)["probe"].caches_
    proba = net.predict_proba(X_valid)
    cached = torch.cat(caches["on_main"][0]).numpy()
    truth = torch.cat(caches["on_main"][1]).numpy()
    main = rank == 0
    return {
        "calls": CALLS,
        "rows": {name: rows(preds) for name, (preds, _) in caches.items()},
        "scores": {k: net.history[-1, k] for k in ("on_main", "everywhere", "own", "net_caches")},
        "best": net.history[:, "on_main_best"],
        "accuracy": accuracy_score(y_valid, proba.argmax(1)),
        "cached_is_predict_proba": bool(main and np.allclose(cached, proba, atol=1e-6)),
        "cached_targets_in_order": bool(main and np.array_equal(truth, y_valid)),
    }


class Outputs(MLP):
    """Returns a tuple: probabilities, a bfloat16 and a boolean tensor in a
    dict, and a 0-d tensor."""

    def forward(self, X):
        proba = super().forward(X)
        extra = {"half": proba.to(torch.bfloat16), "flag": proba[:, 0] > 0.5}
        return proba, extra, torch.tensor(float(len(X)))


class TupleNet(AcceleratedNet):
    def get_loss(self, y_pred, y_true, *args, **kwargs):
        return super().get_loss(y_pred[0], y_true, *args, **kwargs)


@checks
def nested_outputs():
    net = make_net(
        TupleNet, module=Outputs, max_epochs=1, callbacks=[("probe", Probe("valid_acc"))]
    )
    net.fit(X, y)
    preds = dict(net.callbacks_)["probe"].caches_["valid_acc"][0]
    proba = net.predict_proba(X_valid)
    first = preds[0]
    kinds = [type(first).__name__, str(first[1]["half"].dtype), str(first[1]["flag"].dtype)]
    halves = torch.cat([p[1]["half"] for p in preds]).float().numpy()
    return {
        "kinds": kinds,
        "sizes": [float(p[2]) for p in preds],
        "score": net.history[-1, "valid_acc"],
        "accuracy": accuracy_score(y_valid, proba.argmax(1)),
        "halves_match": bool(rank != 0 or np.allclose(halves, proba, atol=1e-2)),
    }


class Wide(MLP):
    """Returns its input repeated besides: batches of more than 1 MB, which
    travel as messages of their own."""

    def forward(self, X):
        return super().forward(X), X.repeat(1, 1000)


@checks
def wide_outputs():
    net = make_net(TupleNet, module=Wide, max_epochs=1, callbacks=[("probe", Probe("valid_acc"))])
    net.fit(X, y)
    preds = dict(net.callbacks_)["probe"].caches_["valid_acc"][0]
    inputs = torch.cat([p[1][:, :20] for p in preds]).numpy()
    return {
        "batch_bytes": preds[0][1].numel() * 4,
        "inputs_in_order": bool(rank != 0 or np.array_equal(inputs, X_valid)),
        "score": net.history[-1, "valid_acc"],
    }


def failing(net, X, y):
    raise ValueError("bad scorer")


class After(Callback):
    """After the failing scorer: whether this rank went on past it."""

    def on_epoch_end(self, net, **kwargs):
        self.ran_ = True


@checks
def scorer_error_reaches_every_rank():
    net = make_net(
        callbacks=[("failing", EpochScoring(failing, name="failing")), ("after", After())]
    )
    result = error_and_seconds(lambda: net.fit(X, y))
    result["went_on"] = getattr(dict(net.callbacks_)["after"], "ran_", False)
    return result


class Looks(Callback):
    """At its turn, after the scorers and a Checkpoint: whether EpochScoring
    scores as skorch wrote it."""

    def on_epoch_end(self, net, **kwargs):
        self.seen_ = getattr(self, "seen_", []) + [EpochScoring._scoring is ScoringBase._scoring]


@checks
def nothing_replaced_to_record_scores():
    # the net pickled at every epoch's end, after the scorers
    checkpoint = Checkpoint(
        monitor=None,
        f_params=None,
        f_optimizer=None,
        f_criterion=None,
        f_history=None,
        f_pickle="scored_net.pkl",
    )
    net = make_net(callbacks=[("checkpoint", checkpoint), ("looks", Looks())])
    net.fit(X, y)
    result = {"skorch_scoring": dict(net.callbacks_)["looks"].seen_}
    if rank == 0:
        with open(checkpoint.f_pickle, "rb") as f:
            pickled = dict(pickle.load(f).callbacks_)["valid_acc"]
        # what skorch gives a scorer when training begins
        fresh = EpochScoring("accuracy", name="valid_acc", lower_is_better=False).initialize()
        fresh.on_train_begin(net, X, y)
        result["pickled"] = [type(pickled).__name__, sorted(vars(pickled))]
        result["skorch_s"] = ["EpochScoring", sorted(vars(fresh))]
    return result


report({"rank": rank, "world": world, "checks": checks.results})
