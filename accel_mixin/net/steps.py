"""AccelerateMixin's overrides of skorch's training and inference steps.

They are the net's own methods, and read what it keeps for this process
(``net.local``); what they add around skorch's steps is the ``Stepper`` of
``training.stepping``, read once from the accelerator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import convert_to_fp32
from skorch.dataset import unpack_data

from accel_mixin.distributed.history_sync import pad_to_largest
from accel_mixin.distributed.process_layout import quiet_unless_main
from accel_mixin.training.shares import scale_gradient
from accel_mixin.training.stepping import Stepper, recognisable_criterion

if TYPE_CHECKING:
    # to the type checker the mixin is the skorch net it is mixed into
    from skorch.net import NeuralNet as _Net
else:
    _Net = object

__all__ = ["StepMixin"]


class StepMixin(_Net):
    """AccelerateMixin's overrides of skorch's training and inference steps."""

    @property
    def _stepper(self) -> Stepper:
        return self._local.stepper(self.accelerator)

    def _optimizers_now(self) -> list[torch.optim.Optimizer]:
        return [getattr(self, name + "_") for name in self._optimizers]

    def _modules_now(self) -> list[torch.nn.Module]:
        """The modules and criteria in place now: DDP wrappers while wrapped."""
        current = [getattr(self, name + "_", None) for name in self._modules + self._criteria]
        return [module for module in current if isinstance(module, torch.nn.Module)]

    def train_step_single(self, batch: Any, **fit_params: Any) -> dict[str, Any]:
        stepper = self._stepper
        if stepper.plain_backward:
            with stepper.autocast():
                return super().train_step_single(batch, **fit_params)
        # accelerate's backward divides the loss for accumulation and scales
        # it for the gradient scaler, which skorch's loss.backward() cannot
        self._set_training(True)
        Xi, yi = unpack_data(batch)
        with stepper.autocast():
            y_pred = self.infer(Xi, **fit_params)
            loss = self.get_loss(y_pred, yi, X=Xi, training=True)
        self.accelerator.backward(loss)
        return {"loss": loss, "y_pred": y_pred}

    def infer(self, x: Any, **fit_params: Any) -> Any:
        y_pred = super().infer(x, **fit_params)
        return convert_to_fp32(y_pred) if self._stepper.fp32_outputs else y_pred

    def get_loss(
        self, y_pred: Any, y_true: Any, X: Any = None, training: bool = False
    ) -> torch.Tensor:
        with recognisable_criterion(self):
            loss = super().get_loss(y_pred, y_true, X=X, training=training)
        # in an epoch's last, partial global batch: this rank's share (shares.py)
        return scale_gradient(loss, self._stepper.loss_weight) if training else loss

    def train_step(self, batch: Any, **fit_params: Any) -> dict[str, Any]:
        """skorch's ``train_step`` within accelerate's gradient accumulation
        (``accel_mixin.training.stepping``)."""
        stepper = self._stepper
        with stepper.accumulate(self._modules_now):
            with stepper.step_window(stepper.closures_for(self._optimizers_now())):
                step = super().train_step(batch, **fit_params)
            if stepper.steps > 1 and stepper.sync_gradients:
                self._zero_grad_optimizer()  # skorch's zeroing, after the step
        return step

    def _step_optimizer(self, step_fn: Callable[[], torch.Tensor] | None) -> None:
        stepper = self._stepper
        closures = stepper.closures
        if closures is None:  # called outside train_step
            closures = stepper.closures_for(self._optimizers_now())
        if step_fn is not None and closures:
            return super()._step_optimizer(stepper.closure(step_fn))
        # compute the gradients once; every optimizer steps on them
        if step_fn is not None:
            step_fn()
        with stepper.one_scaler_update(self._optimizers_now()):
            return super()._step_optimizer(None)

    def _zero_grad_optimizer(self, set_to_none: bool | None = None) -> None:
        if self._stepper.deferring:
            return  # inside an accumulation window: after the step (train_step)
        if set_to_none is None:
            return super()._zero_grad_optimizer()
        return super()._zero_grad_optimizer(set_to_none=set_to_none)

    def validation_step(self, batch: Any, **fit_params: Any) -> dict[str, Any]:
        with self._stepper.autocast():
            return super().validation_step(batch, **fit_params)

    def forward_iter(
        self, X: Any, training: bool = False, device: str | torch.device = "cpu"
    ) -> Iterator[Any]:
        """skorch's ``forward_iter``, after every rank arrived: inference
        gathers from every rank, so a rank that calls ``predict`` alone gets a
        ``DistributedError`` naming both calls instead of a hang."""
        if self.accelerator.num_processes > 1:
            self._coordinator.barrier("inference (predict, predict_proba, forward, score)")
        with quiet_unless_main(self.accelerator):
            yield from super().forward_iter(X, training=training, device=device)

    def evaluation_step(self, batch: Any, training: bool = False) -> Any:
        # autocast here too, so that unwrapped nets predict with the same precision
        with self._stepper.autocast():
            y_infer = super().evaluation_step(batch, training=training)
        y_infer = convert_to_fp32(y_infer)
        if self.accelerator.num_processes > 1:
            y_infer = pad_to_largest(y_infer)
        return self.accelerator.gather_for_metrics(y_infer)
