"""save_params and load_params of a large model, against the I/O limit.

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 scripts/benchmarks/checkpoint.py --out ...

Variants: accel_mixin, the incumbent (with its criterion workaround), a raw
``torch.save`` of the same state dict on rank 0, and the same followed by an
fsync, which accel_mixin's atomic writes pay and a raw save does not
(``torch.load`` plus ``load_state_dict`` on every rank for loading). Every timing starts and ends
with all ranks in step. Also times unwrap plus rewrap alone, for a small and
the large model.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from skorch import NeuralNetClassifier
from skorch.hf import AccelerateMixin as IncumbentMixin

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from common import PeakRSS, Timer, alternate, barrier, is_main, summarize, write_result
from fit import ParamNLLLoss

from accel_mixin import AccelerateMixin


class OursNet(AccelerateMixin, NeuralNetClassifier):
    pass


class IncumbentNet(IncumbentMixin, NeuralNetClassifier):
    pass


class Stack(torch.nn.Module):
    """``depth`` square layers of ``width``: 4 x 3584 is about 51M parameters."""

    def __init__(self, width=3584, depth=4):
        super().__init__()
        self.inp = torch.nn.Linear(100, width)
        self.hidden = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
        self.out = torch.nn.Linear(width, 2)

    def forward(self, X):
        return torch.softmax(self.out(self.hidden(self.inp(X))), dim=-1)


DURABLE = "torch.save + fsync"
OVERWRITING = ", overwriting"


def n_params(module):
    return sum(p.numel() for p in module.parameters())


def make_nets(accelerator, width, depth):
    workaround = {"criterion": ParamNLLLoss} if accelerator.num_processes > 1 else {}
    common = dict(
        module=Stack, module__width=width, module__depth=depth, accelerator=accelerator, verbose=0
    )
    return {
        "accel_mixin": OursNet(**common).initialize(),
        "incumbent": IncumbentNet(**common, **workaround).initialize(),
    }


def raw_module(net):
    return net.accelerator.unwrap_model(net.module_)


def peak_extra_rss(fn, repeats=3):
    """Median over repeats of the peak RSS above the starting RSS while ``fn``
    runs, sampled every millisecond on this rank."""
    peaks = []
    for _ in range(repeats):
        with PeakRSS(every=0.001) as sampled:
            fn()
        peaks.append(sampled.growth)
    return statistics.median(peaks)


def training_net(accelerator, width, depth, **params):
    """An initialized net of ``Stack`` that stays wrapped, in an epoch, ready
    for ``train_step``; ``params``: more of the net's."""
    net = OursNet(
        module=Stack,
        module__width=width,
        module__depth=depth,
        accelerator=accelerator,
        verbose=0,
        unwrap_after_train=False,
        **params,
    ).initialize()
    net.history.new_epoch()
    return net


def time_rewrap(net, calls):
    """Median seconds of one unwrap plus rewrap, on this rank."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        net._unwrap_accelerator()  # pylint: disable=protected-access
        net._initialize_accelerator()  # pylint: disable=protected-access
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write the files")
    args = parser.parse_args()

    accelerator = Accelerator()
    nets = make_nets(accelerator, args.width, args.depth)
    reference = raw_module(nets["accel_mixin"])

    workdir = Path(args.dir or tempfile.gettempdir()) / "accel_mixin_bench"
    if is_main():
        workdir.mkdir(parents=True, exist_ok=True)
    path = str(workdir / "params.pt")

    def save(name):
        name = name.replace(OVERWRITING, "")
        if name == "torch.save":
            if is_main():
                torch.save(reference.state_dict(), path)
        elif name == DURABLE:
            if is_main():
                torch.save(reference.state_dict(), path)
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)  # what a save that survives a power cut must also pay
                os.close(fd)
        else:
            nets[name].save_params(f_params=path)

    def load(name):
        if name == "torch.load":
            reference.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        else:
            nets[name].load_params(f_params=path)

    def measure_with(operation):
        def measure(name):
            if operation is save:
                start_save(name)
            # start every variant with no dirty pages: a raw save leaves its
            # data for the kernel to write back while the next variant runs
            os.sync()
            with Timer() as timer:
                operation(name)
            return timer.seconds

        return measure

    def start_save(name):
        # Saves write a new file, so that none pays for freeing the blocks of
        # the file it replaces (a third of a second for 200 MB here): neither
        # a raw torch.save inside its truncation, nor the next variant while
        # accel_mixin frees them in the background. The overwriting variants
        # show what saving again under the same name costs.
        if is_main():
            if not name.endswith(OVERWRITING) and os.path.exists(path):
                os.unlink(path)
            deadline = time.monotonic() + 60
            while any("-previous" in entry for entry in os.listdir(workdir)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a replaced file in {workdir} is not freed after 60 s")
                time.sleep(0.01)
        barrier()

    save("torch.save")  # warm-up, and a file to load from
    variants_save = [
        "torch.save",
        DURABLE,
        "accel_mixin",
        "incumbent",
        "torch.save" + OVERWRITING,
        "accel_mixin" + OVERWRITING,
    ]
    variants_load = ["torch.load", "accel_mixin", "incumbent"]
    save_times = alternate(variants_save, args.repeats, measure_with(save))
    load_times = alternate(variants_load, args.repeats, measure_with(load))

    file_bytes = Path(path).stat().st_size
    memory = {
        name: peak_extra_rss(lambda name=name: load(name)) / file_bytes for name in variants_load
    }

    small = make_nets(accelerator, 64, 1)
    rewrap = {}
    for size_name, group in (("small", small), ("large", nets)):
        rewrap[size_name] = {
            "params": n_params(raw_module(group["accel_mixin"])),
            "accel_mixin_ms": 1e3 * time_rewrap(group["accel_mixin"], 50),
            "incumbent_ms": 1e3 * time_rewrap(group["incumbent"], 3),
        }

    write_result(
        args.out,
        {
            "benchmark": "checkpoint",
            "processes": accelerator.num_processes,
            "params": n_params(reference),
            "file_mb": Path(path).stat().st_size / 2**20 if is_main() else None,
            "save": summarize(save_times, "torch.save"),
            "load": summarize(load_times, "torch.load"),
            "rewrap": rewrap,
            "load_memory_over_file_size": memory,
            "incumbent_workaround": accelerator.num_processes > 1,
        },
    )


if __name__ == "__main__":
    main()
