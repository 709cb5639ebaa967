"""What the fork guard costs: starting an epoch's DataLoader workers (two,
forked) right after a DDP training step, with the guard and without it,
alternating, in the same processes.

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 scripts/benchmarks/fork.py \
        --out results/raw/fork.json

Each round trains one batch (DDP's all-reduce runs on gloo's threads), then
times ``iter(loader)`` and the first batch.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from common import is_main, write_result

from accel_mixin.distributed import fork_guard


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(100, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 100), torch.randint(0, 2, (4096,)))
    loader = torch.utils.data.DataLoader(data, batch_size=64, num_workers=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    fork_guard.needed = lambda: True  # measured on any Python
    fork_guard.guard_forks()
    rest = fork_guard.rest

    def start_workers(guarded):
        fork_guard.rest = rest if guarded else (lambda tids: True)
        X, y = data[:64]
        accelerator.backward(torch.nn.functional.cross_entropy(model(X), y))
        optimizer.step()
        optimizer.zero_grad()
        start = time.perf_counter()
        batches = iter(loader)
        next(batches)
        seconds = time.perf_counter() - start
        del batches  # its workers end
        return seconds

    seconds = {True: [], False: []}
    for round_ in range(args.rounds):
        for guarded in (round_ % 2 == 0, round_ % 2 == 1):
            seconds[guarded].append(start_workers(guarded))
    guarded, unguarded = (statistics.median(seconds[g]) for g in (True, False))
    result = {
        "guarded_median_s": guarded,
        "unguarded_median_s": unguarded,
        "ratio": guarded / unguarded,
        "runs_s": {"guarded": seconds[True], "unguarded": seconds[False]},
    }
    if is_main():
        print(
            f"workers started (2, forked) after a DDP step, median of {args.rounds}: "
            f"guarded {1000 * guarded:.1f} ms, unguarded {1000 * unguarded:.1f} ms, "
            f"ratio {guarded / unguarded:.3f}"
        )
    write_result(args.out, result)


if __name__ == "__main__":
    main()
