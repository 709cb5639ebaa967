"""Timing helpers shared by the benchmarks: alternation, medians, ranks."""

import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "PeakRSS",
    "Timer",
    "alternate",
    "barrier",
    "is_main",
    "spin",
    "summarize",
    "write_result",
]


def is_main():
    return int(os.environ.get("RANK", "0")) == 0


def barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


class Timer:
    """Wall time of a block, started and stopped with every rank in step."""

    def __enter__(self):
        barrier()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        barrier()
        self.seconds = time.perf_counter() - self.start


class PeakRSS:
    """The largest resident memory of this process while the block runs,
    sampled every ``every`` seconds; ``growth`` is its rise over the start,
    in bytes."""

    _PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, every=0.005):
        self.every = every

    @classmethod
    def now(cls):
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * cls._PAGE

    def __enter__(self):
        gc.collect()
        self.start = self.peak = self.now()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(self.every):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())
        self.growth = self.peak - self.start


def alternate(variants, repeats, measure):
    """Measure every variant ``repeats`` times, rotating the order each round.

    This machine drifts by tens of percent between neighbouring runs; a
    rotating order spreads the drift evenly over the variants.

    Returns
    -------
    times : dict
      Variant name to the list of its measurements.

    """
    names = list(variants)
    times = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(measure(name))
    return times


def spin(microseconds):
    """Keep the CPU busy for ``microseconds``: the cost of reading a sample."""
    deadline = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < deadline:
        pass


def summarize(times, baseline):
    """Per variant: median seconds, the median's ratio to the baseline's, and
    the median of the per-round ratios to the baseline ("paired"), which
    cancels the drift of the machine between rounds."""
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        name: {
            "median_s": medians[name],
            "ratio": medians[name] / medians[baseline],
            "paired_ratio": statistics.median(v / b for v, b in zip(values, times[baseline])),
            "runs_s": values,
        }
        for name, values in times.items()
    }


def write_result(path, payload):
    """Write the benchmark's JSON from the main process, then end the process.

    This is the benchmark's last act. ``destroy_process_group`` does not stop
    gloo's worker threads while a module (an FSDP2 mesh) still holds the
    group, and a worker that drops the last collective's tensors during the
    interpreter's finalization aborts the process ("terminate called without
    an active exception", pytorch/pytorch#190489; about 1 launch in 9 of the
    hand-written FSDP2 loop here). Leaving with ``os._exit`` skips the
    finalization the race needs.
    """
    if is_main():
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1, default=float))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def seed_everything(seed=0):
    torch.manual_seed(seed)
    np.random.seed(seed)
