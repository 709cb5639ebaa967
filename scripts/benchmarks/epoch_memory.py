"""Memory and time of an epoch's end against the validation size.

    python scripts/benchmarks/epoch_memory.py --valid 100000 --out ...   # plain skorch
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 \\
        scripts/benchmarks/epoch_memory.py --valid 100000 --out ...      # accel_mixin

One epoch of a linear model with 100 classes on 2,000 training samples and a
predefined validation set, scored by the classifier's ``valid_acc``
(``EpochScoring("accuracy")``, cached predictions). Each rank samples its
resident memory every 5 ms during ``fit``; the result is the peak's growth
over the memory just before ``fit``, per rank, and how long the epoch's end
(``notify("on_epoch_end")``, the exchange included) took on each rank.

``--everywhere`` gives ``valid_acc`` the whole predictions on every rank
(``predictions_on_every_rank = True``), the cost of that choice.
``--records B`` instead times the merge of ``B`` batch records, spread over
the ranks as an epoch of ``B`` batches spreads them.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import EpochScoring
from skorch.dataset import Dataset
from skorch.helper import predefined_split

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from common import PeakRSS, write_result


class Linear(torch.nn.Module):
    def __init__(self, features, classes):
        super().__init__()
        self.linear = torch.nn.Linear(features, classes)

    def forward(self, X):
        return torch.softmax(self.linear(X), dim=-1)


class TimesEpochEnd:
    """Records how long ``notify("on_epoch_end")`` takes."""

    def notify(self, method_name, **cb_kwargs):
        if method_name != "on_epoch_end":
            return super().notify(method_name, **cb_kwargs)
        start = time.perf_counter()
        try:
            return super().notify(method_name, **cb_kwargs)
        finally:
            self.epoch_end_s_ = time.perf_counter() - start


class PlainNet(TimesEpochEnd, NeuralNetClassifier):
    pass


class EverywhereScoring(EpochScoring):
    """The whole predictions on every rank, each scoring them (as before
    accel_mixin scored once, on the main process)."""

    predictions_on_every_rank = True


def data(n, features, classes, seed):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, features), dtype=np.float32)
    return X, rng.integers(0, classes, n).astype(np.int64)


def fit_once(args):
    X, y = data(args.train, args.features, args.classes, 0)
    Xv, yv = data(args.valid, args.features, args.classes, 1)
    common = dict(
        max_epochs=1,
        lr=0.1,
        batch_size=args.batch_size,
        train_split=predefined_split(Dataset(Xv, yv)),
        module__features=args.features,
        module__classes=args.classes,
        verbose=0,
    )
    if args.distributed:
        from accelerate import Accelerator  # pylint: disable=import-outside-toplevel

        from accel_mixin import AccelerateMixin  # pylint: disable=import-outside-toplevel

        class OursNet(TimesEpochEnd, AccelerateMixin, NeuralNetClassifier):
            pass

        if args.everywhere:
            common["callbacks__valid_acc"] = EverywhereScoring(
                "accuracy", name="valid_acc", lower_is_better=False
            )
        net = OursNet(Linear, accelerator=Accelerator(), **common)
    else:
        net = PlainNet(Linear, **common)
    with PeakRSS() as sampled:
        net.fit(X, y)
    return {
        "peak_growth_mb": sampled.growth / 2**20,
        "epoch_end_s": net.epoch_end_s_,
        "valid_acc": float(net.history[-1, "valid_acc"]),
    }


def merge_records(args, rank, world, gather):
    """Time the merge of an epoch of ``args.records`` batch records."""
    from types import SimpleNamespace  # pylint: disable=import-outside-toplevel

    from skorch.history import History  # pylint: disable=import-outside-toplevel

    from accel_mixin.distributed.history_sync import merge_epoch  # pylint: disable=import-outside-toplevel

    history = History()
    history.new_epoch()
    mine = range(rank, args.records, world)
    for i in mine:
        history.new_batch()
        history.record_batch("train_loss", 1.0 / (i + 1))
        history.record_batch("train_batch_size", 128)
    history.record("train_batch_count", len(mine))
    net = SimpleNamespace(history=history, callbacks_=[], use_caching="auto")
    torch.distributed.barrier()
    with PeakRSS() as sampled:
        start, cpu = time.perf_counter(), time.thread_time()
        merge_epoch(net, gather)
        seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
    merged = len(history[-1]["batches"])
    assert merged == args.records, (merged, args.records)
    return {"merge_s": seconds, "merge_cpu_s": cpu, "merge_growth_mb": sampled.growth / 2**20}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--valid", type=int, default=100_000)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--records", type=int, default=0)
    parser.add_argument(
        "--everywhere", action="store_true", help="valid_acc with predictions_on_every_rank"
    )
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.distributed = "WORLD_SIZE" in os.environ
    if args.records:
        from accelerate import Accelerator  # pylint: disable=import-outside-toplevel

        from accel_mixin.distributed.control import coordinator_for  # pylint: disable=import-outside-toplevel

        # the process group, the state and the coordinator, as a net makes them
        gather = coordinator_for(Accelerator()).gather
        result = merge_records(args, torch.distributed.get_rank(), world, gather)
    else:
        result = fit_once(args)
    ranks = [result]
    if args.distributed:
        ranks = [None] * world
        torch.distributed.all_gather_object(ranks, result)
    payload = {"processes": world if args.distributed else 1, "ranks": ranks, **vars(args)}
    write_result(args.out, payload)


if __name__ == "__main__":
    main()
