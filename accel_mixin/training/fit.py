"""One fit's state, made by the net when a fit begins and passed down.

``partial_fit`` (every ``fit`` goes through it) makes one ``Fit`` per call;
the modules a fit crosses get it as a parameter and read or set its fields,
instead of reaching into the net.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from accel_mixin.training.stepping import Stepper

__all__ = ["EpochResume", "EpochStart", "Fit"]


class EpochResume(Protocol):
    """What a fit applies of a loaded training state at its epochs
    (``resume.plan.ResumePlan``)."""

    def at_epoch_begin(self, train_iterator: DataLoader | None) -> dict[str, Any] | None: ...

    def resume_point(self) -> dict[str, Any] | None: ...


@dataclass
class EpochStart:
    """What a state saved inside an epoch replays the epoch from."""

    shuffling: dict[str, Any]  # the training data's order as the epoch began
    rng: dict[str, Any]  # this rank's generators as the epoch began


@dataclass
class Fit:
    """One ``fit`` or ``partial_fit`` call's state."""

    fit_params: dict[str, Any] = field(default_factory=dict)  # without skorch's "_" keys
    stepper: Stepper | None = None  # once the callbacks' on_train_begin ran
    plan: EpochResume | None = None  # a loaded state this fit goes on from
    identity: Any = None  # its resume.runs.RunIdentity, once computed
    train_iterator: weakref.ref[DataLoader] | None = None
    # while training batches run: (batches done, batches with real samples)
    position: tuple[int, int] | None = None
    epoch_start: EpochStart | None = None
    # whether every rank runs all callbacks (notifications.runs_everywhere),
    # for the per-batch notifications; None: to be looked at again, as every
    # section notification (an epoch's begin, say) makes it
    everywhere: bool | None = None

    def train_iterator_now(self) -> DataLoader | None:
        """The training dataloader of this fit, while it exists."""
        return self.train_iterator() if self.train_iterator is not None else None

    def running_train_iterator(self) -> DataLoader:
        """The training dataloader its batches run from, as ``get_iterator``
        returned it; an override that bypasses the mixin's is named."""
        iterator = self.train_iterator_now()
        if iterator is None:
            raise TypeError(
                "The training batches did not come from AccelerateMixin.get_iterator: "
                "an override of get_iterator must return super().get_iterator(...), "
                "which prepares the DataLoader for every process and lets training "
                "states record its order"
            )
        return iterator
