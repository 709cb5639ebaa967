"""Checkpoint stall: how long training waits per training-state checkpoint,
synchronous against asynchronous writes.

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 scripts/benchmarks/stall.py \
        [--kind ddp|fsdp] [--optimizer adam|sgd] --out ...

Under ``--kind fsdp`` the module is sharded as ``sharded.py`` shards it (on
CPU as the tests do).

Between checkpoints the net trains for a while, so that an asynchronous write
overlaps training as it would in a real run; the stall is the time the
``save_state`` call blocks, on rank 0. A third variant saves asynchronously
with a CPU copy allocated anew for each save, as ``dcp.async_save`` does by
itself: what keeping the copy between saves buys.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from checkpoint import training_net
from common import alternate, barrier, is_main, write_result

from accel_mixin.checkpoint.state_saves import StateSaves

# the asynchronous save as dcp.async_save makes it by itself, without the
# stager the net keeps between its saves (StateSaves.kept_stager)
PER_SAVE = "asynchronous, a new CPU copy per save"


def _params(net, accelerator):
    """Parameters of the whole module (a DTensor's numel is the whole one's)."""
    return sum(p.numel() for p in accelerator.unwrap_model(net.module_).parameters())


def _size(path):
    """Bytes of the training state ``path``: a folder (every rank's part)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(entry.stat().st_size for entry in Path(path).iterdir() if entry.is_file())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--train-seconds", type=float, default=2.0)
    parser.add_argument("--kind", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    args = parser.parse_args()

    if args.kind == "fsdp":
        from sharded import accelerator_of  # pylint: disable=import-outside-toplevel

        accelerator = accelerator_of("fsdp")
    else:
        accelerator = Accelerator()
    optimizer = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
    net = training_net(accelerator, args.width, args.depth, optimizer=optimizer)
    X = torch.randn(64, 100)
    y = torch.randint(0, 2, (64,))
    workdir = Path(tempfile.gettempdir()) / "accel_mixin_bench_stall"
    if is_main():
        workdir.mkdir(parents=True, exist_ok=True)
    barrier()
    path = str(workdir / "state.pt")

    def train(steps):
        for _ in range(steps):
            net.history.new_batch()
            net.train_step((X, y))

    # every rank takes the same number of steps (DDP syncs each of them):
    # as many as rank 0 takes in --train-seconds
    start = time.perf_counter()
    train(3)
    per_step = (time.perf_counter() - start) / 3
    steps = gather_object([max(1, int(args.train_seconds / per_step))])[0]

    def measure(name):
        train(steps)
        barrier()
        start = time.perf_counter()
        if name == PER_SAVE:
            # DCP's own stager, made for this save: its CPU copy allocated anew
            with mock.patch.object(StateSaves, "kept_stager", lambda self: None):
                net.save_state(path, asynchronous=True)
        else:
            net.save_state(path, asynchronous=name == "asynchronous")
        stall = time.perf_counter() - start
        barrier()
        return stall

    measure("synchronous")  # warm-up
    times = alternate(["synchronous", "asynchronous", PER_SAVE], args.repeats, measure)
    net.wait_for_saves()
    medians = {name: statistics.median(values) for name, values in times.items()}
    write_result(
        args.out,
        {
            "benchmark": "stall",
            "processes": accelerator.num_processes,
            "params": _params(net, accelerator),
            "kind": args.kind,
            "optimizer": args.optimizer,
            "state_mb": _size(path) / 2**20 if is_main() else None,
            "train_seconds_between": args.train_seconds,
            "stall_s": {
                name: {"median_s": medians[name], "runs_s": values}
                for name, values in times.items()
            },
            "ratio": medians["asynchronous"] / medians["synchronous"],
        },
    )


if __name__ == "__main__":
    main()
