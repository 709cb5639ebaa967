"""Carry an Accelerator through pickle as settings, not as state.

An Accelerator's state lives in per-process singletons; pickled as is, it
would arrive with stale private copies (another rank, another dataloader's
gradient state) and every object it prepared. A pickled net carries the
settings, and unpickling builds an Accelerator on this process's live state.
A deep copy keeps the same Accelerator, as accelerate itself does.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from skorch.callbacks import PrintLog

from accel_mixin.distributed.process_layout import check_not_a_child_of_a_rank, sink_for
from accel_mixin.training.net_objects import NetObjects

__all__ = ["PortableAccelerator", "accelerator_settings", "build_accelerator", "settle_unpickled"]

if TYPE_CHECKING:
    from skorch import NeuralNet

_HANDLERS = ("ddp_handler", "scaler_handler", "init_handler", "autocast_handler")


def accelerator_settings(accelerator: Accelerator) -> dict[str, Any]:
    """The keyword arguments that rebuild ``accelerator`` in another process."""
    return {
        "device_placement": accelerator.device_placement,
        "mixed_precision": str(accelerator.mixed_precision),
        "cpu": accelerator.device.type == "cpu",
        "dataloader_config": accelerator.dataloader_config,
        "gradient_accumulation_plugin": GradientAccumulationPlugin(
            **accelerator.gradient_state.plugin_kwargs
        ),
        "step_scheduler_with_optimizer": accelerator.step_scheduler_with_optimizer,
        "rng_types": list(accelerator.rng_types),
        "kwargs_handlers": [
            handler
            for handler in (getattr(accelerator, name, None) for name in _HANDLERS)
            if handler is not None
        ],
    }


def build_accelerator(settings: dict[str, Any]) -> Accelerator:
    """An Accelerator from ``settings`` on this process's live state; where that
    state has other settings, which cannot change, a warning names them."""
    check_not_a_child_of_a_rank()
    try:
        return Accelerator(**settings)
    except (ValueError, RuntimeError) as exc:
        warnings.warn(
            "accel_mixin: the unpickled net's accelerator settings "
            f"(mixed_precision={settings['mixed_precision']!r}, cpu={settings['cpu']}) "
            f"cannot be used in this process ({exc}); using the accelerate "
            "state this process already has.",
            RuntimeWarning,
        )
        return Accelerator(gradient_accumulation_plugin=settings["gradient_accumulation_plugin"])


class PortableAccelerator:
    """Stand-in for an Accelerator inside a net's pickled state."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def __deepcopy__(self, memo: dict[int, Any]) -> Accelerator:
        return self.accelerator

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        return build_accelerator, (accelerator_settings(self.accelerator),)


def settle_unpickled(net: NeuralNet, objects: NetObjects) -> None:
    """Make an unpickled net this process's: its 'auto' print sink (resolved
    by the rank that pickled), its modules (``objects``) on the accelerator's
    device."""
    if net.callbacks__print_log__sink == "auto":
        for _, cb in getattr(net, "callbacks_", []):
            if isinstance(cb, PrintLog):
                cb.sink = sink_for(net.accelerator)
    if net.accelerator.device_placement:
        for _, module in objects.named_modules():
            module.to(net.accelerator.device)
