"""What a net holds for this process only.

The objects accelerate prepared, the coordinator and stepper of the current
accelerator, the asynchronous writer and its CPU copy, the training
iterator of the running fit, and what a loaded training state still has to
give the next fit. All of it belongs to one process: pickles, copies,
``get_params`` and ``clone`` leave it out. It lives in one attribute,
``accelerate_process_``, whose name ends with "_" so that skorch's
``get_params`` skips it, and which ``AccelerateMixin.__getstate__`` drops.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

from accel_mixin.checkpoint.background import BackgroundWriter
from accel_mixin.distributed.coordination import coordinator_for
from accel_mixin.training.stepping import Stepper
from accel_mixin.training.wrapping import PreparedObjects

__all__ = ["ATTRIBUTE", "ProcessState", "process_state"]

ATTRIBUTE = "accelerate_process_"


@dataclass
class ProcessState:
    """The process-local fields of a net; see the module's docstring."""

    prepared: PreparedObjects = field(default_factory=PreparedObjects)
    # the accelerator the coordinator and the stepper were made for
    coordinator: Optional[tuple] = None
    stepper: Any = None
    writer: Any = None
    snapshot: Any = None  # the CPU copy that asynchronous saves reuse, for one fit
    train_iterator: Any = None  # a weak reference to the running fit's dataloader
    # what a loaded training state gives the next fit (resume/resuming.py)
    plan: Any = None
    # while a fit goes on from a loaded state: initialize() keeps it
    keep_loaded: bool = False
    # while an epoch's training batches run: (batches done, batches with real
    # samples), what a training state saved there records
    position: Optional[tuple] = None
    epoch_start_iterator: Optional[dict] = None  # the shuffling state the epoch began with
    epoch_start_rng: Optional[dict] = None  # this rank's generators when it began
    # the running fit's fit parameters and, once computed, its run identity
    # (runs.py): the checkpoint callbacks share one, hashing the data once
    fit_params: dict = field(default_factory=dict)
    identity: Any = None

    def forget_loaded_state(self):
        self.plan = None

    def coordinator_for(self, accelerator):
        """The coordinator of ``accelerator``, made once per accelerator."""
        if self.coordinator is None or self.coordinator[0] is not accelerator:
            self.coordinator = (accelerator, coordinator_for(accelerator))
        return self.coordinator[1]

    def stepper_for(self, accelerator):
        """The stepper of ``accelerator``; training makes a fresh one."""
        if self.stepper is None or self.stepper.accelerator is not accelerator:
            self.stepper = Stepper(accelerator)
        return self.stepper

    def running_train_iterator(self):
        """The training dataloader of the running (or last) fit, or None."""
        return self.train_iterator() if self.train_iterator is not None else None

    def background_writer(self):
        if self.writer is None:
            self.writer = BackgroundWriter()
        return self.writer


def process_state(net):
    """The net's process-local state, made on first use."""
    state = net.__dict__.get(ATTRIBUTE)
    if state is None:
        state = net.__dict__[ATTRIBUTE] = ProcessState()
    return state
