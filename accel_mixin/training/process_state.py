"""What a net holds for this process only, never pickled.

``ProcessState`` lives in the net's ``accelerate_process_`` attribute (skorch's
``get_params`` skips names ending in "_"; ``__getstate__`` drops it) and holds
what outlives a fit: prepared objects, coordinator, the save in flight, a loaded state's
plan, and the running (or last) fit (``training.fit``), which save_state
between fits and the steps skorch calls without it find there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from accel_mixin.distributed.control import Control, coordinator_for
from accel_mixin.training.fit import Fit
from accel_mixin.training.stepping import Stepper
from accel_mixin.training.wrapping import PreparedObjects

if TYPE_CHECKING:
    from accelerate import Accelerator
    from skorch import NeuralNet

__all__ = ["ATTRIBUTE", "ProcessState", "process_state"]

ATTRIBUTE = "accelerate_process_"


@dataclass
class ProcessState:
    """The process-local fields of a net; see the module's docstring."""

    prepared: PreparedObjects = field(default_factory=PreparedObjects)
    coordinator: tuple[Accelerator, Control] | None = None  # (accelerator, its coordinator)
    save_in_flight: Any = None  # an asynchronous save of a DCP folder (checkpoint.state_saves)
    save_group: Any = None  # the gloo group of asynchronous saves beside NCCL
    # what a loaded training state gives the next fit (resume/resuming.py),
    # from load_state to that fit's fit_loop, which moves it into the Fit
    plan: Any = None
    keep_loaded: bool = False  # while a fit goes on from a loaded state
    fit: Fit = field(default_factory=Fit)
    idle_stepper: Stepper | None = None  # for steps outside a fit

    def coordinator_for(self, accelerator: Accelerator) -> Control:
        """The coordinator of ``accelerator``, made once per accelerator."""
        if self.coordinator is None or self.coordinator[0] is not accelerator:
            self.coordinator = (accelerator, coordinator_for(accelerator))
        return self.coordinator[1]

    def stepper_for(self, accelerator: Accelerator) -> Stepper:
        """The running fit's stepper, else one kept for ``accelerator``."""
        for stepper in (self.fit.stepper, self.idle_stepper):
            if stepper is not None and stepper.accelerator is accelerator:
                return stepper
        self.idle_stepper = Stepper(accelerator)
        return self.idle_stepper


def process_state(net: NeuralNet) -> ProcessState:
    """The net's process-local state, made on first use."""
    state: ProcessState | None = net.__dict__.get(ATTRIBUTE)
    if state is None:
        state = net.__dict__[ATTRIBUTE] = ProcessState()
    return state
