"""Inside an epoch: the stall of a training state saved there, and the time
from a restart to the first trained batch against the batches skipped.

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 scripts/benchmarks/midepoch.py --out ...

Stall: one epoch of ``fit`` with ``TrainingCheckpoint(every_n_batches=k)``,
synchronous and asynchronous; the time each save blocks training, on rank 0.

Skip: the time from iterating a prepared, shuffled dataloader to its first
batch when the first ``k`` batches are skipped: by their indices
(``resumed_order.skipping_batches``, what a resumed epoch does) against loading
and dropping them, the baseline of a resume that reads what it skips. Each
sample costs ``--load-us`` microseconds to load.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from checkpoint import OursNet, Stack, n_params
from common import alternate, barrier, spin, write_result

from accel_mixin.callbacks import TrainingCheckpoint
from accel_mixin.training.resumed_order import skipping_batches


class TimedCheckpoint(TrainingCheckpoint):
    """Records how long each save inside an epoch blocks training."""

    def initialize(self):
        super().initialize()
        self.stalls_ = []
        return self

    def _save(self, net, epoch, batch, asynchronous, stopped=False):
        start = time.perf_counter()
        super()._save(net, epoch, batch, asynchronous, stopped)
        if batch:
            self.stalls_.append(time.perf_counter() - start)


class SlowDataset(torch.utils.data.Dataset):
    def __init__(self, n, load_us):
        self.X = torch.randn(n, 100)
        self.load_us = load_us

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        spin(self.load_us)
        return self.X[i]


def stalls(accelerator, args):
    X = np.random.RandomState(0).randn(args.samples, 100).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    out = {}
    for name in ("synchronous", "asynchronous"):
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = TimedCheckpoint(
                tmp,
                every_n_epochs=100,
                every_n_batches=args.every,
                asynchronous=name == "asynchronous",
                keep_last=1,
            )
            net = OursNet(
                Stack,
                module__width=args.width,
                module__depth=args.depth,
                accelerator=accelerator,
                max_epochs=1,
                batch_size=32,
                verbose=0,
                train_split=None,
                callbacks=[checkpoint],
            )
            net.fit(X, y)
            out[name] = checkpoint.stalls_
            params = n_params(net.module_)
    return out, params


def time_to_first_batch(accelerator, args):
    dataset = SlowDataset(32 * accelerator.num_processes * (max(args.skips) + 1), args.load_us)
    loader = accelerator.prepare_data_loader(
        torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)
    )

    def measure(variant):
        how, skip = variant
        barrier()
        start = time.perf_counter()
        if how == "indices":
            with skipping_batches(loader, skip):
                batches = iter(loader)
                next(batches)
        else:
            batches = iter(loader)
            for _ in range(skip + 1):
                next(batches)
        seconds = time.perf_counter() - start
        del batches
        return seconds

    variants = [(how, skip) for how in ("indices", "loaded") for skip in args.skips]
    times = alternate(variants, args.repeats, measure)
    return {f"{how} {skip}": values for (how, skip), values in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--samples", type=int, default=3200)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--skips", type=int, nargs="+", default=[0, 30, 300, 1000])
    parser.add_argument("--load-us", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    accelerator = Accelerator()
    saves, params = stalls(accelerator, args)
    skips = time_to_first_batch(accelerator, args)
    write_result(
        args.out,
        {
            "benchmark": "midepoch",
            "processes": accelerator.num_processes,
            "params": params,
            "every_n_batches": args.every,
            "stall_s": {
                name: {"median_s": statistics.median(values), "runs_s": values}
                for name, values in saves.items()
            },
            "load_us": args.load_us,
            "first_batch_s": {
                name: {"median_s": statistics.median(values), "runs_s": values}
                for name, values in skips.items()
            },
            "skips": args.skips,
        },
    )


if __name__ == "__main__":
    main()
