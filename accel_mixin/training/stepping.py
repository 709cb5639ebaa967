"""What accelerate adds to skorch's training step, for one fit.

skorch's own ``train_step``, ``train_step_single``, ``_step_optimizer`` and
``_zero_grad_optimizer`` run (and so do a user's overrides of them); the net's
optimizers are accelerate's ``AcceleratedOptimizer``, whose ``step`` and
``zero_grad`` do nothing on the micro-batches of an accumulation window, and
step and update the gradient scaler on the last. ``Stepper`` holds what the
mixin adds around those calls:

- ``accumulate``: ``accelerator.accumulate`` over the wrapped modules, so that
  DDP syncs gradients only on the last micro-batch of a window; a no-op
  without accumulation, where every batch syncs.
- ``plain_backward``: whether accelerate's ``backward`` is just
  ``loss.backward()`` (no accumulation, no scaler, no engine that runs
  backward itself); then skorch's ``train_step_single`` runs as it is.
- deferred zeroing: skorch zeroes the gradients before each forward pass,
  which inside an accumulation window would discard the window's gradients
  on its last micro-batch. With accumulation the zeroing waits until the
  optimizers stepped (accelerate's order).
- ``unscale``: once per optimizer step, before ``on_grad_computed``, so that
  callbacks see (and clip) the true gradients.
- ``one_scaler_update``: one gradient scaler update after every optimizer
  stepped, as torch's recipe for several optimizers says (accelerate updates
  after each, and the next optimizer's gradients are then unscaled twice).
- ``closure``: a step closure whose loss is averaged over the processes, for
  optimizers such as LBFGS that act on it.
"""

import contextlib

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

__all__ = ["Stepper", "plain_backward", "takes_closures", "uses_closure_value"]

# accelerate's backward is loss.backward() there, without accumulation or scaler
_PLAIN_BACKWARD_TYPES = frozenset(
    {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}
)


def plain_backward(accelerator):
    """Whether ``accelerator.backward(loss)`` is ``loss.backward()``."""
    return (
        accelerator.gradient_accumulation_steps == 1
        and accelerator.scaler is None
        and accelerator.distributed_type in _PLAIN_BACKWARD_TYPES
        and not getattr(accelerator, "has_lomo_optimizer", False)
        and type(accelerator).backward is Accelerator.backward
        and "backward" not in vars(accelerator)
    )


def takes_closures(accelerator):
    """Whether optimizers step with skorch's closure: not with a gradient
    scaler, which cannot step with one, nor with gradient accumulation,
    where a closure that zeroes the gradients would discard the
    accumulated ones."""
    return accelerator.scaler is None and accelerator.gradient_accumulation_steps == 1


def uses_closure_value(optimizer):
    """Whether ``optimizer.step(closure)`` may act on the loss that the
    closure returns: LBFGS does, and so may any optimizer whose ``step`` is
    not one of torch's own, which only compute the gradients with it."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, torch.optim.LBFGS):
        return True
    return not getattr(type(inner).step, "__module__", "").startswith("torch.optim.")


class Stepper:
    """What the mixin adds to skorch's training step, for one fit.

    Parameters
    ----------
    accelerator : accelerate.Accelerator
      The prepared accelerator; its configuration is read once.

    """

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.steps = accelerator.gradient_accumulation_steps
        self.takes_closures = takes_closures(accelerator)
        self.plain_backward = plain_backward(accelerator)
        self.num_processes = accelerator.num_processes
        self._autocast = accelerator.autocast if accelerator.native_amp else contextlib.nullcontext
        # while a train_step with accumulation runs, zeroing waits for its end
        self.deferring = False
        # within a step: whether its optimizers step with closures
        self.closures = None
        self._unscaled = False

    @property
    def sync_gradients(self):
        return self.accelerator.gradient_state.sync_gradients

    def autocast(self):
        return self._autocast()

    def accumulate(self, get_modules):
        """``accelerator.accumulate(*get_modules())``, a no-op without accumulation."""
        if self.steps == 1:
            return contextlib.nullcontext()
        return self.accelerator.accumulate(*get_modules())

    @contextlib.contextmanager
    def step_window(self, closures):
        """One training step; with accumulation (and no closures), skorch's
        zeroing before the forward pass waits until the block ends."""
        self._unscaled = False
        self.closures = closures
        self.deferring = self.steps > 1 and not closures
        try:
            yield
        finally:
            self.deferring = False
            self.closures = None

    def unscale(self, optimizers):
        """Divide the gradients of ``optimizers`` by the gradient scaler's
        scale, once per step; the scaler then steps without unscaling again.
        A no-op without a scaler."""
        scaler = self.accelerator.scaler
        if scaler is None or self._unscaled:
            return
        self._unscaled = True
        for optimizer in optimizers:
            scaler.unscale_(getattr(optimizer, "optimizer", optimizer))

    def closures_for(self, optimizers):
        """Whether ``optimizers`` step with skorch's closure: where one of them
        acts on the loss it returns, and nothing forbids closures."""
        return self.takes_closures and any(uses_closure_value(o) for o in optimizers)

    def closure(self, step_fn):
        """``step_fn``, returning the loss averaged over the processes: each
        process's own loss would let LBFGS stop its iterations at different
        points on different processes, and their gradient syncs would no
        longer match."""
        if self.num_processes == 1:
            return step_fn
        accelerator = self.accelerator

        def averaged():
            return accelerator.reduce(step_fn().detach(), reduction="mean")

        return averaged

    @contextlib.contextmanager
    def one_scaler_update(self):
        """Within the block the gradient scaler's ``update`` is held back;
        it runs once at the end if any optimizer asked for it."""
        scaler = self.accelerator.scaler
        if scaler is None:
            yield
            return
        asked = []
        scaler.update = lambda new_scale=None: asked.append(new_scale)
        try:
            yield
        finally:
            del scaler.update  # the class's method again
        if asked:
            scaler.update(asked[-1])
