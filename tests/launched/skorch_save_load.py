"""skorch's accelerate example of saving and loading, unchanged but for the
import: fit an accelerated net with a DistributedHistory, save it with
``save_params``, load it into a fresh accelerated net and into a plain
``NeuralNetClassifier``, with ``unwrap_after_train`` True and False; the
accuracies must be equal.

Usage: ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 skorch_save_load.py --port PORT

Each rank reports its accuracies (the lines after ``main()``, for the test).
"""

import argparse
import os
from datetime import timedelta

import numpy as np
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from sklearn.datasets import make_classification
from sklearn.metrics import accuracy_score
from sklearn.model_selection import train_test_split
from skorch import NeuralNetClassifier
from skorch.history import DistributedHistory
from torch import nn
from torch.distributed import TCPStore

from accel_mixin import AccelerateMixin  # was: from skorch.hf import AccelerateMixin


class MyModule(nn.Module):
    def __init__(self, num_units=32, nonlin=nn.ReLU):
        super().__init__()
        self.dense0 = nn.Linear(20, num_units)
        self.nonlin = nonlin()
        self.dropout = nn.Dropout(0.5)
        self.dense1 = nn.Linear(num_units, 10)
        self.output = nn.Linear(10, 2)

    def forward(self, X):
        X = self.nonlin(self.dense0(X))
        X = self.dropout(X)
        X = self.nonlin(self.dense1(X))
        return self.output(X)


class Net(AccelerateMixin, NeuralNetClassifier):
    pass


def train_save_load(accelerator, store, unwrap_after_train, X_train, X_test, y_train, y_test):
    def dist_history():
        return DistributedHistory(
            store=store,
            rank=accelerator.local_process_index,
            world_size=accelerator.num_processes,
        )

    def make_model():
        return Net(
            MyModule,
            criterion=nn.CrossEntropyLoss,
            accelerator=accelerator,
            max_epochs=5,
            lr=0.1,
            unwrap_after_train=unwrap_after_train,
            history=dist_history(),
        )

    files = {
        "f_params": f"params_{unwrap_after_train}.pt",
        "f_optimizer": f"optimizer_{unwrap_after_train}.pt",
        "f_history": f"history_{unwrap_after_train}.json",
    }

    model = make_model()
    model.fit(X_train, y_train)
    accuracy_before = accuracy_score(y_test, model.predict(X_test))
    model.save_params(**files)

    # a fresh accelerated net, with its own DistributedHistory
    loaded = make_model()
    loaded.initialize()
    loaded.load_params(**files)
    accuracy_loaded = accuracy_score(y_test, loaded.predict(X_test))

    # a plain skorch net, without accelerate
    plain = NeuralNetClassifier(MyModule, criterion=nn.CrossEntropyLoss, max_epochs=5, lr=0.1)
    plain.initialize()
    plain.load_params(f_params=files["f_params"])
    accuracy_plain = accuracy_score(y_test, plain.predict(X_test))

    accelerator.print(
        f"unwrap_after_train={unwrap_after_train}: accuracy {accuracy_before:.4f} "
        f"(after loading: {accuracy_loaded:.4f}, plain skorch: {accuracy_plain:.4f})"
    )
    assert accuracy_before == accuracy_loaded == accuracy_plain
    return {
        "before": accuracy_before,
        "loaded": accuracy_loaded,
        "plain": accuracy_plain,
        "epochs_loaded": len(loaded.history),
    }


def main(port):
    X, y = make_classification(1000, 20, n_informative=10, random_state=0)
    X, y = X.astype(np.float32), y.astype(np.int64)
    X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=0)

    accelerator = Accelerator(
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=60))]
    )
    store = TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        port=port,
        world_size=accelerator.num_processes,
        is_master=accelerator.is_main_process,
    )
    results = {
        str(unwrap): train_save_load(accelerator, store, unwrap, X_train, X_test, y_train, y_test)
        for unwrap in (True, False)
    }
    return accelerator, results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=1234)
    accelerator, results = main(parser.parse_args().port)

    from common import report  # for the test

    report({"rank": accelerator.process_index, "accuracies": results})
