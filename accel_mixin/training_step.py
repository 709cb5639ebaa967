"""One training step: forward, backward, optimizer step and zeroing.

The step runs within ``accelerator.accumulate`` for every module and
criterion, so that with gradient accumulation the optimizers step, and DDP
syncs gradients, only every ``gradient_accumulation_steps`` batches. The
gradients are zeroed after the step rather than before the forward pass,
which would discard the accumulated ones.

``on_grad_computed`` is notified on the batches where the optimizers step,
with the gradients they step with: accumulated over the micro-batches, synced
across the processes and unscaled by the gradient scaler, so that
``GradientNormClipping`` clips what it would clip in plain skorch. On the
micro-batches in between it is not notified: their gradients are partial sums
that nothing should clip or inspect.

Optimizers that act on the loss their closure returns (LBFGS, or one whose
``step`` is not torch's own) step as in skorch, without a gradient scaler and
without accumulation: ``optimizer.step(closure)``, where the closure zeroes
the gradients, runs forward and backward and returns the loss. Otherwise the
gradients are computed once and every optimizer steps on them, with or
without a scaler alike (a GradScaler cannot step with a closure, and a
closure that zeroes the gradients would discard the accumulated ones).
"""

import torch
from skorch.utils import TeeGenerator

from accel_mixin.net_objects import net_modules

__all__ = ["clear_gradients", "step_optimizers", "train_step"]


def train_step(net, stepper, batch, **fit_params):
    """skorch's ``train_step`` through ``stepper`` (a ``stepping.Stepper``)."""
    optimizers = [getattr(net, name + "_") for name in net._optimizers]  # pylint: disable=protected-access
    step_accumulator = net.get_train_step_accumulator()
    closures = stepper.closures_for(optimizers)

    def step_fn():
        if closures:
            net._zero_grad_optimizer()  # pylint: disable=protected-access
        step = net.train_step_single(batch, **fit_params)
        step_accumulator.store_step(step)
        if stepper.sync_gradients:
            stepper.unscale(optimizers)
            net.notify(
                "on_grad_computed",
                named_parameters=TeeGenerator(net.get_all_learnable_params()),
                batch=batch,
                training=True,
            )
        return step["loss"]

    wrapped = lambda: [module for _, module in net_modules(net, unwrapped=False)]  # noqa: E731
    with stepper.accumulate(wrapped):
        net._step_optimizer(step_fn, closures=closures)  # pylint: disable=protected-access
        if not closures:
            net._zero_grad_optimizer()  # pylint: disable=protected-access
    return step_accumulator.get_step()


def step_optimizers(stepper, optimizers, step_fn, closures):
    """Step ``optimizers``: each with ``step_fn`` as its closure, or after one
    call of ``step_fn`` all on the gradients it computed."""
    if closures:
        for optimizer in optimizers:
            stepper.step(optimizer, step_fn)
    else:
        step_fn()
        stepper.step_all(optimizers)


def clear_gradients(modules, optimizers):
    """Drop the gradients of every parameter of ``modules`` and of every
    tensor ``optimizers`` hold (tensors outside the modules too), so that
    half-accumulated gradients of an interrupted fit do not leak into the
    next, and the optimizers see the calls a skorch net makes, no more."""
    for module in modules:
        for param in module.parameters():
            param.grad = None
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.Optimizer):
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
