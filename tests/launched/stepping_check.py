"""Stepper's plain path against accelerate's own calls, in several processes.

Usage: torchrun --nproc_per_node 2 stepping_check.py

Each configuration trains the same model twice from the same seed, with a
fresh accelerator each time: once through ``Stepper`` as the mixin calls
it, once through ``accelerator.accumulate``, ``autocast``, ``backward`` and
``AcceleratedOptimizer.step``/``zero_grad``. Every rank reports, per
configuration, whether both ended with identical weights and a digest of
them, for the test to compare across ranks. ``compare`` is also what the
single-process tests run.
"""

import hashlib
import itertools

import torch
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType, GradientAccumulationPlugin
from common import make_accelerator, report

from accel_mixin.stepping import Stepper

__all__ = ["CONFIGURATIONS", "compare"]

# Per process and epoch. Not a multiple of 3, so that with accumulation
# ``sync_with_dataloader`` (step at the end of the data) makes a difference.
BATCHES = 7
EPOCHS = 2

# The 2-process configurations, by name. Relabelled MULTI_GPU: accelerate's
# calls as they run under that type, on the same DDP over gloo.
CONFIGURATIONS = {
    f"{label}-{precision}-{accumulation}": dict(
        relabel=relabel, mixed_precision=precision, **plugin
    )
    for (label, relabel), precision, (accumulation, plugin) in itertools.product(
        [("multi_cpu", None), ("multi_gpu_label", DistributedType.MULTI_GPU)],
        ["no", "bf16"],
        [
            ("accum1", dict(num_steps=1)),
            ("accum3", dict(num_steps=3)),
            ("accum3_sync_each_batch", dict(num_steps=3, sync_each_batch=True)),
        ],
    )
}


def reset_accelerate():
    """As ``tests/conftest.py`` does: accelerate's state is per-process singletons."""
    AcceleratorState._reset_state(reset_partial_state=True)  # pylint: disable=protected-access
    GradientState._reset_state()  # pylint: disable=protected-access


def train(use_stepper, mixed_precision="no", relabel=None, **plugin):
    """The weights after training, and the Stepper's ``plain`` and distributed type.

    Parameters
    ----------
    use_stepper : bool
      Whether to train through ``Stepper`` or through accelerate's calls.

    mixed_precision : str (default='no')
      The accelerator's.

    relabel : DistributedType or None
      Set as the accelerator's distributed type after ``prepare``: the
      calls then run as they run under that type.

    **plugin
      ``GradientAccumulationPlugin`` arguments.

    """
    reset_accelerate()
    accelerator = make_accelerator(
        cpu=True,
        mixed_precision=mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(**plugin),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    # momentum: a step too many or too few shows in every later one
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    n = 4 * BATCHES * accelerator.num_processes
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 4, generator=generator), torch.randn(n, 1, generator=generator)
    )
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, torch.utils.data.DataLoader(data, batch_size=4)
    )
    if relabel is not None:
        # on both: every AcceleratorState() (autocast makes one) copies PartialState's
        for state in (PartialState(), accelerator.state):
            state.distributed_type = relabel
    stepper = Stepper(accelerator)
    for _ in range(EPOCHS):
        for X, y in loader:
            if use_stepper:
                with stepper.accumulate(lambda: [model]):
                    with stepper.autocast():
                        loss = torch.nn.functional.mse_loss(model(X), y)
                    stepper.backward(loss)
                    stepper.step_all([optimizer])
                    stepper.zero_grad(optimizer)
            else:
                with accelerator.accumulate(model):
                    with accelerator.autocast():
                        loss = torch.nn.functional.mse_loss(model(X), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
    weights = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return weights, stepper.plain, str(accelerator.distributed_type.value)


def compare(**config):
    """``train`` through Stepper and through accelerate, with ``config``."""
    ours, plain, distributed_type = train(True, **config)
    theirs, _, _ = train(False, **config)
    torch.manual_seed(0)
    initial = torch.nn.Linear(4, 8).weight
    return {
        "plain": plain,
        "distributed_type": distributed_type,
        "equal": all(torch.equal(a, b) for a, b in zip(ours, theirs)),
        "max_difference": max((a - b).abs().max().item() for a, b in zip(ours, theirs)),
        "moved": not torch.equal(ours[0], initial),
        "digest": hashlib.sha256(b"".join(w.numpy().tobytes() for w in ours)).hexdigest(),
    }


if __name__ == "__main__":
    report({"configurations": {name: compare(**config) for name, config in CONFIGURATIONS.items()}})
