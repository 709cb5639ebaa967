"""What accelerate adds around skorch's training step.

skorch's ``train_step``, ``train_step_single``, ``_step_optimizer`` and
``_zero_grad_optimizer`` run, and a user's overrides of them. Around them:
``accelerator.accumulate``, with the zeroing after the step rather than
before the forward pass, which would discard a window's gradients;
``on_grad_computed`` only where the optimizers step, on unscaled gradients;
skorch's closure (its loss averaged over the ranks) for optimizers that act
on its loss (LBFGS), else the gradients computed once and one scaler update
for all optimizers (torch's recipe); and ``accelerator.backward`` where it is
not ``loss.backward()``, with an override of ``train_step_single`` below the
mixin then refused. The net's overrides that call it are ``net.steps``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from skorch.net import NeuralNet

from accel_mixin.distributed.sharding import sharded
from accel_mixin.internals import compiled_inner

if TYPE_CHECKING:
    from accelerate.optimizer import AcceleratedOptimizer

__all__ = [
    "Stepper",
    "check_overrides",
    "clear_gradients",
    "plain_backward",
    "takes_closures",
]

_PLAIN_BACKWARD_TYPES = frozenset(
    {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}
)


def plain_backward(accelerator: Accelerator) -> bool:
    """Whether ``accelerator.backward(loss)`` is ``loss.backward()``."""
    return (
        accelerator.gradient_accumulation_steps == 1
        and accelerator.scaler is None
        and accelerator.distributed_type in _PLAIN_BACKWARD_TYPES
        and not getattr(accelerator, "has_lomo_optimizer", False)
        and type(accelerator).backward is Accelerator.backward
        and "backward" not in vars(accelerator)
    )


def takes_closures(accelerator: Accelerator) -> bool:
    """Whether optimizers may step with a closure: not with a gradient scaler,
    nor with accumulation, where the closure's zeroing would lose gradients."""
    return accelerator.scaler is None and accelerator.gradient_accumulation_steps == 1


def _uses_closure_value(optimizer: torch.optim.Optimizer) -> bool:
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, torch.optim.LBFGS):
        return True
    return not getattr(type(inner).step, "__module__", "").startswith("torch.optim.")


class Stepper:
    """What the mixin adds to skorch's training step, read once from ``accelerator``."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.steps = accelerator.gradient_accumulation_steps
        self.takes_closures = takes_closures(accelerator)
        self.plain_backward = plain_backward(accelerator)
        self.num_processes = accelerator.num_processes
        # under FSDP2 mixed precision is FSDP's policy, as in accelerate's own loop
        amp = accelerator.native_amp and not sharded(accelerator)
        self._autocast: Callable[[], AbstractContextManager[None]] = (
            accelerator.autocast if amp else contextlib.nullcontext
        )
        # accelerate's forward patch returns fp32 outputs; FSDP2's low
        # precision outputs would reach skorch's scorers and numpy
        self.fp32_outputs = sharded(accelerator) and accelerator.mixed_precision != "no"
        self.deferring = False  # zeroing waits for the end of the train_step
        # within a step: whether its optimizers step with closures
        self.closures: bool | None = None
        self.loss_weight = 1.0  # this rank's share of the step's real samples (shares.py)
        self._unscaled = False

    @property
    def sync_gradients(self) -> bool:
        return self.accelerator.gradient_state.sync_gradients

    def autocast(self) -> AbstractContextManager[None]:
        return self._autocast()

    def accumulate(
        self, get_modules: Callable[[], list[torch.nn.Module]]
    ) -> AbstractContextManager[None]:
        """``accelerator.accumulate(*get_modules())``, a no-op without accumulation."""
        if self.steps == 1:
            return contextlib.nullcontext()
        modules = get_modules()
        if sharded(self.accelerator):
            # FSDP2 holds back the gradients' reduction of sharded modules only
            modules = [m for m in modules if hasattr(m, "set_requires_gradient_sync")]
        return self.accelerator.accumulate(*modules)

    @contextlib.contextmanager
    def step_window(self, closures: bool) -> Iterator[None]:
        """One training step; with accumulation and no closures, zeroing waits."""
        self._unscaled = False
        self.closures = closures
        self.deferring = self.steps > 1 and not closures
        try:
            yield
        finally:
            self.deferring = False
            self.closures = None

    @contextlib.contextmanager
    def weighting(self, weight: float) -> Iterator[None]:
        """Within the block the training loss's gradient is ``weight`` times its own."""
        self.loss_weight = weight
        try:
            yield
        finally:
            self.loss_weight = 1.0

    def unscale(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Unscale the gradients of ``optimizers`` once per step (no-op without a scaler)."""
        scaler = self.accelerator.scaler
        if scaler is None or self._unscaled:
            return
        self._unscaled = True
        for optimizer in optimizers:
            scaler.unscale_(getattr(optimizer, "optimizer", optimizer))

    def closures_for(self, optimizers: Iterable[torch.optim.Optimizer]) -> bool:
        """Whether ``optimizers`` step with skorch's closure."""
        return self.takes_closures and any(_uses_closure_value(o) for o in optimizers)

    def closure(self, step_fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """``step_fn`` with its loss averaged over the processes, so that LBFGS
        iterates alike on every rank and the gradient syncs match."""
        if self.num_processes == 1:
            return step_fn
        accelerator = self.accelerator
        return lambda: accelerator.reduce(step_fn().detach() * self.loss_weight, reduction="mean")

    @contextlib.contextmanager
    def one_scaler_update(self, optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[None]:
        """Within the block the prepared ``optimizers`` hold back the scaler's
        ``update``; it runs once after.

        accelerate's optimizer updates its scaler after its own step, which
        would unscale the next optimizer's gradients with a new scale. The
        optimizers are this net's, so each gets a scaler of its own for the
        block; the accelerator's, which others may share, is left as it is.
        """
        scaler = self.accelerator.scaler
        # the prepared optimizers: accelerate's, with a scaler
        held: list[AcceleratedOptimizer] = [
            o for o in optimizers if scaler is not None and getattr(o, "scaler", None) is scaler
        ]
        if not held:
            yield
            return
        deferred = _DeferredUpdate(scaler)
        for optimizer in held:
            optimizer.scaler = deferred
        try:
            yield
        finally:
            for optimizer in held:
                optimizer.scaler = scaler
        if deferred.asked:
            scaler.update(deferred.asked[-1])


class _DeferredUpdate:
    """A gradient scaler whose ``update`` is recorded, not run; everything
    else is the scaler's own."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self._scaler = scaler
        self.asked: list[float | torch.Tensor | None] = []

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self.asked.append(new_scale)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scaler, name)


@contextlib.contextmanager
def recognisable_criterion(net: NeuralNet) -> Iterator[None]:
    """Within the block a compiled ``NLLLoss`` criterion is the loss itself.

    skorch compiles criteria too (``compile=True``), and
    ``NeuralNetClassifier.get_loss`` no longer recognises a compiled
    ``NLLLoss``: it skips the log and trains on ``-p`` (skorch 1.4.0, plain
    or with its ``AccelerateMixin``). The criterion stays compiled, as
    skorch's own tests require; a loss is a kernel or two, and gains nothing
    from it.
    """
    criterion = vars(net).get("criterion_")
    inner = compiled_inner(criterion) if criterion is not None else None
    if not isinstance(inner, torch.nn.NLLLoss):
        yield
        return
    vars(net)["criterion_"] = inner
    try:
        yield
    finally:
        vars(net)["criterion_"] = criterion


def check_overrides(net: NeuralNet, mixin: type) -> None:
    """Refuse a ``train_step_single`` below the mixin that accelerate's backward would skip."""
    if plain_backward(net.accelerator):
        return
    mro = type(net).__mro__
    classes = [
        cls
        for cls in mro[mro.index(mixin) + 1 :]
        if "train_step_single" in vars(cls)
        and not issubclass(NeuralNet, cls)
        and cls.__module__.split(".")[0] not in ("accel_mixin", "skorch")
    ]
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


def clear_gradients(modules: Iterable[torch.nn.Module], optimizers: Iterable[object]) -> None:
    """Drop every gradient of ``modules`` and of the tensors ``optimizers`` hold,
    so that an interrupted fit's half-accumulated gradients do not leak."""
    for module in modules:
        for param in module.parameters():
            param.grad = None
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.Optimizer):
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
