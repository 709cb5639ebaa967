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

from accel_mixin.wrapping import PreparedObjects

__all__ = ['ATTRIBUTE', 'ProcessState', 'process_state']

ATTRIBUTE = 'accelerate_process_'


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
    # what a load_state restored that the next fit still has to apply
    pending: dict = field(default_factory=dict)
    # set by load_state: the next fit goes on from the loaded state
    resumed: Optional[dict] = None
    in_train_begin: bool = False  # load_state called by a callback's on_train_begin
    stopping: bool = False  # the epoch that ends now is where EarlyStopping stops

    def forget_loaded_state(self):
        self.pending = {}
        self.resumed = None


def process_state(net):
    """The net's process-local state, made on first use."""
    state = net.__dict__.get(ATTRIBUTE)
    if state is None:
        state = net.__dict__[ATTRIBUTE] = ProcessState()
    return state
