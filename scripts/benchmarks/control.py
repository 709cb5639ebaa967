"""The control plane's cost per process: sockets, a waiting rank's CPU, and
``save_params`` of a small model against a hand-written save.

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 4 scripts/benchmarks/control.py --out ...

- sockets: the socket descriptors this process holds once the process group
  is up (one barrier), and again after a fit and a ``save_params``;
- waiting CPU: the CPU time of every rank but the main one, over the wall
  time of a ``save_params`` whose write on the main process takes about
  ``--write-seconds`` (a model sized for it), as a fraction of one core;
- ``save_params`` of a 10k-parameter model, alternating with a hand-written
  ``torch.save`` plus fsync on the main process between two gloo barriers
  (the issue's baseline), and with the same written atomically (a temporary
  file fsynced and renamed into place, as ``atomic_files`` does): what the promise that a
  failed save leaves the previous file costs by itself; and with that write
  on a watchdog's worker thread as well, what a write bounded by
  ``io_timeout`` adds. ``save_params`` keeps both promises.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from accel_mixin.distributed.io_watchdog import Watchdog

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from checkpoint import OursNet
from common import alternate, barrier, is_main, summarize, write_result


def sockets():
    """Socket descriptors this process holds."""
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:  # the directory's own descriptor, closed meanwhile
            pass
    return count


class Wide(torch.nn.Module):
    def __init__(self, width=10, depth=1):
        super().__init__()
        self.hidden = torch.nn.Sequential(
            *[torch.nn.Linear(width if i else 100, width) for i in range(depth)]
        )
        self.out = torch.nn.Linear(width, 2)

    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.hidden(X))), dim=-1)


def make_net(accelerator, width, depth):
    return OursNet(
        Wide,
        module__width=width,
        module__depth=depth,
        accelerator=accelerator,
        max_epochs=1,
        batch_size=32,
        train_split=None,
        verbose=0,
    ).initialize()


def hand_written_save(net, path):
    """rank 0: ``torch.save`` and fsync between two barriers."""
    barrier()
    if is_main():
        with open(path, "wb") as f:
            torch.save(net.accelerator.unwrap_model(net.module_).state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
    barrier()


def hand_written_atomic_save(net, path):
    """rank 0, between two barriers: what a save that never destroys the
    previous file costs at least: ``torch.save`` to a temporary file, fsync,
    rename over the target (``atomic_files`` fsyncs no directory either)."""
    barrier()
    if is_main():
        _atomic_write(net, path)
    barrier()


def hand_written_watched_save(net, path, watchdog):
    """``hand_written_atomic_save`` whose write runs on a watchdog's worker
    thread (``io_watchdog``), as a write bounded by ``io_timeout`` must: what
    that promise adds by itself."""
    barrier()
    if is_main():
        write = lambda: _atomic_write(net, path)  # noqa: E731
        watchdog.run(write, io_timeout=60, what=path)
    barrier()


def _atomic_write(net, path):
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(net.accelerator.unwrap_model(net.module_).state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def waiting_cpu(net, path, repeats):
    """Per save: (CPU seconds of this process, wall seconds), every rank in step."""
    out = []
    for _ in range(repeats):
        barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        net.save_params(f_params=path)
        out.append((time.process_time() - cpu, time.perf_counter() - wall))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--wait-repeats", type=int, default=5)
    parser.add_argument("--write-mb", type=int, default=200, help="the waited-for file's size")
    args = parser.parse_args()
    accelerator = Accelerator()
    barrier()
    result = {"sockets_group": sockets()}
    workdir = Path(tempfile.gettempdir()) / "accel_mixin_bench_control"
    if is_main():
        workdir.mkdir(parents=True, exist_ok=True)
    barrier()

    small = make_net(accelerator, 10, 1)
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(256, 100, generator=generator)
    y = torch.randint(0, 2, (256,), generator=generator)
    small.fit(X, y)
    path = str(workdir / "small.pt")
    watchdog = Watchdog()
    small.save_params(f_params=path)
    result["sockets_after_fit"] = sockets()
    variants = {
        "hand-written": lambda: hand_written_save(small, path),
        "hand-written, atomic": lambda: hand_written_atomic_save(small, path),
        "hand-written, atomic, watched": lambda: hand_written_watched_save(small, path, watchdog),
        "save_params": lambda: small.save_params(f_params=path),
    }

    def measure(name):
        barrier()
        start = time.perf_counter()
        variants[name]()
        barrier()
        return time.perf_counter() - start

    for name in variants:
        measure(name)
    times = alternate(list(variants), args.repeats, measure)
    result["save_params"] = summarize(times, baseline="hand-written")

    # a model of --write-mb float32 parameters: the main process writes, the others wait
    width = 1024
    depth = max(1, args.write_mb * 2**20 // 4 // (width * width))
    large = make_net(accelerator, width, depth)
    waits = waiting_cpu(large, str(workdir / "large.pt"), args.wait_repeats)
    result["wait"] = {
        "cpu_s": [c for c, _ in waits],
        "wall_s": [w for _, w in waits],
        "core_fraction": sum(c for c, _ in waits) / sum(w for _, w in waits),
    }
    everyone = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(everyone, result)
    write_result(
        args.out,
        {"benchmark": "control", "processes": accelerator.num_processes, "ranks": everyone},
    )


if __name__ == "__main__":
    main()
