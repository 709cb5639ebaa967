"""FSDP2 against DDP: each rank's memory while a net of a large model fits
with Adam, and while it saves and loads full files and training states; and
the net's fit time against a hand-written accelerate FSDP2 loop on the same
model.

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node N scripts/benchmarks/sharded.py \\
        --variant memory --kind fsdp|ddp --out ...
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node N scripts/benchmarks/sharded.py \\
        --variant time --out ...

The model is ``checkpoint.Stack`` with 16 layers of 1792 (51.6M parameters,
as many blocks as a mid-sized transformer); under FSDP2 every layer of at
least a million parameters is a sharded unit of its own (accelerate's
``size_based_wrap``), so that one layer at a time is gathered whole, with
its gradient. Memory is each rank's resident set above what it held before
the net was built (the imports, the process group), sampled every
millisecond: ``initialize`` (the model is built whole on every rank, then
sharded) and ``fit`` (which builds it again, as skorch's ``fit`` does)
separately, then ``save_params`` and ``load_params`` of the module and
optimizer files (full ones, gathered), then ``save_state`` and
``load_state`` (under FSDP2 every rank its own shards). With ``--loop`` the
one phase is ``fit`` of a hand-written accelerate loop instead (the model
built, prepared, one epoch), the same work without the net. Each kind runs
in a launch of its own, since a process's peak is its own. FSDP2 on CPU is
set as the tests set it (``tests/launched/common.py``'s
``make_fsdp_accelerator``).

The resident set depends on glibc's allocator, which the launch's
environment sets (``run.py --allocator``): by default glibc raises its mmap
threshold each time a large mmapped block is freed (up to 32 MB), after
which tensors of a sharded unit's size come from the heap, and the heap
keeps what is freed resident. FSDP2 allocates and frees its gathered layers
and full gradients in every step, so that under the default the freed heap
memory (``malloc_free_mb``, glibc's ``mallinfo2``, recorded after each
phase) grows to several times what is in use. With
``MALLOC_MMAP_THRESHOLD_=65536`` the threshold is fixed and a freed tensor
leaves the resident set. The result records the ``MALLOC_*`` variables it
ran under.
"""

import argparse
import ctypes
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# pylint: disable=wrong-import-position
from checkpoint import OursNet, Stack, n_params  # noqa: E402
from common import PeakRSS, alternate, barrier, summarize, write_result  # noqa: E402


def _launched_common():
    """tests/launched/common.py, whose name the benchmarks' own common takes."""
    path = HERE.parent.parent / "tests" / "launched" / "common.py"
    spec = importlib.util.spec_from_file_location("launched_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launched = _launched_common()

PLUGIN = {"auto_wrap_policy": "size_based_wrap", "min_num_params": 1_000_000}
MB = 2**20


def accelerator_of(kind):
    launched.fresh_state()
    if kind == "fsdp":
        return launched.make_fsdp_accelerator(plugin=PLUGIN)
    return launched.make_accelerator()


def data(args, processes):
    """One epoch of ``--steps`` global batches."""
    n = args.steps * args.batch_size * processes
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 100, generator=generator), torch.randint(0, 2, (n,), generator=generator)


def make_net(accelerator, args):
    return OursNet(
        module=Stack,
        module__width=args.width,
        module__depth=args.depth,
        accelerator=accelerator,
        optimizer=torch.optim.Adam,
        lr=1e-4,
        max_epochs=1,
        batch_size=args.batch_size,
        train_split=None,
        verbose=0,
    )


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_free_mb():
    """Memory that glibc's malloc holds freed in its heaps, in MB (None
    without glibc 2.33's ``mallinfo2``)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2().fordblks / MB


def allocator():
    """The glibc allocator settings of this process's environment."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}


def measure_phases(phases, start):
    """Peak RSS above ``start`` and seconds of each ``(name, fn)``, every rank in step."""
    out = {}
    for phase, fn in phases:
        barrier()
        began = time.perf_counter()
        with PeakRSS(every=0.001) as sampled:
            fn()
        barrier()
        out[phase] = {
            "peak_mb": (sampled.peak - start) / MB,
            "seconds": time.perf_counter() - began,
            "malloc_free_mb": malloc_free_mb(),
        }
    return out


def memory(args):
    """Peak RSS above the start, in MB, of each phase on this rank."""
    accelerator = accelerator_of(args.kind)
    X, y = data(args, accelerator.num_processes)
    parameters = n_params(Stack(args.width, args.depth))
    # the first optimizer of a process imports torch._dynamo (about 70 MB)
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    if args.loop:
        start = PeakRSS.now()
        phases = (("fit", lambda: hand_written_loop(accelerator, args, X, y)()),)
        return {"parameters": parameters, "phases": measure_phases(phases, start)}
    net = make_net(accelerator, args)
    start = PeakRSS.now()
    workdir = Path(args.dir or tempfile.gettempdir()) / f"accel_mixin_sharded_{args.kind}"
    if accelerator.is_main_process:
        workdir.mkdir(parents=True, exist_ok=True)
    files = {"f_params": str(workdir / "params.pt"), "f_optimizer": str(workdir / "opt.pt")}
    state = str(workdir / "state.pt")
    phases = (
        ("initialize", net.initialize),
        ("fit", lambda: net.fit(X, y)),
        ("save_params", lambda: net.save_params(**files)),
        ("load_params", lambda: net.load_params(**files)),
        ("save_state", lambda: net.save_state(state)),
        ("load_state", lambda: net.load_state(state)),
    )
    return {"parameters": parameters, "phases": measure_phases(phases, start)}


def hand_written_loop(accelerator, args, X, y):
    """accelerate's FSDP2 recipe: one prepare of model and optimizer, a
    prepared dataloader, backward and step."""
    torch.manual_seed(0)
    model = Stack(args.width, args.depth)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = accelerator.prepare(DataLoader(TensorDataset(X, y), batch_size=args.batch_size))

    def epoch():
        for xb, yb in loader:
            loss = torch.nn.functional.nll_loss(torch.log(model(xb)), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    return epoch


def timing(args):
    """The net's fit of one epoch against the loop's, alternating, FSDP2 both."""
    accelerator = accelerator_of("fsdp")
    X, y = data(args, accelerator.num_processes)
    torch.manual_seed(0)
    net = make_net(accelerator, args).initialize()
    loop = hand_written_loop(accelerator, args, X, y)
    variants = {"accelerate loop": loop, "accel_mixin fit": lambda: net.partial_fit(X, y)}

    def measure(name):
        barrier()
        began = time.perf_counter()
        variants[name]()
        barrier()
        return time.perf_counter() - began

    for name in variants:  # warm-up: the first step builds FSDP's buffers
        measure(name)
    times = alternate(list(variants), args.repeats, measure)
    return summarize(times, baseline="accelerate loop")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", choices=("memory", "time"), required=True)
    parser.add_argument("--kind", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument(
        "--loop", action="store_true", help="memory: a hand-written accelerate loop's fit"
    )
    parser.add_argument("--width", type=int, default=1792)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write the files")
    args = parser.parse_args()
    result = memory(args) if args.variant == "memory" else timing(args)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, result)
    write_result(
        args.out,
        {
            "variant": args.variant,
            "kind": args.kind if args.variant == "memory" else "fsdp",
            "loop": args.variant == "memory" and args.loop,
            "allocator": allocator(),
            "processes": len(everyone),
            "width": args.width,
            "depth": args.depth,
            "batch_size": args.batch_size,
            "steps": args.steps,
            "ranks": everyone,
        },
    )


if __name__ == "__main__":
    main()
