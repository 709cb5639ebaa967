"""What a net keeps in this process between its calls, never pickled.

``NetLocal`` lives in the net's ``accelerate_process_`` attribute (skorch's
``get_params`` skips names ending in "_"; ``__getstate__`` drops it) and holds
what outlives a fit: prepared objects, the control of its accelerator, its
asynchronous saves, a loaded state's plan, and the running (or last) fit
(``training.fit``), which save_state between fits and the steps skorch calls
without it find there. Only the net's own modules read it (tests/test_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from accel_mixin.checkpoint.state_saves import StateSaves
from accel_mixin.distributed.control import Control, coordinator_for
from accel_mixin.training.fit import Fit
from accel_mixin.training.stepping import Stepper
from accel_mixin.training.wrapping import PreparedObjects

if TYPE_CHECKING:
    from accelerate import Accelerator
    from skorch import NeuralNet

    from accel_mixin.resume.plan import ResumePlan

__all__ = ["ATTRIBUTE", "NetLocal", "net_local"]

ATTRIBUTE = "accelerate_process_"


@dataclass
class NetLocal:
    """The process-local fields of a net; see the module's docstring."""

    prepared: PreparedObjects = field(default_factory=PreparedObjects)
    control: tuple[Accelerator, Control] | None = None  # (accelerator, its control)
    saves: StateSaves = field(default_factory=StateSaves)
    # what a loaded training state gives the next fit, from load_state to
    # that fit's fit_loop, which moves it into the Fit: a plan here never began
    loaded: ResumePlan | None = None
    going_on: bool = False  # inside a fit() that goes on from a loaded state
    fit: Fit = field(default_factory=Fit)
    idle_stepper: Stepper | None = None  # for steps outside a fit

    def coordinator(self, accelerator: Accelerator) -> Control:
        """The control of ``accelerator``, made once per accelerator."""
        if self.control is None or self.control[0] is not accelerator:
            self.control = (accelerator, coordinator_for(accelerator))
        return self.control[1]

    def stepper(self, accelerator: Accelerator) -> Stepper:
        """The running fit's stepper, else one kept for ``accelerator``."""
        for stepper in (self.fit.stepper, self.idle_stepper):
            if stepper is not None and stepper.accelerator is accelerator:
                return stepper
        self.idle_stepper = Stepper(accelerator)
        return self.idle_stepper


def net_local(net: NeuralNet) -> NetLocal:
    """The net's process-local holder, made on first use."""
    local: NetLocal | None = net.__dict__.get(ATTRIBUTE)
    if local is None:
        local = net.__dict__[ATTRIBUTE] = NetLocal()
    return local
