"""What the run identity's data fingerprint costs: hashing all of X and y,
against one epoch of the benchmark MLP (fit.py's) on the same data.

    python scripts/benchmarks/fingerprint.py --gb 1 --out results/raw/fingerprint.json

The fingerprint is computed once per fit, when training begins (the
checkpoint callbacks share it), on every rank, each over its whole copy of
the data.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from common import write_result
from fit import MLP, OursNet

from accel_mixin.resume.runs import run_identity

N_FEATURES = 100


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gb", type=float, default=1.0, help="size of X in GB (1e9 bytes)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()

    rows = int(args.gb * 1e9 / (4 * N_FEATURES))
    rng = np.random.default_rng(0)
    X = rng.standard_normal((rows, N_FEATURES), dtype=np.float32)
    y = (X[:, :20].sum(axis=1) > 0).astype(np.int64)
    net = OursNet(
        MLP, accelerator=Accelerator(), max_epochs=1, batch_size=args.batch_size, lr=0.05, verbose=0
    ).initialize()

    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run_identity(net, X, y)
        seconds.append(time.perf_counter() - start)
    torch.manual_seed(0)
    start = time.perf_counter()
    net.fit(X, y)
    epoch = time.perf_counter() - start
    identity = statistics.median(seconds)
    result = {
        "X_bytes": X.nbytes,
        "rows": rows,
        "identity_median_s": identity,
        "identity_runs_s": seconds,
        "epoch_s": epoch,
        "ratio": identity / epoch,
    }
    print(
        f"X: {X.nbytes / 1e9:.2f} GB ({rows} x {N_FEATURES} float32); run identity "
        f"(all of X and y hashed): median {identity:.3f} s of {args.repeats}; one epoch of "
        f"the benchmark MLP on it: {epoch:.1f} s; ratio {100 * identity / epoch:.2f}%"
    )
    write_result(args.out, result)


if __name__ == "__main__":
    main()
