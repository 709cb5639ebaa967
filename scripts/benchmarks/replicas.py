"""Replica check: what comparing every parameter across the ranks costs,
against the training epoch it follows.

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 scripts/benchmarks/replicas.py --out ...

An epoch of the 51.8M-parameter model takes minutes on this machine, so the
epoch is timed as its training steps: the median time of one DDP training
step, times the steps of an epoch of ``--epoch-samples`` samples (batch 128
per process, as in the fit benchmark). The check is timed as the net runs
it after an epoch: fingerprints of every parameter and one gather, on rank 0.
"""

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from accel_mixin.distributed.replicas import check_replicas, named_parameters

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from checkpoint import n_params, training_net
from common import alternate, barrier, write_result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epoch-samples", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()

    accelerator = Accelerator()
    net = training_net(accelerator, args.width, args.depth)
    X = torch.randn(args.batch_size, 100)
    y = torch.randint(0, 2, (args.batch_size,))
    params = list(named_parameters((name + "_", m) for name, m in net._objects.named_modules()))

    def measure(name):
        barrier()
        start = time.perf_counter()
        if name == "training step":
            net.history.new_batch()
            net.train_step((X, y))
        else:
            check_replicas(params, "after epoch 1", net._coordinator.gather)
        return time.perf_counter() - start

    measure("training step")  # warm-up
    measure("replica check")
    times = alternate(["training step", "replica check"], args.repeats, measure)
    step, check = (statistics.median(times[name]) for name in ("training step", "replica check"))
    steps = math.ceil(args.epoch_samples / (args.batch_size * accelerator.num_processes))
    write_result(
        args.out,
        {
            "benchmark": "replicas",
            "processes": accelerator.num_processes,
            "params": n_params(accelerator.unwrap_model(net.module_)),
            "tensors": len(params),
            "epoch_samples": args.epoch_samples,
            "batch_size": args.batch_size,
            "steps_per_epoch": steps,
            "times_s": {
                name: {"median_s": statistics.median(values), "runs_s": values}
                for name, values in times.items()
            },
            "check_over_step": check / step,
            "check_over_epoch": check / (step * steps),
        },
    )


if __name__ == "__main__":
    main()
