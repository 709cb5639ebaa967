"""N processes against one, where the data does not split into whole global
batches: every case of ``CASES`` (a dataset size in global batches,
``drop_last`` or not, accumulation 1 or 2) is fitted, and every rank reports
the weights, every epoch's train loss and train batch count.

Shuffled or not: N processes draw every epoch's order as one process does
(``shuffling.draw_orders_as_one_process``).

Usage: torchrun --nproc_per_node N shares_run.py CONFIG [CONFIG ...]

CONFIG
  ``GLOBAL_BATCH:PRECISION``; a launch fits every configuration it is given
  in turn, so that a process group's start-up is paid once.

  GLOBAL_BATCH
    The samples of one step over all processes: each of N processes takes
    ``GLOBAL_BATCH / N``, and one process all of them.
  PRECISION
    ``fp32``, ``bf16`` (autocast on CPU) or ``fp16`` emulated as in
    ``matrix.py``: torch's CPU ``GradScaler`` on an fp32 accelerator.

Every rank reports ``{CONFIG: {check: result}}``.
"""

import itertools
import sys
import warnings

import torch
from accelerate.utils import set_seed
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    accelerator_for,
    freeze_what_is_loaded,
    make_data,
    report,
)

# sizes in global batches: one sample over whole ones, one sample short of
# them, and fewer samples than one global batch
SIZES = {"one over": (3, 1), "one short": (4, -1), "under one batch": (0, 5)}
CASES = {
    f"{size}-{'shuffled' if shuffle else 'ordered'}-{'drop' if drop else 'keep'}-accum{steps}": (
        size,
        shuffle,
        drop,
        steps,
    )
    for size, shuffle, drop, steps in itertools.product(SIZES, (True, False), (False, True), (1, 2))
    # no batch at all would train: nothing to compare
    if not (drop and size == "under one batch")
}


def n_samples(size, global_batch):
    whole, extra = SIZES[size]
    return whole * global_batch + extra if whole else extra


def fit(accelerator, global_batch, precision, size, shuffle, drop, steps):
    accelerator.gradient_accumulation_steps = steps
    if precision == "fp16":  # a fresh scaler per net, as in matrix.py
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    X, y = make_data(n_samples(size, global_batch), seed=4)
    set_seed(0)
    net = AcceleratedNet(
        MLP,
        accelerator=accelerator,
        max_epochs=3,
        lr=0.5,
        batch_size=global_batch // accelerator.num_processes,
        train_split=None,
        iterator_train__shuffle=shuffle,
        iterator_train__drop_last=drop,
        verbose=0,
    )
    net.fit(X, y)
    module = net.accelerator.unwrap_model(net.module_)
    return {
        "weights": torch.cat([p.detach().flatten() for p in module.parameters()]).tolist(),
        "train_loss": net.history[:, "train_loss"],
        "train_batch_count": net.history[:, "train_batch_count"],
    }


def warned_with_a_sum(accelerator, global_batch):
    """A loss that is not a mean trains on the padded batch, as before: the
    warnings each rank gave."""
    X, y = make_data(n_samples("one over", global_batch), seed=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AcceleratedNet(
            MLP,
            accelerator=accelerator,
            max_epochs=2,
            batch_size=global_batch // accelerator.num_processes,
            criterion__reduction="sum",
            train_split=None,
            verbose=0,
        ).fit(X, y)
    return [str(w.message) for w in caught]


def fit_configuration(config):
    """Every case of ``config`` (``GLOBAL_BATCH:PRECISION``): its checks."""
    global_batch, precision = config.split(":")
    global_batch = int(global_batch)
    accelerator = accelerator_for(precision)
    checks = Checks()
    for name, case in CASES.items():

        def run(case=case):
            try:
                return fit(accelerator, global_batch, precision, *case)
            finally:
                accelerator.scaler = None

        checks.run(run, name=name)
    if precision == "fp32":
        accelerator.gradient_accumulation_steps = 1

        def sum_loss():
            return warned_with_a_sum(accelerator, global_batch)

        checks(sum_loss)
    return checks.results


def main(*configs):
    freeze_what_is_loaded()
    report({config: fit_configuration(config) for config in configs})


if __name__ == "__main__":
    main(*sys.argv[1:])
