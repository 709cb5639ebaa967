"""accelerate's per-batch calls, without their per-call cost where it buys nothing.

``accelerator.accumulate``, ``accelerator.backward``, ``accelerator.autocast``
and ``AcceleratedOptimizer.step``/``zero_grad`` walk accelerate's state
singletons, inspect signatures and look up optional packages on every call:
about 0.4 ms per training step on this machine, 20% of a small model's step.
Where their effect is a few lines, ``Stepper`` runs those lines itself (its
``plain`` path); everywhere else it calls accelerate.

The plain path is a whitelist: it is taken only where every condition it was
verified under holds, so that anything new or unknown goes through
accelerate. ``tests/test_stepping.py`` compares it bit for bit with
accelerate's calls in each covered configuration (1 process in fp32, bf16
and CPU fp16, 2 DDP processes; with and without accumulation) and checks the
fallback in each uncovered one. The conditions, read once per fit except
where said:

- ``distributed_type`` is NO, MULTI_CPU or MULTI_GPU: the tests run the
  first two, and MULTI_GPU's calls relabelled over the same DDP. DeepSpeed
  and Megatron-LM run backward themselves, XLA reduces gradients in the
  optimizer's step, FSDP shards them and FSDP2 stops their syncs its own
  way. MULTI_XPU, MULTI_NPU, MULTI_MLU, MULTI_SDAA, MULTI_MUSA, MULTI_HPU
  and MULTI_NEURON go through the same lines as MULTI_GPU in accelerate
  1.15, but on vendor runtimes (lazy graphs on HPU, XLA under Neuron) that
  nothing here has run: they wait for a test there, and meanwhile lose only
  the per-call saving.
- ``mixed_precision`` is no, bf16 or fp16 (fp16 gets here only without a
  scaler: on the CPU, which accelerate leaves in fp32). fp8 backends
  replace modules and optimizers (MS-AMP) with their own.
- No gradient scaler: accelerate scales the loss, and steps and updates the
  scaler, in its calls.
- No LOMO optimizer: its backward steps, and accelerate skips its step.
- ``backward``, ``accumulate`` and ``autocast`` are ``Accelerator``'s own,
  neither overridden by a subclass nor replaced on the instance: whoever
  replaces them means them to run.
- Per optimizer, checked at every call (a fraction of a microsecond): an
  ``AcceleratedOptimizer`` whose ``step`` is its class's own.

``zero_grad`` skips accelerate's for every ``AcceleratedOptimizer`` whose
``zero_grad`` is its class's own, scaler or not: accelerate's has no more
to it than the check that gradients sync, and the inner optimizer's
``zero_grad`` then gets the arguments skorch gives it, as in plain skorch
(accelerate would pass ``set_to_none=True`` to a ``zero_grad`` of the
optimizer's own whose default differs).

The ``GradientAccumulationPlugin``'s options need no condition: with
accumulation the plain path enters ``accelerator.accumulate`` itself, which
applies ``sync_with_dataloader`` and ``sync_each_batch``; without, every
batch syncs whatever they say. Only ``accelerator.step``, the count of
batches that decides when to sync, then stays put: every batch syncs anyway.
"""

import contextlib

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

__all__ = ["Stepper", "takes_closures", "uses_closure_value"]

COVERED_TYPES = frozenset(
    {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}
)
COVERED_PRECISIONS = frozenset({"no", "bf16", "fp16"})
_OWN_METHODS = ("backward", "accumulate", "autocast")


def _own(obj, cls, name):
    """Whether ``obj.name`` is ``cls``'s method, not a subclass's or the instance's."""
    return (
        isinstance(obj, cls)
        and getattr(type(obj), name) is getattr(cls, name)
        and name not in vars(obj)
    )


def _plain_optimizer(optimizer):
    """Whether ``optimizer``'s step may skip accelerate's."""
    return _own(optimizer, AcceleratedOptimizer, "step")


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
    """Backward, step, zero_grad, accumulate and autocast for one fit.

    Built when training starts: it reads the accelerator's configuration once.

    Parameters
    ----------
    accelerator : accelerate.Accelerator
      The prepared accelerator.

    Attributes
    ----------
    plain : bool
      Whether the calls take the plain path: where every condition of the
      module's docstring holds.

    """

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.steps = accelerator.gradient_accumulation_steps
        self.takes_closures = takes_closures(accelerator)
        self.num_processes = accelerator.num_processes
        self.plain = (
            accelerator.distributed_type in COVERED_TYPES
            and accelerator.mixed_precision in COVERED_PRECISIONS
            and accelerator.scaler is None
            and not getattr(accelerator, "has_lomo_optimizer", False)
            and all(_own(accelerator, Accelerator, name) for name in _OWN_METHODS)
        )
        self._autocast = (
            accelerator.autocast
            if accelerator.native_amp or not self.plain
            else contextlib.nullcontext
        )
        if self.plain and self.steps == 1:
            # without accumulation every step syncs; accumulate() would only
            # set this again before every batch
            accelerator.gradient_state._set_sync_gradients(True)  # pylint: disable=protected-access

    @property
    def sync_gradients(self):
        return self.accelerator.gradient_state.sync_gradients

    def autocast(self):
        return self._autocast()

    def accumulate(self, get_modules):
        """``accelerator.accumulate(*get_modules())``, a no-op without accumulation."""
        if self.plain and self.steps == 1:
            return contextlib.nullcontext()
        return self.accelerator.accumulate(*get_modules())

    def unscale(self, optimizers):
        """Divide the gradients of ``optimizers`` by the gradient scaler's scale.

        Once per optimizer step, before anything reads the gradients; the
        scaler then steps without unscaling again. A no-op without a scaler.
        """
        scaler = self.accelerator.scaler
        if scaler is None:
            return
        for optimizer in optimizers:
            scaler.unscale_(getattr(optimizer, "optimizer", optimizer))

    def backward(self, loss):
        if not self.plain:
            self.accelerator.backward(loss)
            return
        if self.steps > 1:
            loss = loss / self.steps
        loss.backward()

    def step_all(self, optimizers):
        """Step every optimizer; with a gradient scaler, update it once.

        accelerate's ``AcceleratedOptimizer.step`` updates the shared scaler
        after each optimizer, which forgets that the next one's gradients
        were unscaled already and unscales them a second time. torch's
        recipe for several optimizers is one ``scaler.step`` each, then one
        ``update``: the scaler's update is held back until the last one.
        """
        scaler = self.accelerator.scaler
        if scaler is None or len(optimizers) < 2:
            for optimizer in optimizers:
                self.step(optimizer)
            return
        scaler.update = _no_update
        try:
            for optimizer in optimizers[:-1]:
                self.step(optimizer)
        finally:
            del scaler.update  # the class's method again
        self.step(optimizers[-1])

    def closures_for(self, optimizers):
        """Whether ``optimizers`` step with skorch's closure: where one of them
        acts on the loss it returns, and nothing forbids closures."""
        return self.takes_closures and any(uses_closure_value(o) for o in optimizers)

    def step(self, optimizer, closure=None):
        """Step ``optimizer``, with ``closure`` if given.

        Under several processes, an optimizer that may act on the loss the
        closure returns gets the loss averaged over the processes: each
        process's own loss would let LBFGS stop its iterations at different
        points on different processes, and their gradient syncs would no
        longer match.
        """
        if closure is not None and self.num_processes > 1 and uses_closure_value(optimizer):
            closure = _averaged(closure, self.accelerator)
        args = () if closure is None else (closure,)
        if not (self.plain and _plain_optimizer(optimizer)):
            optimizer.step(*args)
        elif self.sync_gradients:
            optimizer.optimizer.step(*args)

    def zero_grad(self, optimizer, set_to_none=None):
        kwargs = {} if set_to_none is None else {"set_to_none": set_to_none}
        if _own(optimizer, AcceleratedOptimizer, "zero_grad"):
            if not self.sync_gradients:
                return
            # what AcceleratedOptimizer.zero_grad does, without inspecting
            # the signature on every call, and with skorch's arguments
            optimizer = optimizer.optimizer
        optimizer.zero_grad(**kwargs)


def _averaged(closure, accelerator):
    def averaged():
        return accelerator.reduce(closure().detach(), reduction="mean")

    return averaged


def _no_update(new_scale=None):  # pylint: disable=unused-argument
    """Stands in for ``GradScaler.update`` until the last optimizer stepped."""
