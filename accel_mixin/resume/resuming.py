"""Resuming from a training state: ``load_state``'s steps, and the plan
they leave for the next fit.

``load_state`` runs the steps in Lightning's order, each a collective
section that fails on every rank if it fails on one: ``read`` the state;
``restore_weights`` into the unwrapped modules; prepare (the net's own);
``restore_training``: optimizers, scaler and history, returning what can
only go back where the uninterrupted run had it, a ``ResumePlan``. The next
fit applies it, each part once: at train begin (after the callbacks reset),
once prepared (``EarlyStopping``'s best weights under the wrapped keys) and
at the first epoch's begin (generators; inside an epoch, its part done).
"""

from __future__ import annotations

import copy
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from skorch.history import History

from accel_mixin.checkpoint.dcp_folder import (
    METADATA,
    checkpoint_exception,
    failures,
    is_state_folder,
    read_full,
    saved_keys,
    set_aside,
)
from accel_mixin.checkpoint.params import load_optimizer_state
from accel_mixin.checkpoint.shard_damage import damaged_message
from accel_mixin.checkpoint.v1_shards import (
    is_sharded_entry,
    load_best_weights_from,
    load_module_from,
    load_optimizer_from,
    load_sharded_best_weights,
    load_sharded_module,
    load_sharded_optimizer,
    restore_groups,
)
from accel_mixin.checkpoint.weights import load_module_state, read_state, strip_wrapper_prefixes
from accel_mixin.distributed.sharding import sharded
from accel_mixin.errors import CheckpointError
from accel_mixin.resume.contents import (
    BEST_IS_CURRENT,
    BEST_WEIGHTS,
    FORMAT,
    VERSION,
    restore_callback_state,
    train_iterator_state,
)
from accel_mixin.resume.state_folder import (
    InFolder,
    as_single_file,
    by_position,
    owner_module,
    read_whole,
)
from accel_mixin.training.fit import EpochStart, Fit
from accel_mixin.training.net_objects import NetObjects
from accel_mixin.training.resumed_order import restore_generator_states
from accel_mixin.training.rng import restore_rng, rng_state

if TYPE_CHECKING:
    import torch
    from skorch import NeuralNet
    from torch.utils.data import DataLoader

__all__ = [
    "ResumePlan",
    "begin_epoch",
    "continue_epoch",
    "read",
    "restore_training",
    "restore_weights",
]

# the parts of a fit, in order; each method applies its part once
_LOADED, _TRAINING, _PREPARED, _EPOCH = range(4)


def read(net: NeuralNet, path: str) -> dict[str, Any]:
    """The training state at ``path``, for ``net``: a folder (sharded nets
    read all but what they load in place) or an earlier release's file."""
    if os.path.isdir(path):
        return _read_folder(net, path)
    if not os.path.lexists(path):
        aside = set_aside(path)
        if aside:
            raise CheckpointError(
                f"{path} is missing, but {aside[0]} holds the state saved there before: a "
                "save that replaced it ended between its two renames. Rename that folder to "
                f"{path} to load it."
            )
    # unmapped: optimizers keep the loaded tensors
    state = read_state(path, torch_load_kwargs=net.torch_load_kwargs)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a training state written by save_state; files of "
            "save_params load with load_params."
        )
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"{path} is a training state of version {state.get('version')}; this "
            f"accel_mixin reads version {VERSION}."
        )
    return state


def _read_folder(net: NeuralNet, path: str) -> dict[str, Any]:
    """A training-state folder, as ``_read`` returns a file's: read whole by
    one process or DDP; a sharded net reads all but the modules, optimizers
    and best weights, which it loads into what it holds (``InFolder``)."""
    if not is_state_folder(path):
        raise CheckpointError(
            f"{path} is a folder without {METADATA}: not a training state saved by save_state, "
            "or one whose save did not complete. Load a complete one (ResumeTraining finds "
            "the newest)."
        )
    kwargs = net.torch_load_kwargs
    try:
        if not sharded(net.accelerator):
            return read_whole(path, torch_load_kwargs=kwargs)
        in_folder = {"modules", "optimizers", "best_weights"}
        keys = set(saved_keys(path)) - in_folder
        return as_single_file(read_full(path, keys, torch_load_kwargs=kwargs), folder=path)
    except checkpoint_exception() as exc:
        raise CheckpointError(damaged_message(path, path, failures(exc))) from None


def restore_weights(objects: NetObjects, state: dict[str, Any], source: str) -> None:
    """Load the modules' weights of ``state`` (read from ``source``) into
    the net's unwrapped modules (``objects``)."""
    saved = state["modules"]
    for name, module in objects.named_modules():
        if name not in saved:
            raise CheckpointError(
                f"{source} holds no state for {name}_ (it holds {sorted(saved)}): it was "
                "saved from a net with other modules."
            )
        if isinstance(saved[name], InFolder):
            load_module_from(module, source, saved[name].keys, source, name + "_")
        elif is_sharded_entry(saved[name]):
            load_sharded_module(module, source, saved[name], name + "_")
        else:
            load_module_state(module, saved[name], source=source, name=name + "_")


def restore_training(
    net: NeuralNet, objects: NetObjects, state: dict[str, Any], source: str
) -> ResumePlan:
    """Restore optimizers, scaler and history of ``state`` (read from
    ``source``) into ``net``, prepared (``objects``: its objects); return
    what the next fit applies."""
    accelerator = net.accelerator
    for name, optimizer in objects.raw_optimizers().items():
        if name not in state["optimizers"]:
            raise CheckpointError(f"{source} holds no state for {name}_.")
        saved = state["optimizers"][name]
        if isinstance(saved, InFolder):
            groups = state["optimizer_groups"][name]
            saved = state["optimizers"][name] = _load_optimizer(
                objects, name, saved, groups, source
            )
        elif is_sharded_entry(saved):
            load_sharded_optimizer(
                _module_of(objects, saved, source), optimizer, source, saved, name + "_"
            )
        else:
            load_optimizer_state(optimizer, saved, source=source, name=name + "_")
    _load_sharded_best_weights(objects, state["callbacks"], state["modules"], source)
    if state["scaler"] is not None and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    net.history = History(state["history"])

    loop, rngs, rank = state["loop"], state["rng"], accelerator.process_index
    if loop.get("batches", 0) and len(rngs) != accelerator.num_processes:
        raise CheckpointError(
            f"{source} was saved inside an epoch by {len(rngs)} process(es); each of them "
            f"holds its own part of that epoch, so it resumes on {len(rngs)} processes only, "
            f"not on {accelerator.num_processes}. Resume from a training state of an epoch's "
            "end (training-state-<epoch>) instead."
        )
    if len(rngs) != accelerator.num_processes and accelerator.is_main_process:
        warnings.warn(
            f"{source} was saved by {len(rngs)} process(es) and resumes on "
            f"{accelerator.num_processes}: weights, optimizers and history continue, but "
            "the random number streams differ from the run that saved it, so the "
            "resumed run will not repeat it exactly.",
            RuntimeWarning,
        )
    plan = ResumePlan(
        stopped=loop.get("stopped", False),
        accumulation_step=loop["accumulation_step"],
        callbacks=state["callbacks"],
        schedulers=state["schedulers"],
        optimizer_groups={name: opt["param_groups"] for name, opt in state["optimizers"].items()},
        rng=rngs[rank] if rank < len(rngs) else None,
        train_iterator=loop["train_iterator"],
    )
    if loop.get("batches", 0):
        # the RNGs are those after the last batch done, for the first resumed one
        plan.partial_epoch = dict(
            loop["partial_epoch"][rank], batches=loop["batches"], rng=plan.rng
        )
        plan.rng = None
    return plan


def _load_optimizer(
    objects: NetObjects,
    name: str,
    entry: InFolder,
    groups: list[dict[str, Any]],
    source: str,
) -> dict[str, Any]:
    """Load the optimizer ``name`` from a folder (``entry``; ``groups``: its
    saved hyperparameters) into a sharded net; returns what the plan needs
    of it (its param groups)."""
    optimizer = objects.raw(name)
    owner = owner_module(dict(objects.named_modules()).values(), optimizer)
    if owner is None:  # saved by position (several modules' parameters)
        saved = by_position(read_full(source, ["optimizers"])["optimizers"][name])
        load_optimizer_state(optimizer, saved, source=source, name=name + "_")
        return saved
    load_optimizer_from(owner, optimizer, source, entry.keys, source, name + "_")
    restore_groups(optimizer, groups)
    return {"param_groups": groups}


def _module_of(objects: NetObjects, entry: dict[str, Any], source: str) -> torch.nn.Module:
    """The raw module whose parameters a sharded optimizer entry is over."""
    name = entry["module"]
    if name not in objects.modules:
        raise CheckpointError(
            f"{source} holds the state of {entry['name']}_ over the parameters of {name}_, "
            "which this net does not have: it was saved from a net with other modules."
        )
    module: torch.nn.Module = objects.raw(name)
    return module


def _load_sharded_best_weights(
    objects: NetObjects,
    callbacks: dict[str, Any],
    modules: dict[str, Any],
    source: str,
) -> None:
    """``EarlyStopping``'s best weights that a state saved under FSDP2 keeps
    in its folder of shards, read now (rotation may remove the folder before
    the fit), laid out as the module's own."""
    name = next((n for n, entry in modules.items() if is_sharded_entry(entry)), None)
    named = objects.sharded_module()
    if named is not None and any(isinstance(entry, InFolder) for entry in modules.values()):
        name = named[0]  # the weights of the module FSDP2 shards
    for cb_name, cb_state in callbacks.items():
        entry = cb_state.get(BEST_WEIGHTS)
        if isinstance(entry, InFolder):
            module = _module_of(objects, {"module": name, "name": cb_name}, source)
            cb_state[BEST_WEIGHTS] = load_best_weights_from(
                module, source, entry.keys, source, f"the best weights of {cb_name}"
            )
        elif is_sharded_entry(entry):
            module = _module_of(objects, {"module": name, "name": cb_name}, source)
            cb_state[BEST_WEIGHTS] = load_sharded_best_weights(
                module, source, entry, f"the best weights of {cb_name}"
            )


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
