"""Training states of a module sharded by FSDP2: its shards in a folder that
``torch.distributed.checkpoint`` (DCP) writes beside the state's file.

Under FSDP2 ``save_state(path)`` writes two things:

- ``<path>.shards-<token>/`` first: DCP's folder, in which every rank writes
  its own shards of the module, of its optimizers' state and of
  ``EarlyStopping``'s best weights (``__<rank>_0.distcp``, fsynced), and
  rank 0 the ``.metadata`` that says where each piece of every tensor lies.
  Nothing is gathered: each rank holds no more than its shards.
- ``path`` last, the file that a DDP state is, written by the main process
  and renamed into place: it holds all the rest, and in place of each
  sharded entry a marker ``{SHARDED: "<path's name>.shards-<token>"}``
  naming the folder, relative to the file's own.

The file is the commit point. The token is new for every save (drawn by the
main process, sent to the others), so the folder that the previous good file
names is never written over: a save interrupted before its rename leaves
that file and its folder as they were. A save that fails gathers every
rank's outcome (``agree_on_the_save``), removes its own folder and raises one
``CheckpointError`` on every rank; a killed save's folder is an orphan,
removed by the next complete save of the same file (``remove_stale_shards``)
and by ``TrainingCheckpoint``'s rotation (``remove_orphan_shards``). A load
that fails tells a damaged folder from a net of other parameters
(``shard_damage``).

DCP reshards when it loads: a state saved on N processes loads into a module
sharded over any number of processes, or into one that is not sharded (DDP,
one process), each rank reading the pieces of what it holds. Every rank must
see the folder: on several machines, a filesystem they share.
"""

import contextlib
import copy
import os
import re
import secrets
import shutil

import torch

from accel_mixin.checkpoint.dcp_folder import (
    checkpoint_exception,
    failures,
    load_folder,
    partial_folder,
)
from accel_mixin.checkpoint.dcp_folder import one_process_quietly as _one_process_quietly
from accel_mixin.checkpoint.files import without_name, write_cause
from accel_mixin.distributed.sharding import reshard
from accel_mixin.errors import CheckpointError

__all__ = [
    "SHARDED",
    "agree_on_the_save",
    "is_sharded_entry",
    "load_best_weights_from",
    "load_module_from",
    "load_optimizer_from",
    "load_sharded_best_weights",
    "load_sharded_module",
    "load_sharded_optimizer",
    "remove_orphan_shards",
    "remove_shards",
    "remove_stale_shards",
    "remove_training_state",
    "restore_groups",
    "save_shards",
    "shards_folder",
]

SHARDED = "accel_mixin:sharded"
_SUFFIX = ".shards-"
_FOLDER_RE = re.compile(r"^(?P<file>.+)\.shards-[0-9a-f]+$")


def _dcp():
    import torch.distributed.checkpoint as dcp  # pylint: disable=import-outside-toplevel

    return dcp


def _state_dict_api():
    # pylint: disable=import-outside-toplevel
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_sharded_entry(value):
    """Whether ``value`` (an entry of a training state) is a marker that
    names a folder of shards."""
    return isinstance(value, dict) and SHARDED in value


def shards_folder(path, token):
    """The name of the folder of ``path``'s shards saved with ``token``."""
    return f"{os.path.basename(os.fspath(path))}{_SUFFIX}{token}"


def new_token(num_processes):
    """A token for one save, the same on every rank (a collective)."""
    token = [secrets.token_hex(6)]
    if num_processes > 1:
        from accelerate.utils import broadcast_object_list  # pylint: disable=import-outside-toplevel

        broadcast_object_list(token)
    return token[0]


def save_shards(path, module, optimizers, best_weights, num_processes):
    """Write the shards of ``module``, of ``optimizers`` (``{name: optimizer}``)
    and of ``best_weights`` (``{callback name: state dict}``) into a new
    folder beside ``path``; every rank calls it. Returns the folder's name."""
    api = _state_dict_api()
    folder = shards_folder(path, new_token(num_processes))
    target = os.path.join(os.path.dirname(os.path.abspath(path)), folder)
    reshard(module)  # named_parameters must be the shards the optimizers hold
    state = {
        "module": api.get_model_state_dict(module),
        "optimizers": {
            name: api.get_optimizer_state_dict(module, optimizer)
            for name, optimizer in optimizers.items()
        },
        "best": best_weights,
    }
    try:
        with _one_process_quietly():
            _dcp().save(state, checkpoint_id=target, no_dist=not _distributed())
        # the folder's entries, as the file's rename makes the file's durable
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except (OSError, checkpoint_exception()) as exc:
        failure = exc
    else:
        failure = None
    agree_on_the_save(path, failure, num_processes, target, f"writing its shards into {target}")
    return folder


def agree_on_the_save(path, failure, num_processes, target, step):
    """Every rank's outcome of the save of ``path`` (``failure``: this rank's
    exception, or None), gathered (a collective): where any failed, rank 0
    removes the folder of shards ``target`` and every rank raises one
    ``CheckpointError`` naming ``step`` and every rank's failure."""
    rank = torch.distributed.get_rank() if _distributed() else 0
    directory = os.path.dirname(target)
    mine = None if failure is None else ""  # "": failed, on another rank
    if isinstance(failure, checkpoint_exception()):  # DCP's: every rank's, on every rank
        failure = _failure_of(failure, rank)
    if failure is not None:  # its cause looked up before the partial folder frees the space
        mine = f"rank {rank}: {without_name(failure)}"
        cause = write_cause(directory, failure)
        if cause and cause[1] not in mine:
            mine += f" ({cause[1]})"
    everyone = [mine]
    if num_processes > 1:
        from accelerate.utils import (  # pylint: disable=import-outside-toplevel
            broadcast_object_list,
            gather_object,
        )

        everyone = gather_object([mine])
    if all(item is None for item in everyone):
        return
    failed = [item for item in everyone if item] or ["a rank that reported no error"]
    if rank == 0:
        _remove_folder(target)
    left = [os.path.isdir(target)]
    if num_processes > 1:
        broadcast_object_list(left)  # what rank 0 removed
    partial = "could not be removed: remove it" if left[0] else "is removed"
    before = "the state saved there before is intact" if os.path.exists(path) else "none was"
    raise CheckpointError(
        f"Cannot save the training state {path}: {step} failed on {'; '.join(failed)}. "
        f"{path} was not written ({before}); this save's folder of shards "
        f"{os.path.basename(target)} {partial}."
    )


def _folder_of(source, entry, what):
    folder = os.path.join(os.path.dirname(os.path.abspath(source)), entry[SHARDED])
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        rank = torch.distributed.get_rank() if _distributed() else 0
        raise CheckpointError(
            _damage().damaged_message(
                source,
                folder,
                f"rank {rank} finds no {os.path.join(folder, '.metadata')}, which keeps the "
                f"shards of {what}; on several machines, save training states on a "
                "filesystem every machine shares",
            )
        )
    return folder


def _damage():
    # pylint: disable-next=import-outside-toplevel,cyclic-import
    from accel_mixin.checkpoint import shard_damage

    return shard_damage


def _load(target, folder, source, what):
    """DCP's load of ``target`` (a nested dict of tensors, filled in place),
    plain values read ``weights_only``; its errors as ``CheckpointError``
    naming the file."""
    try:
        load_folder(target, folder)
    except checkpoint_exception() as exc:  # on every rank, with every rank's failure
        if _damage().is_damage(exc):
            raise CheckpointError(
                _damage().damaged_message(source, folder, failures(exc))
            ) from None
        raise CheckpointError(
            f"{source} does not fit {what}: reading its shards in {folder} failed "
            f"({failures(exc)}). The state was saved from a net with other parameters: "
            "initialize the net as it was when it was saved."
        ) from None
    return target


def _nested(keys, value):
    for key in reversed(keys):
        value = {key: value}
    return value


def _inside(state, keys):
    for key in keys:
        state = state[key]
    return state


def load_module_from(module, folder, keys, source, name):
    """Load the module state under ``keys`` of the DCP folder ``folder``
    into ``module``, sharded or not (DCP reshards); every rank calls it."""
    api = _state_dict_api()
    reshard(module)
    template = api.get_model_state_dict(module)
    if not template:  # nothing to load (a criterion without parameters)
        return
    state = _load(_nested(keys, template), folder, source, name)
    api.set_model_state_dict(module, _inside(state, keys))


def load_optimizer_from(module, optimizer, folder, keys, source, name):
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


def load_best_weights_from(module, folder, keys, source, name):
    """``EarlyStopping``'s best weights under ``keys`` of ``folder``, as a
    state dict laid out as ``module``'s own (sharded or not), under its bare
    keys."""
    reshard(module)
    like = {key: copy.deepcopy(value) for key, value in module.state_dict().items()}
    return _inside(_load(_nested(keys, like), folder, source, name), keys)


def _failure_of(exc, rank):
    failure = exc.failures.get(rank)
    return failure[0] if isinstance(failure, tuple) else failure


def load_sharded_module(module, source, entry, name):
    """Load the shards that ``entry`` names into ``module``, sharded or not."""
    load_module_from(module, _folder_of(source, entry, name), ("module",), source, name)


def load_sharded_optimizer(module, optimizer, source, entry, name):
    """Load the optimizer state that ``entry`` names into ``optimizer`` over
    ``module``'s parameters, sharded or not."""
    folder = _folder_of(source, entry, name)
    load_optimizer_from(module, optimizer, folder, ("optimizers", entry["name"]), source, name)
    # torch's loader keeps only the keys the groups had (a scheduler's
    # initial_lr is lost); the file has the groups as optimizer.state_dict()
    restore_groups(optimizer, entry["param_groups"])


def restore_groups(optimizer, groups):
    """The hyperparameters of ``groups`` (saved param groups) back into
    ``optimizer``'s, which torch's loader drops (a scheduler's ``initial_lr``)."""
    for group, saved in zip(optimizer.param_groups, groups):
        group.update((key, value) for key, value in saved.items() if key != "params")


def load_sharded_best_weights(module, source, entry, name):
    """``EarlyStopping``'s best weights that ``entry`` names, as a state dict
    laid out as ``module``'s own (sharded or not), under its bare keys."""
    folder = _folder_of(source, entry, name)
    return load_best_weights_from(module, folder, ("best", entry["name"]), source, name)


def _remove_folder(folder):
    shutil.rmtree(folder, ignore_errors=True)


def remove_shards(path, folder):
    """Remove ``path``'s folder of shards ``folder``: that of a save whose
    file was not written."""
    _remove_folder(os.path.join(os.path.dirname(os.path.abspath(path)), folder))


def remove_stale_shards(path, keep):
    """Remove the folders of ``path``'s earlier saves (and of interrupted
    ones) but ``keep``; on the writing process, once ``path`` names ``keep``."""
    directory = os.path.dirname(os.path.abspath(path))
    prefix = os.path.basename(os.fspath(path)) + _SUFFIX
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            if entry.startswith(prefix) and entry != keep and _FOLDER_RE.match(entry):
                _remove_folder(os.path.join(directory, entry))


def remove_training_state(path):
    """Remove the training state ``path``: a folder, or an earlier release's
    file and its folders of shards."""
    if os.path.isdir(path) and not os.path.islink(path):
        # renamed aside first: a crash halfway leaves no folder under its name
        # that looks whole and is not
        aside = partial_folder(path, secrets.token_hex(6))
        with contextlib.suppress(OSError):
            os.rename(path, aside)
            _remove_folder(aside)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    remove_stale_shards(path, keep=None)


def remove_orphan_shards(directory):
    """Remove the folders of shards in ``directory`` whose file is missing:
    those of saves interrupted before their file was renamed into place.
    Only where no save into ``directory`` is in flight."""
    with contextlib.suppress(OSError):
        entries = set(os.listdir(directory))
        for entry in entries:
            match = _FOLDER_RE.match(entry)
            if match and match.group("file") not in entries:
                _remove_folder(os.path.join(directory, entry))
