"""Streams: the samples each rank reads, the time an epoch takes, and the
time from a resume to the first batch against the position resumed at.

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 scripts/benchmarks/streams.py --out ...

Read: one epoch of ``fit`` per kind of stream, side by side in rotating
order: a plain stream as accelerate shares it by default (the main process
reads and dispatches), a plain stream that every rank reads
(``dispatch_batches=False``), a stream that splits itself by rank, and, as the
baseline, the same samples as a ``Dataset``. Each rank counts the samples its
stream yielded.

Resume: the time from iterating a stream's training dataloader, resumed at a
position, to its first batch: through ``SplitStream`` from the position the
stream records (``state_dict``), against torchdata's ``StatefulDataLoader``
over the same stream without ``state_dict``, which goes back to the position
by reading the samples before it again. Each sample costs ``--load-us``
microseconds to read.
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from checkpoint import OursNet, Stack
from common import alternate, barrier, spin, summarize, write_result

from accel_mixin.distributed.control import coordinator_for
from accel_mixin.training.streams import SplitStream

BATCH = 32
KINDS = ("dataset", "plain, dispatched", "plain, every rank reads", "splits itself")


class Rows(torch.utils.data.IterableDataset):
    """Rows of arrays, each costing ``load_us`` to read; every rank's, or
    (``split``) the batches ``rank, rank + N, ...`` of them."""

    def __init__(self, X, y, load_us, split=False):
        self.X, self.y, self.load_us, self.split = X, y, load_us, split
        self.yielded, self.next = 0, 0

    def rows(self):
        if not self.split or not dist.is_initialized():
            return range(len(self.X))
        rank, world = dist.get_rank(), dist.get_world_size()
        return [i for i in range(len(self.X)) if (i // BATCH) % world == rank]

    def __iter__(self):
        rows = self.rows()
        for k in range(self.next, len(rows)):
            spin(self.load_us)
            self.next = k + 1
            self.yielded += 1
            yield self.X[rows[k]], self.y[rows[k]]
        self.next = 0


class SlowRows(torch.utils.data.Dataset):
    """The same rows as a Dataset, each costing ``load_us`` to read."""

    def __init__(self, X, y, load_us):
        self.X, self.y, self.load_us, self.yielded = X, y, load_us, 0

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        spin(self.load_us)
        self.yielded += 1
        return self.X[i], self.y[i]


class Positioned(Rows):
    """``Rows`` that gives and takes its position."""

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def fresh(**config):
    AcceleratorState._reset_state()  # pylint: disable=protected-access
    GradientState._reset_state()  # pylint: disable=protected-access
    return Accelerator(dataloader_config=DataLoaderConfiguration(**config))


def read(args):
    X = np.random.RandomState(0).randn(args.samples, 100).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    yielded = {}

    def measure(kind):
        config = {"dispatch_batches": False} if kind == "plain, every rank reads" else {}
        accelerator = fresh(**config)
        if kind == "dataset":
            stream = SlowRows(X, y, args.load_us)
        else:
            stream = Rows(X, y, args.load_us, split=kind == "splits itself")
        net = OursNet(
            Stack,
            module__width=args.width,
            module__depth=args.depth,
            accelerator=accelerator,
            max_epochs=1,
            batch_size=BATCH,
            verbose=0,
            train_split=None,
        )
        barrier()
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net.fit(stream, None)
        seconds = time.perf_counter() - start
        yielded[kind] = stream.yielded
        return seconds

    times = alternate(KINDS, args.repeats, measure)
    return times, yielded


def resume(args):
    """On every rank alike; the main process's times are kept."""
    accelerator = fresh()
    control = coordinator_for(accelerator)
    X = np.random.RandomState(0).randn(BATCH * (max(args.positions) + 1), 100)
    X = X.astype(np.float32)
    y = np.zeros(len(X), dtype=np.int64)

    def stopped_at(loader, position):
        """``loader`` after ``position`` batches, and its state."""
        batches = iter(loader)
        for _ in range(position):
            next(batches)
        state = loader.state_dict()
        batches.close() if hasattr(batches, "close") else None
        return state

    def measure(variant):
        how, position = variant
        if how == "recorded":

            def make():
                loader = StatefulDataLoader(Positioned(X, y, args.load_us), batch_size=BATCH)
                return SplitStream(loader, accelerator, control)
        else:

            def make():
                return StatefulDataLoader(Rows(X, y, args.load_us), batch_size=BATCH)

        stream, state = make(), stopped_at(make(), position)
        if position:
            stream.load_state_dict(state)
        barrier()
        start = time.perf_counter()
        next(iter(stream))
        return time.perf_counter() - start

    variants = [(how, p) for how in ("recorded", "read again") for p in args.positions]
    times = alternate(variants, args.repeats, measure)
    return {f"{how} {p}": values for (how, p), values in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--samples", type=int, default=12800)
    parser.add_argument("--positions", type=int, nargs="+", default=[0, 100, 300, 390])
    parser.add_argument("--load-us", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    times, yielded = read(args)
    gathered = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, yielded)
    else:
        gathered = [yielded]
    first = resume(args)
    write_result(
        args.out,
        {
            "processes": len(gathered),
            "samples": args.samples,
            "batch_size": BATCH,
            "load_us": args.load_us,
            "positions": args.positions,
            "epoch_s": summarize(times, "dataset"),
            "read_by_rank": {kind: [rank[kind] for rank in gathered] for kind in KINDS},
            "first_batch_s": summarize(first, f"recorded {max(args.positions)}"),
        },
    )


if __name__ == "__main__":
    main()
