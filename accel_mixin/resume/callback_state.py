"""What a callback keeps in a training state.

A callback keeps what it declares as accelerate's
``register_for_checkpointing`` expects (``state_dict()`` and
``load_state_dict(state)``); skorch's callbacks declare nothing, so
``SKORCH_STATE`` names the fitted attributes a resumed run needs of those
accel_mixin supports. Any other callback keeps nothing, and the main process
warns once where it has fitted attributes that a file could hold.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from skorch.callbacks import (
    Callback,
    EarlyStopping,
    LoadInitState,
    LRScheduler,
    PassthroughScoring,
)
from skorch.callbacks.scoring import ScoringBase

from accel_mixin.checkpoint.plain_values import NOT_PLAIN, as_plain, plain_or_not

__all__ = ["BEST_WEIGHTS", "SKORCH_STATE", "callback_state", "restore_callback_state"]

BEST_WEIGHTS = "best_model_weights_"

# skorch's callbacks, by class (subclasses included): the fitted attributes
# a resumed run needs
SKORCH_STATE: dict[type, tuple[str, ...]] = {
    EarlyStopping: ("misses_", "dynamic_threshold_", "best_epoch_", BEST_WEIGHTS),
    ScoringBase: ("best_score_",),
    PassthroughScoring: ("best_score_",),
    LRScheduler: ("batch_idx_",),
    LoadInitState: ("did_load_",),
}

# a save runs under warning filters of its own, which reset Python's memory
# of the warnings it showed
_WARNED: weakref.WeakSet[Callback] = weakref.WeakSet()


def _declared(callback: Callback) -> tuple[str, ...] | None:
    """The names ``SKORCH_STATE`` gives ``callback``: () for skorch's others
    (timers, loggers, progress bars), None for a callback not skorch's."""
    mro = type(callback).__mro__
    for cls in mro:
        if cls in SKORCH_STATE:
            return SKORCH_STATE[cls]
    if any(cls is not Callback and cls.__module__.split(".")[0] == "skorch" for cls in mro):
        return ()
    return None


def callback_state(callback: Callback, name: str = "", warn: bool = False) -> dict[str, Any]:
    """The state of ``callback`` as tensors and plain values; ``warn`` (the
    main process) says where it declares none but has fitted attributes."""
    if callable(getattr(callback, "state_dict", None)):
        return as_plain(callback.state_dict())
    names = _declared(callback)
    if names is not None:
        values = {key: plain_or_not(vars(callback)[key]) for key in names if key in vars(callback)}
        return {key: value for key, value in values.items() if value is not NOT_PLAIN}
    if warn and callback not in _WARNED:
        fitted = sorted(
            key
            for key, value in vars(callback).items()
            if key.endswith("_")
            and not key.startswith("_")
            and plain_or_not(value) is not NOT_PLAIN
        )
        if fitted:
            _WARNED.add(callback)
            warnings.warn(
                f"The callback {name or type(callback).__name__} "
                f"({type(callback).__qualname__}) has fitted attributes that a training "
                f"state does not keep: {', '.join(fitted)}. Give its class state_dict() and "
                "load_state_dict(state) to keep them, or a state_dict() that returns {} "
                "to say that a resumed run needs none of them.",
                UserWarning,
                stacklevel=2,
            )
    return {}


def restore_callback_state(callback: Callback, state: dict[str, Any]) -> None:
    """Put back what ``callback_state`` returned for the same callback."""
    if callable(getattr(callback, "load_state_dict", None)):
        callback.load_state_dict(state)
        return
    for key, value in state.items():
        setattr(callback, key, value)
