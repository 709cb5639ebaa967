"""Uneven batches (DataLoaderConfiguration(even_batches=False)): ranks get
different numbers of batches. Validation must go on, training that DDP cannot
keep in step must fail fast and clearly, never hang.

Usage: torchrun --nproc_per_node 2 uneven_check.py
"""

from accelerate.utils import DataLoaderConfiguration
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    error_and_seconds,
    make_accelerator,
    make_data,
    report,
)
from skorch.dataset import Dataset
from skorch.helper import predefined_split

accelerator = make_accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
X, y = make_data(104)
valid = Dataset(X[64:], y[64:])  # 40 samples: batches of 16, 16 and 8, two on rank 0
checks = Checks()


def make_net():
    return AcceleratedNet(
        MLP,
        accelerator=accelerator,
        max_epochs=2,
        batch_size=16,
        verbose=0,
        train_split=predefined_split(valid),
    )


@checks
def uneven_validation():
    net = make_net().fit(X[:64], y[:64])  # 4 training batches: 2 per rank
    return {
        "rows": [{k: v for k, v in row.items() if k != "dur"} for row in net.history],
        "valid_samples": [
            sum(b.get("valid_batch_size", 0) for b in row["batches"]) for row in net.history
        ],
    }


@checks
def uneven_training():
    return error_and_seconds(lambda: make_net().fit(X[:48], y[:48]))  # 3 batches


report({"checks": checks.results})
