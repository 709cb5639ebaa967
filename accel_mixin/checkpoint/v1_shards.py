"""Training states of earlier releases under FSDP2 (read only): a file, and
beside it a folder of shards that ``torch.distributed.checkpoint`` (DCP)
wrote, which the file names.

Such a file holds, in place of each sharded entry (the module, its
optimizers' state, ``EarlyStopping``'s best weights), a marker
``{SHARDED: "<file's name>.shards-<token>"}`` naming the folder, relative to
the file's own. The loaders here read those entries into a module sharded
over any number of processes or not sharded at all (DCP reshards), each
rank reading the pieces of what it holds; ``load_module_from`` and its kin
read the entries of today's folders (``resume.state_folder``) alike. A load
that fails tells a damaged folder from a net of other parameters
(``shard_damage``). Every rank must see the folder: on several machines, a
filesystem they share.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch

from accel_mixin.checkpoint import object_states, storage
from accel_mixin.checkpoint.dcp_folder import (
    checkpoint_exception,
    failures,
    load_folder,
    partial_folder,
)
from accel_mixin.checkpoint.shard_damage import SHARDED, damaged_message, is_damage
from accel_mixin.distributed.sharding import reshard
from accel_mixin.errors import CheckpointError

__all__ = [
    "SHARDED",
    "is_sharded_entry",
    "load_best_weights_from",
    "load_module_from",
    "load_optimizer_from",
    "load_sharded_best_weights",
    "load_sharded_module",
    "load_sharded_optimizer",
    "remove_training_state",
    "restore_groups",
]

_SUFFIX = ".shards-"
_FOLDER_RE = re.compile(r"^(?P<file>.+)\.shards-[0-9a-f]+$")


def _state_dict_api() -> ModuleType:
    # pylint: disable=import-outside-toplevel
    from torch.distributed.checkpoint import state_dict

    return state_dict


def is_sharded_entry(value: object) -> bool:
    """Whether ``value`` (an entry of a training state) is a marker that
    names a folder of shards."""
    return isinstance(value, dict) and SHARDED in value


def _folder_of(source: str, entry: Mapping[str, Any], what: str) -> str:
    folder = os.path.join(os.path.dirname(os.path.abspath(source)), entry[SHARDED])
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        raise CheckpointError(
            damaged_message(
                source,
                folder,
                f"rank {rank} finds no {os.path.join(folder, '.metadata')}, which keeps the "
                f"shards of {what}; on several machines, save training states on a "
                "filesystem every machine shares",
            )
        )
    return folder


def _load(target: dict[str, Any], folder: str, source: str, what: str) -> dict[str, Any]:
    """DCP's load of ``target`` (a nested dict of tensors, filled in place),
    plain values read ``weights_only``; its errors as ``CheckpointError``
    naming the file."""
    try:
        load_folder(target, folder)
    except checkpoint_exception() as exc:  # on every rank, with every rank's failure
        if is_damage(exc):
            raise CheckpointError(damaged_message(source, folder, failures(exc))) from None
        raise CheckpointError(
            f"{source} does not fit {what}: reading its shards in {folder} failed "
            f"({failures(exc)}). The state was saved from a net with other parameters: "
            "initialize the net as it was when it was saved."
        ) from None
    return target


def _nested(keys: Sequence[str], value: Any) -> Any:
    for key in reversed(keys):
        value = {key: value}
    return value


def _inside(state: Any, keys: Iterable[str]) -> Any:
    for key in keys:
        state = state[key]
    return state


def load_module_from(
    module: torch.nn.Module, folder: str, keys: Sequence[str], source: str, name: str
) -> None:
    """Load the module state under ``keys`` of the DCP folder ``folder``
    into ``module``, sharded or not (DCP reshards); every rank calls it."""
    api = _state_dict_api()
    reshard(module)
    template = api.get_model_state_dict(module)
    if not template:  # nothing to load (a criterion without parameters)
        return
    state = _load(_nested(keys, template), folder, source, name)
    api.set_model_state_dict(module, _inside(state, keys))


def load_optimizer_from(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: str,
    keys: Sequence[str],
    source: str,
    name: str,
) -> list[dict[str, Any]]:
    """Load the optimizer state under ``keys`` of ``folder`` (keyed by
    ``module``'s parameter names) into ``optimizer``; returns its param
    groups as saved."""
    api = _state_dict_api()
    reshard(module)
    # a fresh optimizer's state is created here (torch steps it with zero
    # gradients and a learning rate of 0), so that DCP has tensors to fill
    template = api.get_optimizer_state_dict(module, optimizer)
    loaded = _inside(_load(_nested(keys, template), folder, source, name), keys)
    api.set_optimizer_state_dict(module, optimizer, loaded)
    return loaded["param_groups"]


def load_best_weights_from(
    module: torch.nn.Module, folder: str, keys: Sequence[str], source: str, name: str
) -> dict[str, Any]:
    """``EarlyStopping``'s best weights under ``keys`` of ``folder``, as a
    state dict laid out as ``module``'s own (sharded or not), under its bare
    keys."""
    reshard(module)
    like = {key: copy.deepcopy(value) for key, value in module.state_dict().items()}
    return _inside(_load(_nested(keys, like), folder, source, name), keys)


def load_sharded_module(
    module: torch.nn.Module, source: str, entry: Mapping[str, Any], name: str
) -> None:
    """Load the shards that ``entry`` names into ``module``, sharded or not."""
    load_module_from(module, _folder_of(source, entry, name), ("module",), source, name)


def load_sharded_optimizer(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    source: str,
    entry: Mapping[str, Any],
    name: str,
) -> None:
    """Load the optimizer state that ``entry`` names into ``optimizer`` over
    ``module``'s parameters, sharded or not."""
    folder = _folder_of(source, entry, name)
    load_optimizer_from(module, optimizer, folder, ("optimizers", entry["name"]), source, name)
    # torch's loader keeps only the keys the groups had (a scheduler's
    # initial_lr is lost); the file has the groups as optimizer.state_dict()
    restore_groups(optimizer, entry["param_groups"])


def restore_groups(optimizer: torch.optim.Optimizer, groups: Iterable[Mapping[str, Any]]) -> None:
    """The hyperparameters of ``groups`` (saved param groups) back into
    ``optimizer``'s, which torch's loader drops (a scheduler's ``initial_lr``)."""
    for group, saved in zip(optimizer.param_groups, groups):
        group.update((key, value) for key, value in saved.items() if key != "params")


def load_sharded_best_weights(
    module: torch.nn.Module, source: str, entry: Mapping[str, Any], name: str
) -> dict[str, Any]:
    """``EarlyStopping``'s best weights that ``entry`` names, as a state dict
    laid out as ``module``'s own (sharded or not), under its bare keys."""
    folder = _folder_of(source, entry, name)
    return load_best_weights_from(module, folder, ("best", entry["name"]), source, name)


def remove_training_state(path: str | os.PathLike[str]) -> None:
    """Remove the training state ``path``: a folder, or an earlier release's
    file and its folders of shards."""
    if storage.is_url(path):
        object_states.remove_state(str(path))
        return
    if os.path.isdir(path) and not os.path.islink(path):
        # renamed aside first: a crash halfway leaves no folder under its name
        # that looks whole and is not
        aside = partial_folder(path, secrets.token_hex(6))
        with contextlib.suppress(OSError):
            os.rename(path, aside)
            shutil.rmtree(aside, ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    directory = os.path.dirname(os.path.abspath(path))
    prefix = os.path.basename(os.fspath(path)) + _SUFFIX
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            if entry.startswith(prefix) and _FOLDER_RE.match(entry):
                shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
