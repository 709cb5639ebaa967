"""What a net holds for this process only, never pickled.

``ProcessState`` lives in the net's ``accelerate_process_`` attribute (skorch's
``get_params`` skips names ending in "_"; ``__getstate__`` drops it) and holds
what outlives a fit: prepared objects, coordinator, the save in flight, a loaded state's
plan. ``FitContext`` holds one ``partial_fit``'s own state; ``fit`` is the
running (or last) fit's, where skorch's call chain, which cannot carry it, finds it.
"""

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from accel_mixin.distributed.control import coordinator_for
from accel_mixin.training.stepping import Stepper
from accel_mixin.training.wrapping import PreparedObjects

__all__ = ["ATTRIBUTE", "FitContext", "ProcessState", "process_state"]

ATTRIBUTE = "accelerate_process_"


@dataclass
class FitContext:
    """One fit's state, made by ``partial_fit``."""

    fit_params: dict = field(default_factory=dict)
    identity: Any = None  # the run identity, once computed (runs.py)
    stepper: Optional[Stepper] = None
    train_iterator: Any = None  # a weak reference to the training dataloader
    # while training batches run: (batches done, batches with real samples)
    position: Optional[tuple] = None
    epoch_start_iterator: Optional[dict] = None  # the shuffling state the epoch began with
    epoch_start_rng: Optional[dict] = None  # this rank's generators when it began

    def running_train_iterator(self):
        """The training dataloader of this fit, or None."""
        return self.train_iterator() if self.train_iterator is not None else None

    def track(self, iterator):
        self.train_iterator = weakref.ref(iterator)


@dataclass
class ProcessState:
    """The process-local fields of a net; see the module's docstring."""

    prepared: PreparedObjects = field(default_factory=PreparedObjects)
    coordinator: Optional[tuple] = None  # (accelerator, its coordinator)
    save_in_flight: Any = None  # an asynchronous save of a DCP folder (checkpoint.state_saves)
    save_group: Any = None  # the gloo group of asynchronous saves beside NCCL
    plan: Any = None  # what a loaded training state gives the next fit (resume/resuming.py)
    keep_loaded: bool = False  # while a fit goes on from a loaded state
    fit: FitContext = field(default_factory=FitContext)
    idle_stepper: Optional[Stepper] = None  # for steps outside a fit

    def forget_loaded_state(self):
        self.plan = None

    def coordinator_for(self, accelerator):
        """The coordinator of ``accelerator``, made once per accelerator."""
        if self.coordinator is None or self.coordinator[0] is not accelerator:
            self.coordinator = (accelerator, coordinator_for(accelerator))
        return self.coordinator[1]

    def stepper_for(self, accelerator):
        """The running fit's stepper, else one kept for ``accelerator``."""
        for stepper in (self.fit.stepper, self.idle_stepper):
            if stepper is not None and stepper.accelerator is accelerator:
                return stepper
        self.idle_stepper = Stepper(accelerator)
        return self.idle_stepper


def process_state(net):
    """The net's process-local state, made on first use."""
    state = net.__dict__.get(ATTRIBUTE)
    if state is None:
        state = net.__dict__[ATTRIBUTE] = ProcessState()
    return state
