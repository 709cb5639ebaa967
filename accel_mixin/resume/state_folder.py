"""A training state as the keys of one DCP folder (``checkpoint.dcp_folder``).

``folder_state`` lays out a net's training state (``contents``) as
``torch.distributed.checkpoint`` expects it, the same in every layout:

- ``modules``: ``{name: state dict}`` of every module and criterion under
  its parameters' names (DCP's ``get_model_state_dict``: without wrapper
  prefixes; a module FSDP2 shards holds its shards, which DCP reshards);
- ``optimizers``: ``{name: state dict}`` keyed by parameter names
  (``get_optimizer_state_dict`` over the module that holds its parameters),
  so that a state loads into any layout;
- ``best_weights``: ``{callback name: state dict}``, ``EarlyStopping``'s
  best weights as tensors (sharded where the module is);
- ``rng.rank-<r>`` and, inside an epoch, ``partial.rank-<r>``: each rank
  saves its own, so no rank gathers another's (except where each machine
  writes a whole copy alone, ``save_on_each_node``: its writer saves every
  rank's, gathered);
- ``meta``, ``optimizer_groups`` (every optimizer's hyperparameters,
  ``initial_lr`` included), ``schedulers``, ``scaler``, ``history``,
  ``callbacks``, ``loop``: plain values, one DCP item each
  (``dcp_folder.plain``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from accel_mixin.checkpoint.dcp_folder import plain, read_full, saved_keys, unplain
from accel_mixin.distributed.sharding import reshard, sharded
from accel_mixin.resume.contents import (
    BEST_WEIGHTS,
    FORMAT,
    VERSION,
    partial_epoch,
    shared_state,
)
from accel_mixin.training.rng import rng_state

if TYPE_CHECKING:
    from skorch import NeuralNet

    from accel_mixin.training.net_objects import NetObjects

__all__ = [
    "FOLDER_VERSION",
    "InFolder",
    "as_single_file",
    "by_position",
    "folder_state",
    "in_folder_entries",
    "owner_module",
    "rank_entries",
    "rank_key",
    "read_whole",
]

# version 1 is the single torch file (and its folder of shards under FSDP2)
FOLDER_VERSION = 2


def rank_key(what: str, rank: int) -> str:
    """The key of rank ``rank``'s own entry ``what`` ('rng', 'partial')."""
    return f"{what}.rank-{rank}"


def _api() -> ModuleType:
    # pylint: disable-next=import-outside-toplevel
    from torch.distributed.checkpoint import state_dict

    return state_dict


def owner_module(
    modules: Iterable[torch.nn.Module], optimizer: torch.optim.Optimizer
) -> torch.nn.Module | None:
    """The module among ``modules`` that holds every parameter of
    ``optimizer``, or None."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules:
        if params <= {id(p) for p in module.parameters()}:
            return module
    return None


def _module_state(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s state dict under its parameters' names (a sharded one's
    shards)."""
    if not any(True for _ in module.state_dict(keep_vars=True)):
        return {}  # DCP's refuses an empty one (a criterion without parameters)
    return _api().get_model_state_dict(module)


def _optimizer_state(
    optimizer: torch.optim.Optimizer, modules: Iterable[torch.nn.Module]
) -> dict[str, Any] | tuple[dict[str, Any]]:
    """``optimizer``'s state dict keyed by parameter names where one module
    holds its parameters; else as torch keys it (by position), plain."""
    owner = owner_module(modules, optimizer)
    if owner is None:
        return plain(optimizer.state_dict())
    return _api().get_optimizer_state_dict(owner, optimizer)


def _size(value: object) -> int:
    if isinstance(value, dict):
        return sum(_size(item) for item in value.values())
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _spread(entries: Mapping[str, Any], rank: int, processes: int) -> dict[str, Any]:
    """The entries of ``entries`` (a dict every rank holds alike) that rank
    ``rank`` of ``processes`` writes: the largest first, each to the rank
    that has the least so far, the same on every rank. Each rank then
    copies only its share to CPU memory for an asynchronous save, where
    DCP would stage everything on every rank and write each entry once."""
    loads = [0] * processes
    mine: dict[str, Any] = {}
    for key in sorted(entries, key=lambda key: (-_size(entries[key]), key)):
        owner = loads.index(min(loads))
        loads[owner] += _size(entries[key]) or 1
        if owner == rank:
            mine[key] = entries[key]
    return mine


def _whole(entries: Mapping[str, Any]) -> Mapping[str, Any]:
    return entries


def _spread_optimizer(
    optimizer_state: dict[str, Any] | tuple[dict[str, Any]],
    spread: Callable[[Mapping[str, Any]], Mapping[str, Any]],
) -> dict[str, Any] | tuple[dict[str, Any]]:
    """An optimizer state keyed by names with its per-parameter state
    spread over the ranks (``_spread``); its groups on every rank."""
    if isinstance(optimizer_state, tuple) or "state" not in optimizer_state:
        return optimizer_state
    return dict(optimizer_state, state=spread(optimizer_state["state"]))


def rank_entries(
    net: NeuralNet,
    position: tuple[int, int] | None = None,
    epoch_rng: dict[str, Any] | None = None,
    stream: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """This rank's own entries of a state: its generators and, inside an
    epoch (``position``, as ``contents.shared_state`` takes it, and
    ``epoch_rng``, this rank's generators as that epoch began), its part of
    that epoch, with where its stream stopped (``stream``, where the
    training data is one)."""
    rank = net.accelerator.process_index
    entries = {rank_key("rng", rank): plain(rng_state())}
    if position is not None:
        entries[rank_key("partial", rank)] = plain(
            partial_epoch(net, position[1], epoch_rng, stream)
        )
    return entries


def folder_state(
    net: NeuralNet,
    objects: NetObjects,
    train_iterator_state: dict[str, Any],
    stopped: bool = False,
    position: tuple[int, int] | None = None,
    epoch_rng: dict[str, Any] | None = None,
    ranks: dict[str, Any] | None = None,
    stream: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The training state of ``net`` as the keys of one DCP folder; every
    rank calls it (no collective). The arguments are ``rank_entries``'s and
    ``contents.shared_state``'s; ``ranks``: every rank's ``rank_entries``,
    where this process writes the whole folder alone (each rank's entries
    and every tensor); without it, this rank's own entries (with
    ``stream``, where its stream stopped) and its share of the tensors."""
    accelerator = net.accelerator
    rank = accelerator.process_index
    named = objects.sharded_module() if sharded(accelerator) else None
    if named is not None:
        reshard(named[1])  # named_parameters must be the shards the optimizers hold
    modules = dict(objects.named_modules())
    optimizers = objects.raw_optimizers()
    shared = shared_state(net, objects, train_iterator_state, stopped=stopped, position=position)
    callbacks = shared.pop("callbacks")
    best = {
        name: cb_state.pop(BEST_WEIGHTS)
        for name, cb_state in callbacks.items()
        if cb_state.get(BEST_WEIGHTS) is not None
    }
    spread: Callable[[Mapping[str, Any]], Mapping[str, Any]] = functools.partial(
        _spread, rank=rank, processes=accelerator.num_processes
    )
    if named is not None or ranks is not None:  # its own shards already, or alone
        spread = _whole
    state: dict[str, Any] = {
        "meta": plain(
            {
                "format": FORMAT,
                "version": FOLDER_VERSION,
                "num_processes": accelerator.num_processes,
                "epoch": shared["epoch"],
                # DCP keeps no key of an empty state dict (a criterion's)
                "modules": list(modules),
            }
        ),
        "modules": {name: spread(_module_state(module)) for name, module in modules.items()},
        "optimizers": {
            name: _spread_optimizer(_optimizer_state(optimizer, modules.values()), spread)
            for name, optimizer in optimizers.items()
        },
        "best_weights": {name: spread(weights) for name, weights in best.items()},
        # a sharded net loads optimizers into a template of the groups it has,
        # which lacks what schedulers add (initial_lr): the groups whole
        "optimizer_groups": plain(
            {
                name: [
                    {key: value for key, value in group.items() if key != "params"}
                    for group in optimizer.param_groups
                ]
                for name, optimizer in optimizers.items()
            }
        ),
        "callbacks": plain(callbacks),
    }
    for key in ("schedulers", "scaler", "history", "loop"):
        state[key] = plain(shared[key])
    state.update(rank_entries(net, position, epoch_rng, stream) if ranks is None else ranks)
    return state


def by_position(optimizer_state: dict[str, Any] | tuple[dict[str, Any]]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names as torch keys it, by
    position (the order of its groups' parameters)."""
    if isinstance(optimizer_state, tuple):  # saved by position already
        return unplain(optimizer_state)
    groups = [dict(group) for group in optimizer_state["param_groups"]]
    position: dict[str, int] = {}
    for group in groups:
        group["params"] = [position.setdefault(name, len(position)) for name in group["params"]]
    return {
        # DCP keeps no key of an empty dict: an optimizer without state (SGD)
        "state": {
            position[name]: value for name, value in optimizer_state.get("state", {}).items()
        },
        "param_groups": groups,
    }


@dataclass(frozen=True)
class InFolder:
    """In place of an entry of a state that a sharded net loads from the
    folder itself into what it holds: the entry under ``keys`` of ``path``."""

    path: str
    keys: tuple[str, str]


def in_folder_entries(path: str | os.PathLike[str], names: str) -> dict[str, InFolder]:
    """``{name: InFolder}`` for each of ``names`` ('modules', 'optimizers',
    'best_weights') under which the folder ``path`` keeps entries."""
    found: dict[str, InFolder] = {}
    for fqn in saved_keys(path).get(names, ()):
        parts = fqn.split(".")
        if len(parts) > 1:
            found.setdefault(parts[1], InFolder(os.fspath(path), (names, parts[1])))
    return found


def as_single_file(
    read: dict[str, Any], folder: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """A folder's entries read whole (``dcp_folder.read_full``) laid out as
    the single file of version 1 holds them, for the
    readers of one process and DDP. With ``folder``, for a sharded net: the
    modules, optimizers and best weights, not read, are ``InFolder``
    entries of it."""
    if folder is not None:
        read = dict(
            read,
            **{
                key: in_folder_entries(folder, key)
                for key in ("modules", "optimizers", "best_weights")
            },
        )
    meta = unplain(read["meta"])
    ranks = range(meta["num_processes"])
    callbacks = unplain(read["callbacks"])
    for name, weights in read.get("best_weights", {}).items():
        callbacks[name][BEST_WEIGHTS] = weights
    loop = unplain(read["loop"])
    partial = [read.get(rank_key("partial", rank)) for rank in ranks]
    loop["partial_epoch"] = None if partial[0] is None else [unplain(p) for p in partial]
    modules = read.get("modules", {})
    state = {
        "format": meta["format"],
        "version": VERSION,
        "num_processes": meta["num_processes"],
        "epoch": meta["epoch"],
        "modules": {name: modules.get(name, {}) for name in meta["modules"]},
        "optimizers": {
            name: opt if isinstance(opt, InFolder) else by_position(opt)
            for name, opt in read["optimizers"].items()
        },
        "rng": [unplain(read[rank_key("rng", rank)]) for rank in ranks],
        "callbacks": callbacks,
        "loop": loop,
    }
    for key in ("schedulers", "scaler", "history"):
        state[key] = unplain(read[key])
    if folder is not None:
        state["optimizer_groups"] = unplain(read["optimizer_groups"])
    return state


def read_whole(
    path: str | os.PathLike[str], torch_load_kwargs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The training-state folder ``path`` read whole by this process alone,
    laid out as the single file of version 1 (no collective)."""
    return as_single_file(read_full(path, torch_load_kwargs=torch_load_kwargs))
