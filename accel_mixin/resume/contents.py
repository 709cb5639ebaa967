"""What a training state holds, collected on every rank.

Tensors and plain values (they load with ``weights_only=True``): the weights
of every module and criterion, the optimizers, the ``LRScheduler``
callbacks' schedulers, the gradient scaler, every rank's random number
generators, the history, the position of training (epochs done,
accumulation step, the training data's generators) and the callbacks'
fitted state (``callback_state``). A state saved inside an epoch also
holds each rank's part of that epoch (``partial_epoch``). ``shared_state``
is what every layout shares; ``state_folder`` lays it out as the keys of one
DCP folder, and reads a folder, or the single file of earlier releases
(version 1), into that file's layout, which ``load`` reads.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from skorch.callbacks import (
    Callback,
    EarlyStopping,
    EpochScoring,
    LRScheduler,
)

from accel_mixin.checkpoint.plain_values import (
    as_plain,
    cpu_snapshot,
    history_state,
)
from accel_mixin.checkpoint.weights import strip_wrapper_prefixes
from accel_mixin.resume.callback_state import BEST_WEIGHTS, callback_state
from accel_mixin.training.resumed_order import generator_states

if TYPE_CHECKING:
    from accelerate import Accelerator
    from skorch import NeuralNet
    from torch.utils.data import DataLoader

    from accel_mixin.training.net_objects import NetObjects

__all__ = [
    "BEST_IS_CURRENT",
    "BEST_WEIGHTS",
    "FORMAT",
    "VERSION",
    "partial_epoch",
    "shared_state",
    "train_iterator_state",
    "warn_if_inside_accumulation",
]

# the tag every saved state holds (this module's name when it was first
# written): a saved value, not an import path, so it never follows renames
FORMAT = "accel_mixin.resume.training_state"
VERSION = 1
BEST_IS_CURRENT = "accel_mixin:best_model_weights_are_the_current_ones"


def warn_if_inside_accumulation(accelerator: Accelerator) -> None:
    """Warn on the main process where a state saved now misses the gradients
    accumulated since the last optimizer step."""
    # accelerate's step counts the batches since the last sync (0 at a
    # dataloader's end with sync_with_dataloader)
    steps = accelerator.gradient_accumulation_steps
    if steps > 1 and accelerator.step % steps and accelerator.is_main_process:
        warnings.warn(
            "The training state is saved inside a window of gradient accumulation (without "
            "sync_with_dataloader, windows run on over an epoch's end): the gradients "
            "accumulated in it are not saved, so a run resumed from it steps where the "
            "uninterrupted one does, but without them, and does not repeat it exactly. "
            "Keep sync_with_dataloader=True for exact resumes.",
            RuntimeWarning,
        )


def train_iterator_state(train_iterator: DataLoader | None) -> dict[str, Any]:
    """What decides the order of ``train_iterator``'s next epoch."""
    return {
        "generators": generator_states(train_iterator),
        "iteration": getattr(train_iterator, "iteration", None),
    }


def partial_epoch(
    net: NeuralNet,
    batch_count: int,
    epoch_rng: dict[str, Any] | None,
    stream: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """This rank's part of the unfinished epoch: its row, the predictions of
    ``EpochScoring(on_train=True)``, the generators the epoch began with
    (``epoch_rng``) and where its stream stopped (``stream``: None where the
    training data is no stream)."""
    return {
        "row": history_state([net.history[-1]])[0],
        "batch_count": batch_count,
        "epoch_rng": epoch_rng,
        "stream": stream,
        "caches": {
            name: cpu_snapshot(as_plain([list(cb.y_preds_), list(cb.y_trues_)]))
            for name, cb in net.callbacks_
            if isinstance(cb, EpochScoring) and cb.on_train and hasattr(cb, "y_preds_")
        },
    }


def shared_state(
    net: NeuralNet,
    objects: NetObjects,
    train_iterator_state: dict[str, Any],
    stopped: bool = False,
    position: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """What every rank holds alike of ``net``'s training state, as plain
    values: all but the modules, optimizers, generators and each rank's part
    of an unfinished epoch. ``train_iterator_state`` decides the next epoch's
    order (inside an epoch, that epoch's); ``stopped`` says that training
    ends here (``EarlyStopping``); ``position`` is ``(batches,
    batch_count)`` inside an epoch: the batches done, and how many of them
    held real samples."""
    accelerator = net.accelerator
    rows = net.history if position is None else net.history[:-1]
    schedulers = {}
    for name, cb in net.callbacks_:
        scheduler = objects.scheduler(name, cb) if isinstance(cb, LRScheduler) else None
        if scheduler is not None:
            # a plateau scheduler keeps skorch's NumPy float, which
            # weights_only loading refuses
            schedulers[name] = as_plain(scheduler.state_dict())
    return {
        "format": FORMAT,
        "version": VERSION,
        "num_processes": accelerator.num_processes,
        "epoch": len(rows),
        "schedulers": schedulers,
        "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
        "history": history_state(rows),
        "callbacks": {name: _callback_state(net, name, cb) for name, cb in net.callbacks_},
        "loop": {
            "accumulation_step": int(accelerator.step),
            "train_iterator": train_iterator_state,
            "stopped": bool(stopped),
            "batches": position[0] if position is not None else 0,
        },
    }


def _callback_state(net: NeuralNet, name: str, cb: Callback) -> dict[str, Any]:
    # EarlyStopping(load_best=True)'s copy of the best weights is kept only
    # where it differs from the weights saved anyway
    state = callback_state(cb, name, warn=net.accelerator.is_main_process)
    if isinstance(cb, EarlyStopping) and state.get(BEST_WEIGHTS) is not None:
        current = cb.best_epoch_ == net.history[-1, "epoch"]
        state[BEST_IS_CURRENT] = current
        # under the bare module's keys, which fit any process layout
        state[BEST_WEIGHTS] = None if current else strip_wrapper_prefixes(state[BEST_WEIGHTS])
    return state
