"""Streams (``IterableDataset``) on several processes, against one process.

Usage: torchrun --nproc_per_node N streams_run.py DIRNAME
       python streams_run.py alone        (one process: the reference)

Every case fits a stream of ``make_data`` samples in order; one process fits
the same samples as a Dataset, unshuffled, with the global batch. A plain
stream yields every sample on every rank; ``BlockSplit`` splits itself by
rank as ``split_dataset_by_node`` does, rank ``r`` taking the batches
``r, r + N, ...``, so that each step trains on the global batch one process
takes. Every rank reports, per case, the weights, each epoch's train loss
and batch count, the samples its stream yielded in the last fit, and what
was raised. ``resumes`` stops fits of streams that keep a position inside
an epoch, and resumes them with a new net, in ``DIRNAME``.
"""

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import DataLoaderConfiguration
from accelerate.utils import set_seed
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    freeze_what_is_loaded,
    fresh_state,
    make_accelerator,
    make_data,
    make_fsdp_accelerator,
    outcome,
    report,
)
from skorch.callbacks import Callback

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

BATCH = 8  # per process
# samples in global batches of 2 processes: whole ones, and a partial last
# one that leaves rank 1's stream a batch short
SIZES = {"whole": 4 * 2 * BATCH, "partial": 3 * 2 * BATCH + 5}
ACCUMULATION = (1, 2)
CASES = [f"{size}-accum{steps}" for size in SIZES for steps in ACCUMULATION]


def _split():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Plain(torch.utils.data.IterableDataset):
    """Every sample, on every rank; counts what it yields."""

    def __init__(self, X, y):
        self.X, self.y, self.yielded = X, y, 0

    def rows(self):
        return range(len(self.X))

    def __iter__(self):
        for i in self.rows():
            self.yielded += 1
            yield self.X[i], self.y[i]


class BlockSplit(Plain):
    """Rank r's share: the batches r, r + N, ... of the data."""

    def rows(self):
        rank, world = _split()
        return [i for i in range(len(self.X)) if (i // BATCH) % world == rank]


class Positioned(Plain):
    """A plain stream, or ``BlockSplit``'s share (``split``), that gives and
    takes its position; counts what it yields."""

    def __init__(self, X, y, split=False):
        super().__init__(X, y)
        self.split, self.next = split, 0

    def rows(self):
        if self.split == "uneven":  # rank 1 the batches 3, 7, ...; rank 0 the others
            rank, _ = _split()
            return [i for i in range(len(self.X)) if ((i // BATCH) % 4 == 3) == (rank == 1)]
        return BlockSplit.rows(self) if self.split else super().rows()

    def __iter__(self):
        rows = list(self.rows())
        for k in range(self.next, len(rows)):
            self.next = k + 1
            self.yielded += 1
            yield self.X[rows[k]], self.y[rows[k]]
        self.next = 0

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


class Stop(Exception):
    """Ends a fit, on every rank at the same batch."""


class StopAt(Callback):
    """Raises ``Stop`` after training batch ``batch`` of epoch ``epoch``."""

    in_run_identity = False

    def __init__(self, epoch, batch):
        self.epoch, self.batch = epoch, batch

    def on_batch_end(self, net, training=False, **kwargs):
        if training and (len(net.history), len(net.history[-1]["batches"])) == (
            self.epoch,
            self.batch,
        ):
            raise Stop()


class Shuffled(Plain):
    """A plain stream in an order drawn from its own generator, seeded apart
    on each rank: accelerate synchronizes a dataset's ``generator`` as each
    epoch begins. Records the order it read."""

    def __init__(self, X, y):
        super().__init__(X, y)
        self.generator = torch.Generator().manual_seed(_split()[0])
        self.orders = []

    def rows(self):
        order = torch.randperm(len(self.X), generator=self.generator).tolist()
        self.orders.append(order)
        return order


class FirstRankOnly(Plain):
    """A split that leaves every rank but the first without samples."""

    def rows(self):
        return range(len(self.X)) if _split()[0] == 0 else []


def net_for(accelerator, steps=1, batch=BATCH):
    accelerator.gradient_accumulation_steps = steps
    set_seed(0)
    return AcceleratedNet(
        MLP,
        accelerator=accelerator,
        max_epochs=2,
        lr=0.5,
        batch_size=batch,
        train_split=None,
        verbose=0,
    )


def outcomes(net, stream=None):
    module = net.accelerator.unwrap_model(net.module_)
    return {
        # FSDP2 holds each rank's shard: the whole tensors, gathered
        "weights": [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
            for p in module.parameters()
        ],
        "train_loss": net.history[:, "train_loss"],
        "train_batch_count": net.history[:, "train_batch_count"],
        "yielded": None if stream is None else stream.yielded / 2,  # per epoch
    }


# where a resumed fit stops and saves: after batch 3 of epoch 2, every 2 batches
RESUMED = {
    "plain": {},
    "split": {},
    "parts": {"dispatch_batches": False, "split_batches": True},
    # rank 1's one batch is over at the save, after step 4: it pads
    "uneven": {},
}


SPLITS = {"split": True, "uneven": "uneven"}
STOPS = {"uneven": (2, 5)}  # after the save at step 4, where rank 1 pads


def resumes(checks, dirname):
    """A fit saved inside epoch 2 and stopped there, then resumed by a new
    net, against the same fit uninterrupted: equal weights and histories."""
    X, y = make_data(SIZES["partial"], seed=4)
    for kind, config in RESUMED.items():

        def fit(stream, callbacks, config=config, kind=kind):
            fresh_state()
            accelerator = make_accelerator(
                cpu=True, dataloader_config=DataLoaderConfiguration(**config)
            )
            batch = 2 * BATCH if config.get("split_batches") else BATCH
            net = net_for(accelerator, batch=batch)
            net.set_params(max_epochs=3, callbacks=callbacks)
            net.fit(stream, None)
            return outcomes(net, None)

        def resumed(kind=kind, fit=fit):
            folder = dirname / kind
            # the same layout, saving elsewhere: a plain stream saved inside epochs
            # is read by every rank, where without saves the main process dispatches it
            alone = TrainingCheckpoint(dirname / f"{kind}-uninterrupted", every_n_batches=2)
            plain = fit(Positioned(X, y, split=SPLITS.get(kind, False)), [alone])
            checkpoint = TrainingCheckpoint(folder, every_n_batches=2)
            try:
                fit(
                    Positioned(X, y, split=SPLITS.get(kind, False)),
                    [checkpoint, StopAt(*STOPS.get(kind, (2, 3)))],
                )
            except Stop:
                pass
            stream = Positioned(X, y, split=SPLITS.get(kind, False))
            again = fit(
                stream, [TrainingCheckpoint(folder, every_n_batches=2), ResumeTraining(folder)]
            )
            return {"uninterrupted": plain, "resumed": again, "yielded": stream.yielded}

        checks.run(resumed, f"resumed-{kind}")

    @checks
    def resume_dispatched():
        fresh_state()
        config = DataLoaderConfiguration(dispatch_batches=True)
        net = net_for(make_accelerator(cpu=True, dataloader_config=config))
        net.set_params(callbacks=[TrainingCheckpoint(dirname / "dispatched", every_n_batches=2)])
        return outcome(lambda: net.fit(Positioned(X, y), None))


def reference(checks):
    """One process, a Dataset in order, the global batch of 2 processes."""
    for case in CASES:
        size, steps = case.split("-accum")

        def fit(size=size, steps=int(steps)):
            fresh_state()
            X, y = make_data(SIZES[size], seed=4)
            net = net_for(make_accelerator(cpu=True), steps, batch=2 * BATCH)
            return outcomes(net.fit(X, y))

        checks.run(fit, f"alone-{case}")


def streams(checks):
    for kind, config in (
        ("plain", {}),
        ("plain-each-reads", {"dispatch_batches": False}),
        ("plain-each-reads-split-batches", {"dispatch_batches": False, "split_batches": True}),
        ("split", {}),
        ("split-fsdp2", {}),
    ):
        for case in CASES:
            size, steps = case.split("-accum")

            def fit(kind=kind, config=config, size=size, steps=int(steps)):
                fresh_state()
                X, y = make_data(SIZES[size], seed=4)
                stream = (BlockSplit if kind.startswith("split") else Plain)(X, y)
                make = make_fsdp_accelerator if kind.endswith("fsdp2") else make_accelerator
                accelerator = make(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # accelerate's on dispatching
                    # split_batches: the batch size is the global batch's
                    batch = 2 * BATCH if config.get("split_batches") else BATCH
                    net = net_for(accelerator, steps, batch).fit(stream, None)
                return outcomes(net, stream)

            checks.run(fit, f"{kind}-{case}")

    X, y = make_data(SIZES["partial"], seed=4)

    @checks
    def split_predict():
        fresh_state()
        net = net_for(make_accelerator(cpu=True)).fit(X, y)
        return outcome(lambda: net.predict(BlockSplit(X, y)))

    @checks
    def split_dispatched():
        fresh_state()
        config = DataLoaderConfiguration(dispatch_batches=True)
        net = net_for(make_accelerator(cpu=True, dataloader_config=config))
        return outcome(lambda: net.fit(BlockSplit(X, y), None))

    @checks
    def split_empty_rank():
        fresh_state()
        net = net_for(make_accelerator(cpu=True))
        return outcome(lambda: net.fit(FirstRankOnly(X, y), None))

    @checks
    def shuffled_read_by_every_rank():
        """dispatch_batches=False: every rank reads the stream, in one order."""
        fresh_state()
        config = DataLoaderConfiguration(dispatch_batches=False)
        stream = Shuffled(X, y)
        net_for(make_accelerator(cpu=True, dataloader_config=config)).fit(stream, None)
        return stream.orders[-2:]  # each epoch's (the first one read is the probe's copy's)

    @checks
    def fit_after_refusals():
        """The refusals left every rank in step: a fit still trains."""
        fresh_state()
        net = net_for(make_accelerator(cpu=True)).fit(BlockSplit(X, y), None)
        return net.history[:, "train_batch_count"]


def main():
    freeze_what_is_loaded()
    checks = Checks()
    if len(sys.argv) > 1 and sys.argv[1] == "alone":
        reference(checks)
    else:
        streams(checks)
        resumes(checks, Path(sys.argv[1]))
    report(checks.results)


if __name__ == "__main__":
    main()
