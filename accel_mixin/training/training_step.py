"""One training step: skorch's, with what accelerate needs around it.

The mixin's ``train_step``, ``train_step_single``, ``_step_optimizer`` and
``_zero_grad_optimizer`` call skorch's (and so a user's overrides on a class
below the mixin). Around them:

- The step runs within ``accelerator.accumulate`` for every module and
  criterion, so that with gradient accumulation the optimizers step, and DDP
  syncs gradients, only every ``gradient_accumulation_steps`` batches. The
  gradients are then zeroed after the step rather than before the forward
  pass, which would discard the accumulated ones.
- ``on_grad_computed`` is notified on the batches where the optimizers step,
  with the gradients they step with: accumulated over the micro-batches,
  synced across the processes and unscaled by the gradient scaler, so that
  ``GradientNormClipping`` clips what it would clip in plain skorch. On the
  micro-batches in between it is not notified: their gradients are partial
  sums that nothing should clip or inspect.
- Optimizers that act on the loss their closure returns (LBFGS, or one whose
  ``step`` is not torch's own) step as in skorch, ``optimizer.step(closure)``,
  without a gradient scaler and without accumulation. Otherwise the
  gradients are computed once and skorch's ``_step_optimizer`` is called
  with ``step_fn=None`` (its documented "just step"), so every optimizer
  steps on them, with or without a scaler alike.
- ``train_step_single`` is skorch's where accelerate's backward is
  ``loss.backward()``; with accumulation or a gradient scaler the loss must
  go through ``accelerator.backward``, which skorch's cannot do, so the
  mixin runs its own. An override of ``train_step_single`` below the mixin
  would then be skipped: ``check_overrides`` refuses it at ``initialize``.
"""

import torch
from skorch.net import NeuralNet

from accel_mixin.training.stepping import plain_backward

__all__ = ["check_overrides", "clear_gradients", "overrides_below"]


def overrides_below(net, mixin, name):
    """The classes between ``mixin`` and skorch's ``NeuralNet`` in the MRO
    of ``net`` that define ``name``: a user's net class under the mixin."""
    mro = type(net).__mro__
    below = mro[mro.index(mixin) + 1 :]
    return [
        cls
        for cls in below
        if name in vars(cls)
        and not issubclass(NeuralNet, cls)
        and cls.__module__.split(".")[0] not in ("accel_mixin", "skorch")
    ]


def check_overrides(net, mixin):
    """Refuse an override that the accelerator's configuration would skip."""
    if plain_backward(net.accelerator):
        return
    classes = overrides_below(net, mixin, "train_step_single")
    if classes:
        name = classes[0].__qualname__
        raise ValueError(
            f"{name}.train_step_single cannot run under AccelerateMixin with gradient "
            "accumulation or a gradient scaler: its loss.backward() would bypass "
            "accelerate's loss scaling. Override train_step_single on the class that "
            "puts AccelerateMixin first (class Net(AccelerateMixin, "
            f"{name}) ) and call self.accelerator.backward(loss) there, or move the "
            "change into infer or get_loss, which the mixin calls."
        )


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
