"""The plan a training state leaves for the next fit (``load.restore_training``
makes it): what can only go back where the uninterrupted run had it. The
next fit applies it, each part once: at train begin (after the callbacks
reset), once prepared (``EarlyStopping``'s best weights under the wrapped
keys) and at the first epoch's begin (generators; inside an epoch, its part
done).
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from accel_mixin.checkpoint.weights import strip_wrapper_prefixes
from accel_mixin.resume.callback_state import BEST_WEIGHTS, restore_callback_state
from accel_mixin.resume.contents import BEST_IS_CURRENT, train_iterator_state
from accel_mixin.training.fit import EpochStart, Fit
from accel_mixin.training.resumed_order import restore_generator_states
from accel_mixin.training.rng import restore_rng, rng_state

if TYPE_CHECKING:
    from skorch import NeuralNet
    from torch.utils.data import DataLoader

    from accel_mixin.training.net_objects import NetObjects

__all__ = ["ResumePlan", "begin_epoch", "continue_epoch"]

# the parts of a fit, in order; each method applies its part once
_LOADED, _TRAINING, _PREPARED, _EPOCH = range(4)


@dataclass
class ResumePlan:
    """The parts of a training state that go back during the next fit.

    ``rng`` is this rank's generators as the next epoch begins (None where
    fewer ranks saved the state, or inside an epoch); ``partial_epoch`` is,
    inside an epoch, this rank's part of it (``row``, ``caches``,
    ``epoch_rng``, ``batch_count``), the ``batches`` done and the generators
    after the last of them (``rng``).
    """

    stopped: bool  # EarlyStopping stopped the run: the next fit trains nothing
    accumulation_step: int
    callbacks: dict[str, Any]
    schedulers: dict[str, Any]
    optimizer_groups: dict[str, Any]  # param_groups by optimizer name
    rng: dict[str, Any] | None
    train_iterator: dict[str, Any]
    partial_epoch: dict[str, Any] | None = None
    _stage: int = _LOADED
    _best_weights: dict[str, tuple[bool, Any]] = field(default_factory=dict)
    _resume_point: dict[str, Any] | None = None

    def epochs_to_train(self, net: NeuralNet, epochs: int | None) -> int:
        """``epochs`` where given, else those left up to ``max_epochs``
        (none after an early stop)."""
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

    def _enter(self, stage: int) -> bool:
        if self._stage != stage - 1:
            return False
        self._stage = stage
        return True

    def at_train_begin(self, net: NeuralNet, objects: NetObjects) -> None:
        """After the callbacks' ``on_train_begin``, which resets them and the
        accumulation step (``objects``: the net's)."""
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
        # a scheduler built after the restore set the optimizer's learning
        # rate (and momentum) anew from the restored history's epoch count;
        # the saved hyperparameters are the ones to go on with
        for name, groups in self.optimizer_groups.items():
            for group, saved in zip(objects.raw(name).param_groups, groups):
                group.update({key: value for key, value in saved.items() if key != "params"})

    def once_prepared(self, net: NeuralNet) -> None:
        """``EarlyStopping``'s best weights, under the keys of ``module_`` as
        it is wrapped now, which it loads them into when training ends."""
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

    def at_epoch_begin(self, train_iterator: DataLoader | None) -> dict[str, Any] | None:
        """The generators as the uninterrupted run had them when the first
        resumed epoch began; the epoch's part done inside it, else None."""
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
            # a sampler without a generator of its own, or a dataloader's
            # seed, draws from the global ones before any batch
            restore_rng(partial["epoch_rng"])
            self._resume_point = partial
        return partial

    def resume_point(self) -> dict[str, Any] | None:
        """The epoch's part done, once, for the resumed epoch's batches."""
        point, self._resume_point = self._resume_point, None
        return point


def begin_epoch(fit: Fit) -> dict[str, Any] | None:
    """When an epoch of ``fit`` begins, before the callbacks: apply the
    plan's epoch part, and keep the order and generators this epoch begins
    with for states saved inside it. Returns the unfinished epoch a state
    from inside it holds."""
    iterator = fit.train_iterator_now()
    partial = fit.plan.at_epoch_begin(iterator) if fit.plan is not None else None
    fit.epoch_start = EpochStart(train_iterator_state(iterator), rng_state())
    return partial


def continue_epoch(net: NeuralNet, partial: dict[str, Any]) -> None:
    """After the callbacks' ``on_epoch_begin`` (which starts a row and
    empties caches): the unfinished epoch's row and caches back."""
    net.history[-1] = partial["row"]
    device = net.accelerator.device
    callbacks = dict(net.callbacks_)
    for name, (preds, trues) in partial["caches"].items():
        callbacks[name].y_preds_ = [p.to(device) if hasattr(p, "to") else p for p in preds]
        callbacks[name].y_trues_ = list(trues)
