"""Shared pieces of the scripts that tests launch under several processes."""

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from skorch import NeuralNetClassifier
from skorch.hf import AccelerateMixin as IncumbentMixin

from accel_mixin import AccelerateMixin

__all__ = [
    "MLP",
    "AcceleratedNet",
    "Checks",
    "DropoutMLP",
    "IncumbentNet",
    "LogitMLP",
    "ParamNLLLoss",
    "TwoStageNet",
    "error_and_seconds",
    "make_accelerator",
    "make_data",
    "report",
]


class AcceleratedNet(AccelerateMixin, NeuralNetClassifier):
    """Ours."""


class IncumbentNet(IncumbentMixin, NeuralNetClassifier):
    """skorch.hf.AccelerateMixin, to show the defects we fix."""


class TwoStageNet(AcceleratedNet):
    """Two modules in the forward pass: ``module_`` then ``module2_``."""

    def initialize_module(self):
        super().initialize_module()
        self.module2_ = torch.nn.Linear(2, 2)
        return self

    def infer(self, x, **fit_params):
        return torch.softmax(self.module2_(super().infer(x, **fit_params)), dim=-1)


def make_accelerator(**kwargs):
    """An Accelerator whose collectives give up after 30 s instead of 30 min."""
    handlers = kwargs.pop("kwargs_handlers", [])
    handlers.append(InitProcessGroupKwargs(timeout=timedelta(seconds=30)))
    return Accelerator(kwargs_handlers=handlers, **kwargs)


def make_data(n=600, n_features=20, seed=0, noise=0.0):
    """A classification problem, the same on every rank."""
    from sklearn.datasets import make_classification

    X, y = make_classification(n, n_features, n_informative=10, random_state=seed, flip_y=noise)
    return X.astype(np.float32), y.astype(np.int64)


class DropoutMLP(torch.nn.Module):
    """Outputs probabilities; dropout draws from the random number generators."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(20, 32),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(32, 2),
            torch.nn.Softmax(dim=-1),
        )

    def forward(self, X):
        return self.layers(X)


class MLP(torch.nn.Module):
    """Outputs probabilities, for skorch's default NLLLoss."""

    def __init__(self, n_features=20, hidden=32, n_classes=2):
        super().__init__()
        self.hidden = torch.nn.Linear(n_features, hidden)
        self.out = torch.nn.Linear(hidden, n_classes)

    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.hidden(X))), dim=-1)


class LogitMLP(MLP):
    """Outputs logits, for CrossEntropyLoss."""

    def forward(self, X):
        return self.out(torch.relu(self.hidden(X)))


class ParamNLLLoss(torch.nn.NLLLoss):
    """The user-side workaround that lets the incumbent fit in several
    processes: a criterion with a trainable parameter, so that DDP accepts it.
    Not needed with accel_mixin."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, y_pred, y_true):
        return super().forward(torch.log(y_pred + 1e-7), y_true) + 0.0 * self.dummy.sum()


def _rank():
    return int(os.environ.get("RANK", "0"))


def report(payload):
    """Write this rank's results for the test to read."""
    out = Path(os.environ.get("ACCEL_RESULTS_DIR", "."))
    tmp = out / f"rank{_rank()}.json.tmp"
    tmp.write_text(json.dumps(payload, default=str))
    os.replace(tmp, out / f"rank{_rank()}.json")
    # as a script ends with accelerator.end_training()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def error_and_seconds(fn):
    """What ``fn`` raised on this rank (None if nothing), and how long it took."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # pylint: disable=broad-except
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


class Checks:
    """Named checks run in order on every rank; each records a value or error.

    Every rank runs every check, so collectives stay in step as long as a
    check fails alike on all ranks.
    """

    def __init__(self):
        self.results = {}

    def __call__(self, fn):
        start = time.monotonic()
        try:
            self.results[fn.__name__] = {"ok": True, "value": fn()}
        except Exception as exc:  # pylint: disable=broad-except
            traceback.print_exc(file=sys.stdout)
            self.results[fn.__name__] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        self.results[fn.__name__]["check_seconds"] = time.monotonic() - start
        return fn
