"""``load_state``'s steps, in Lightning's order, each a collective section
that fails on every rank if it fails on one: ``read`` the state;
``restore_weights`` into the unwrapped modules; prepare (the net's own);
``restore_training``: optimizers, scaler and history, returning what can
only go back where the uninterrupted run had it, a ``plan.ResumePlan``.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

from skorch.history import History

from accel_mixin.checkpoint import storage
from accel_mixin.checkpoint.dcp_folder import (
    METADATA,
    checkpoint_exception,
    failures,
    is_state_folder,
    read_full,
    saved_keys,
    set_aside,
)
from accel_mixin.checkpoint.object_states import MARKER
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
from accel_mixin.checkpoint.weights import load_module_state, read_state
from accel_mixin.distributed.sharding import sharded
from accel_mixin.errors import CheckpointError
from accel_mixin.resume.contents import (
    BEST_WEIGHTS,
    FORMAT,
    VERSION,
)
from accel_mixin.resume.plan import ResumePlan
from accel_mixin.resume.state_folder import (
    InFolder,
    as_single_file,
    by_position,
    owner_module,
    read_whole,
)
from accel_mixin.training.net_objects import NetObjects

if TYPE_CHECKING:
    import torch
    from skorch import NeuralNet

__all__ = ["read", "restore_training", "restore_weights"]


def read(net: NeuralNet, path: str) -> dict[str, Any]:
    """The training state at ``path``, for ``net``: a folder (sharded nets
    read all but what they load in place) or an earlier release's file."""
    if storage.is_url(path) or os.path.isdir(path):
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
        what = f"no {MARKER}" if storage.is_url(path) else f"a folder without {METADATA}"
        raise CheckpointError(
            f"{path} has {what}: not a training state saved by save_state, "
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
