"""What a loaded training state still gives the next fit, and when.

``load_state`` (and ``ResumeTraining``, which calls it) restores weights,
optimizers, the gradient scaler and the history at once. The rest can only
go back later, where the uninterrupted run had it: a ``ResumePlan`` holds it
and applies each part once, in the order of a fit:

1. ``at_train_begin``, after the callbacks' ``on_train_begin`` (which reset
   their counters and build the LR schedulers): the callbacks' state, the
   schedulers' state, the optimizers' hyperparameters and accelerate's count
   of accumulation steps;
2. ``once_prepared``: ``EarlyStopping``'s best weights, under the keys of the
   module as it is wrapped now;
3. ``at_epoch_begin``, when the first resumed epoch begins: the random number
   generators and the generators of the training data's order; for a state
   from inside an epoch, those the epoch began with, and the epoch's part
   done (``resume_point``) for its batches to skip.

The plan belongs to the one fit that follows the load: the next fit drops it.
"""

import copy
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from accel_mixin.checkpoint.state_dict import strip_wrapper_prefixes
from accel_mixin.checkpoint.state_values import restore_rng
from accel_mixin.resume.callback_state import restore_callback_state
from accel_mixin.resume.loader_rng import restore_generator_states
from accel_mixin.training.net_objects import raw

__all__ = ["BEST_IS_CURRENT", "BEST_WEIGHTS", "ResumePlan"]

BEST_WEIGHTS = "best_model_weights_"
BEST_IS_CURRENT = "accel_mixin:best_model_weights_are_the_current_ones"

# the parts of a fit, in order; each method applies its part once
_LOADED, _TRAINING, _PREPARED, _EPOCH = range(4)


@dataclass
class ResumePlan:
    """The parts of a training state that go back during the next fit.

    Attributes
    ----------
    stopped : bool
      Whether the run was stopped early: the next fit trains no epoch.

    accumulation_step : int
      accelerate's count of accumulation steps.

    callbacks, schedulers, optimizer_groups : dict
      The callbacks' state, the LR schedulers' state and the optimizers'
      hyperparameters (``param_groups`` without the parameters), by name.

    rng : dict or None
      This rank's generators as the next epoch begins (a state of an
      epoch's end; None where the state was saved by fewer ranks).

    train_iterator : dict
      The training data's generators and accelerate's count of its epochs.

    partial_epoch : dict or None
      For a state from inside an epoch: this rank's part of it (``row``,
      ``caches``, ``epoch_rng``, ``batch_count``), the ``batches`` done and
      the generators after the last of them (``rng``).

    """

    stopped: bool
    accumulation_step: int
    callbacks: dict
    schedulers: dict
    optimizer_groups: dict
    rng: Optional[dict]
    train_iterator: dict
    partial_epoch: Optional[dict] = None
    fitting: bool = False  # whether the fit it belongs to has begun
    _stage: int = _LOADED
    _best_weights: dict = field(default_factory=dict)
    _resume_point: Optional[dict] = None

    def epochs_to_train(self, net, epochs):
        """The epochs the fit trains: those that remain up to ``max_epochs``,
        none if the run was stopped early, or ``epochs`` where given."""
        if epochs is not None:
            return epochs
        if self.stopped:
            warnings.warn(
                f"The training state resumed from ends where EarlyStopping stopped "
                f"training, after epoch {len(net.history)}: no epochs are trained. "
                "To train on regardless, call partial_fit(X, y, epochs=n).",
                RuntimeWarning,
            )
            return 0
        return max(net.max_epochs - len(net.history), 0)

    def _enter(self, stage):
        if self._stage != stage - 1:
            return False
        self._stage = stage
        return True

    def at_train_begin(self, net):
        """After the callbacks' ``on_train_begin``: their state, the state of
        the schedulers they built, and the count of accumulation steps, which
        ``on_train_begin`` sets to 0 for a fresh fit."""
        if not self._enter(_TRAINING):
            return
        net.accelerator.step = self.accumulation_step
        callbacks = dict(net.callbacks_)
        for name, cb_state in self.callbacks.items():
            if name in callbacks:
                if BEST_IS_CURRENT in cb_state:
                    cb_state = dict(cb_state)
                    self._best_weights[name] = (
                        cb_state.pop(BEST_IS_CURRENT),
                        cb_state.pop(BEST_WEIGHTS),
                    )
                restore_callback_state(callbacks[name], cb_state)
        for name, cb in net.callbacks_:
            scheduler = getattr(cb, "lr_scheduler_", None)
            if name in self.schedulers and scheduler is not None:
                scheduler.load_state_dict(self.schedulers[name])
        # A scheduler built after the restore (a callback after ResumeTraining,
        # or a load_state before fit) was built with last_epoch from the restored
        # history, and its constructor set the learning rate (and momentum) of
        # the optimizer anew; the saved hyperparameters are the ones to go on with.
        for name, groups in self.optimizer_groups.items():
            optimizer = raw(net, name)
            for group, saved in zip(optimizer.param_groups, groups):
                group.update({key: value for key, value in saved.items() if key != "params"})

    def once_prepared(self, net):
        """Once the modules are prepared: ``EarlyStopping``'s best weights,
        under the keys of ``module_`` as it is now wrapped, which is what it
        loads them into when training ends."""
        if not self._enter(_PREPARED):
            return
        callbacks = dict(net.callbacks_)
        for name, (current, weights) in self._best_weights.items():
            module_state = net.module_.state_dict()
            if current:
                callbacks[name].best_model_weights_ = copy.deepcopy(module_state)
                continue
            # wrapped keys by the bare keys they end in
            keys = strip_wrapper_prefixes(OrderedDict((key, key) for key in module_state))
            callbacks[name].best_model_weights_ = OrderedDict(
                (keys.get(key, key), value) for key, value in weights.items()
            )
        self._best_weights = {}

    def at_epoch_begin(self, train_iterator):
        """When the first resumed epoch begins, before the callbacks: the
        generators as the uninterrupted run had them there. Returns the
        epoch's part done for a state from inside it, else None."""
        if not self._enter(_EPOCH):
            return None
        partial = self.partial_epoch
        if partial is None and self.rng is not None:
            restore_rng(self.rng)
        if train_iterator is not None:
            restore_generator_states(train_iterator, self.train_iterator.get("generators", []))
            iteration = self.train_iterator.get("iteration")
            if iteration is not None and hasattr(train_iterator, "iteration"):
                train_iterator.iteration = iteration
        if partial is not None:
            # the generators as the epoch began: a sampler without a generator
            # of its own, a dataloader's seed, draw from them before any batch
            restore_rng(partial["epoch_rng"])
            self._resume_point = partial
        return partial

    def resume_point(self):
        """The epoch's part done, once, for the resumed epoch's batches."""
        point, self._resume_point = self._resume_point, None
        return point
