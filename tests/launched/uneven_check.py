"""Uneven batches (DataLoaderConfiguration(even_batches=False)): ranks get
different numbers of batches. Validation must go on, training that DDP cannot
keep in step must fail fast and clearly, never hang.

Run by sync_checks.py in its launch (``add_checks``), or alone:
torchrun --nproc_per_node 2 uneven_check.py
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

X, y = make_data(104)
valid = Dataset(X[64:], y[64:])  # 40 samples: batches of 16, 16 and 8, two on rank 0


def make_net():
    return AcceleratedNet(
        MLP,
        # an accelerator of its own beside the launch's: the setting is its own
        accelerator=make_accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False)),
        max_epochs=2,
        batch_size=16,
        verbose=0,
        train_split=predefined_split(valid),
    )


def uneven_validation():
    net = make_net().fit(X[:64], y[:64])  # 4 training batches: 2 per rank
    return {
        "rows": [{k: v for k, v in row.items() if k != "dur"} for row in net.history],
        "valid_samples": [
            sum(b.get("valid_batch_size", 0) for b in row["batches"]) for row in net.history
        ],
    }


def uneven_training():
    return error_and_seconds(lambda: make_net().fit(X[:48], y[:48]))  # 3 batches


def add_checks(checks):
    """Run this script's checks as ``checks`` of the launch that imports it."""
    checks(uneven_validation)
    checks(uneven_training)


if __name__ == "__main__":
    checks = Checks()
    add_checks(checks)
    report({"checks": checks.results})
