"""What a callback keeps in a training state, as the callback declares it.

A callback of your own declares its state as accelerate's
``register_for_checkpointing`` expects of an object: ``state_dict()``
returns it (tensors and plain Python values), ``load_state_dict(state)``
puts it back. skorch's callbacks do not declare theirs, so this module
names, for each one accel_mixin supports, the fitted attributes that a
resumed run needs: ``EarlyStopping``'s counters and best weights, the
scorers' best scores, ``LRScheduler``'s batch count, ``LoadInitState``'s
note that it loaded. Everything else a callback holds is rebuilt by the
fit (predictions cached for an epoch, a scheduler object, a progress bar)
or belongs to the process that runs (timers, where output goes).

A callback that declares nothing and is not one of skorch's keeps nothing.
Where it has fitted attributes (names ending with ``_``) that a file could
hold, a warning on the main process names them.
"""

import warnings
import weakref

from skorch.callbacks import Callback, EarlyStopping, LoadInitState, LRScheduler, PassthroughScoring
from skorch.callbacks.scoring import ScoringBase

from accel_mixin.checkpoint.state_values import NOT_PLAIN, as_plain, plain_or_not

__all__ = ["callback_state", "restore_callback_state"]

# the callbacks already warned about: a save runs under filters of its own,
# which reset Python's memory of the warnings it showed
_WARNED = weakref.WeakSet()

# skorch's callbacks, by class (subclasses included): the fitted attributes
# a resumed run needs
SKORCH_STATE = {
    EarlyStopping: ("misses_", "dynamic_threshold_", "best_epoch_", "best_model_weights_"),
    ScoringBase: ("best_score_",),
    PassthroughScoring: ("best_score_",),
    LRScheduler: ("batch_idx_",),
    LoadInitState: ("did_load_",),
}


def _declared(callback):
    """The names of ``callback``'s state by skorch's table, or None where
    it is no callback of skorch's (a skorch callback the table does not name
    keeps nothing: timers, loggers, progress bars)."""
    mro = type(callback).__mro__
    for cls in mro:
        if cls in SKORCH_STATE:
            return SKORCH_STATE[cls]
    if any(cls is not Callback and cls.__module__.split(".")[0] == "skorch" for cls in mro):
        return ()
    return None


def callback_state(callback, name="", warn=False):
    """The state of ``callback`` as tensors and plain values.

    ``state_dict()`` where the callback has one; else the attributes
    ``SKORCH_STATE`` names for its class; else nothing, which ``warn`` (the
    main process) says where the callback has fitted attributes that a
    file could hold.
    """
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


def restore_callback_state(callback, state):
    """Put back what ``callback_state`` returned for the same callback."""
    if callable(getattr(callback, "load_state_dict", None)):
        callback.load_state_dict(state)
        return
    for key, value in state.items():
        setattr(callback, key, value)
