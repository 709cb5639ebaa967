"""skorch's accelerate example with a DistributedHistory, unchanged but for
the import: an accelerated net in ``cross_validate``.

Usage: ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 skorch_cross_validate.py --port PORT

Each rank reports its scores (the lines after ``main()``, for the test).
"""

import argparse
import os
from datetime import timedelta

import numpy as np
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from sklearn.datasets import make_classification
from sklearn.model_selection import cross_validate
from skorch import NeuralNetClassifier
from skorch.history import DistributedHistory
from torch import nn
from torch.distributed import TCPStore

from accel_mixin import AccelerateMixin  # was: from skorch.hf import AccelerateMixin


def my_module(num_units=32):
    return nn.Sequential(
        nn.Linear(20, num_units),
        nn.ReLU(),
        nn.Linear(num_units, 2),
        nn.Softmax(dim=-1),
    )


class Net(AccelerateMixin, NeuralNetClassifier):
    pass


def main(port):
    X, y = make_classification(1000, 20, n_informative=10, random_state=0)
    X, y = X.astype(np.float32), y.astype(np.int64)

    accelerator = Accelerator(
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=60))]
    )
    # the store is made as skorch's documentation makes it
    is_master = accelerator.is_main_process
    world_size = accelerator.num_processes
    rank = accelerator.local_process_index
    store = TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        port=port,
        world_size=world_size,
        is_master=is_master,
    )
    dist_history = DistributedHistory(store=store, rank=rank, world_size=world_size)

    model = Net(
        my_module,
        accelerator=accelerator,
        max_epochs=5,
        lr=0.1,
        history=dist_history,
    )
    scores = cross_validate(model, X, y, cv=2, scoring="average_precision", error_score="raise")
    accelerator.print("average precision:", scores["test_score"])
    return accelerator, scores


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=1234)
    accelerator, scores = main(parser.parse_args().port)

    from common import report  # for the test

    report({"rank": accelerator.process_index, "test_score": scores["test_score"].tolist()})
