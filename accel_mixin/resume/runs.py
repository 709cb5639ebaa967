"""Runs: which training states belong to which fit.

A checkpoint folder outlives the fit that wrote it (the folds of a
cross-validation, the candidates of a search, a rerun on other data), so
every fit has a run identity: a hash of what the user set to make it that
fit, by content (``describe``), the same on every rank and after a crash:

- the net's class and its parameters that differ from the ``__init__``
  defaults, except those that only say how long, how loudly or where to
  train (``_CONTINUING``) and DataLoader settings that do not change what is
  trained (``_HARMLESS_LOADING``), so that changing them continues the run;
- every callback and its parameters but ``sink``, except skorch's logging
  callbacks and those whose class sets ``in_run_identity = False``;
- a fingerprint of ``X``, ``y`` and every fit parameter;
- the run's name, where ``TrainingCheckpoint(run_name=...)`` gives one.

A value that cannot be described by content is never guessed equal to
another: ``RunIdentity.refused`` says why, and an unnamed fit with one is a
run of its own, never resumed; a name stands for what cannot be described.

Each run has a folder ``dirname/run-<id>/`` (``run-<name>-<id>/``) with its
training states and a ``manifest.json`` (identity, epochs saved, status);
rotation and numbering only ever look at the run's own folder. A name is
not an identity: fits that differ under one name are runs of their own,
each in its folder, and a fit that names its own name (``find_run``) means
its own run, whichever other runs share the name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from accelerate.utils import gather_object
from skorch.callbacks import Callback
from skorch.callbacks import logging as skorch_logging

from accel_mixin.checkpoint import storage
from accel_mixin.checkpoint.atomic_files import atomic_write
from accel_mixin.errors import CheckpointError
from accel_mixin.resume.describe import Describer, fingerprint, init_defaults, name_of
from accel_mixin.training.fit import Fit

if TYPE_CHECKING:
    from skorch import NeuralNet

    from accel_mixin.checkpoint.atomic_files import Path
    from accel_mixin.checkpoint.positions import Position


__all__ = [
    "MANIFEST",
    "RunIdentity",
    "check_run_name",
    "describe_differences",
    "differs_from_newest",
    "find_run",
    "fit_identity",
    "read_manifest",
    "run_folders",
    "run_identity",
    "write_manifest",
]

MANIFEST = "manifest.json"
RUN_PREFIX = "run-"
_FORMAT = "accel_mixin.run"
_ID_LENGTH = 12

# hyperparameters that say how long or how loudly to train, or where
_CONTINUING = frozenset(
    [
        "max_epochs",
        "verbose",
        "warm_start",
        "device",
        "accelerator",
        "unwrap_after_train",
        "replica_check_every",
        "io_timeout",
        "torch_load_kwargs",
    ]
)
# DataLoader settings that change how fast batches come, not which
_HARMLESS_LOADING = frozenset(
    [
        "num_workers",
        "pin_memory",
        "pin_memory_device",
        "persistent_workers",
        "prefetch_factor",
        "timeout",
        "multiprocessing_context",
    ]
)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# the likely cause where the ranks' data differ
_OWN_GENERATORS = (
    " (a Dataset that draws random numbers from a generator that is neither global nor "
    "one of its attributes gives every rank other rows: hold the generator as an attribute, "
    "and its rows are read with it at a fixed seed)."
)


def _counts(key: str) -> bool:
    if key.startswith("_") or key in _CONTINUING or key.split("__")[0] == "callbacks":
        return False
    prefix, _, name = key.partition("__")
    return not (prefix in ("iterator_train", "iterator_valid") and name in _HARMLESS_LOADING)


def check_run_name(name: object) -> None:
    """Raise a ``ValueError`` unless ``name`` can name a run folder."""
    if name is not None and (not isinstance(name, str) or not _NAME.fullmatch(name)):
        raise ValueError(
            f"run_name must be a word of up to 64 letters, digits, '.', '_' or '-', starting "
            f"with a letter or digit (it names the run's folder), got {name!r}"
        )


class RunIdentity:
    """What makes a fit that fit (``described``, plain JSON data), why it
    cannot be described faithfully (``refused``, a line, or None), its
    ``id`` (12 hex digits), ``name`` and ``key`` (``<name>-<id>`` or ``<id>``)."""

    def __init__(self, described: dict[str, Any], refused: str | None = None) -> None:
        self.described = described
        self.refused = refused
        self.name: str | None = described.get("name")
        text = json.dumps(described, sort_keys=True)
        self.id = hashlib.sha256(text.encode()).hexdigest()[:_ID_LENGTH]
        self.key = f"{self.name}-{self.id}" if self.name else self.id

    @property
    def folder(self) -> str:
        return RUN_PREFIX + self.key

    def unique(self, nonce: str) -> RunIdentity:
        """This identity made unique with ``nonce``, for a fit whose
        identity cannot tell it from others."""
        return RunIdentity({**self.described, "unique": nonce}, self.refused)


def run_identity(
    net: NeuralNet,
    X: Any,
    y: Any = None,
    fit_params: Mapping[str, Any] | None = None,
    name: str | None = None,
) -> RunIdentity:
    """The ``RunIdentity`` of fitting ``net`` (initialized) on ``X`` and
    ``y`` with ``fit_params``, named ``name``."""
    describe = Describer()
    net_class: type = type(net)
    defaults = init_defaults(net_class)
    hyper: dict[str, Any] = {}
    for key, value in sorted(net.get_params(deep=False).items()):
        if _counts(key):
            shown = describe.unless_default(value, defaults, key, key)
            if shown is not describe.DEFAULT:
                hyper[key] = shown

    callbacks = {
        name: {
            "class": name_of(type(cb)),
            "params": describe.params(cb, f"callbacks__{name}", skip=("sink",)),
        }
        for name, cb in net.callbacks_
        # not those that only log or checkpoint
        if isinstance(cb, Callback)
        and type(cb).__module__ != skorch_logging.__name__
        and getattr(cb, "in_run_identity", True) is not False
    }
    data: dict[str, Any] = {"X": fingerprint(X, describe, "X"), "y": fingerprint(y, describe, "y")}
    if fit_params:
        data["fit_params"] = {
            key: fingerprint(value, describe, key) for key, value in sorted(fit_params.items())
        }
    described: dict[str, Any] = {
        "net": {"class": name_of(type(net)), "params": hyper},
        "callbacks": callbacks,
        "data": data,
    }
    if name is not None:
        described["name"] = name
    refused = None
    if describe.refusals:
        (path, reason), more = describe.refusals[0], len(describe.refusals) - 1
        refused = f"{path} is {reason}" + (f" (and {more} more such values)" if more else "")
    return RunIdentity(described, refused)


def fit_identity(net: NeuralNet, X: Any, y: Any, fit: Fit, name: str | None = None) -> RunIdentity:
    """The run identity of ``fit``, the running fit of ``net``, computed once
    per fit (the data hashed once), the same on every rank: the ranks compare
    theirs and all raise where they differ; an unnamed fit that the identity
    cannot tell from others gets a unique id, drawn on the main process."""
    if fit.identity is not None:
        known: RunIdentity = fit.identity
        return known
    identity = run_identity(net, X, y, fit.fit_params, name=name)
    nonce = uuid.uuid4().hex[:16]
    if net.accelerator.num_processes > 1:
        # every rank comes here: the callbacks before succeeded on all of them
        net.wait_for_everyone("the run identity")
        everyone = gather_object([(identity.id, identity.described, nonce)])
        nonce = everyone[0][2]
        for rank, (id_, described, _) in enumerate(everyone):
            if id_ != everyone[0][0]:
                differences = describe_differences(described, everyone[0][1])
                raise CheckpointError(
                    f"The ranks fit different runs: the run identity of rank {rank} differs "
                    f"from rank 0's in: {differences}. Every process must run the same script "
                    "on the same data" + (_OWN_GENERATORS if "(other data)" in differences else ".")
                )
    if identity.refused and identity.name is None:
        identity = identity.unique(nonce)
    fit.identity = identity
    return identity


def _units(described: Mapping[str, Any]) -> dict[str, Any]:
    """What a description says, by what the user would name: a parameter,
    a callback's parameter, a callback, the data, a fit parameter."""
    units = dict(described.get("net", {}).get("params", {}))
    units["net class"] = described.get("net", {}).get("class")
    for name, callback in described.get("callbacks", {}).items():
        units[f"callback {name}"] = callback.get("class")
        for key, value in callback.get("params", {}).items():
            units[f"callbacks__{name}__{key}"] = value
    data = described.get("data", {})
    for key in ("X", "y"):
        units[f"{key} (other data)"] = data.get(key)
    for key, value in data.get("fit_params", {}).items():
        units[f"fit parameter {key} (other data)"] = value
    for key in ("name", "unique"):
        units[key] = described.get(key)
    return {key: value for key, value in units.items() if value is not None}


def _shown(value: object) -> object:
    if value is _MISSING:
        return "(default)"
    return value if isinstance(value, (str, int, float, bool)) else "(a value)"


_MISSING = object()


def describe_differences(new: Mapping[str, Any], old: Mapping[str, Any], most: int = 4) -> str:
    """What differs between two identities' descriptions, in a few words:
    ``lr: 0.1 -> 0.05``, ``criterion__weight (other value)``, ``X (other
    data)``; a parameter at its default shows as ``(default)``."""
    new_units, old_units = _units(new), _units(old)
    keys = sorted(
        key
        for key in set(new_units) | set(old_units)
        if new_units.get(key, _MISSING) != old_units.get(key, _MISSING)
    )
    parts = []
    for key in keys[:most]:
        before, after = old_units.get(key, _MISSING), new_units.get(key, _MISSING)
        if key.endswith("(other data)"):
            parts.append(key)
        elif isinstance(before, (dict, list)) and isinstance(after, (dict, list)):
            parts.append(f"{key} (other value)")
        else:
            parts.append(f"{key}: {_shown(before)} -> {_shown(after)}")
    if len(keys) > most:
        parts.append(f"and {len(keys) - most} more")
    return ", ".join(parts) or "nothing that the identity records"


def _name(key: str) -> str | None:
    return key[: -_ID_LENGTH - 1] or None


def differs_from_newest(identity: RunIdentity, runs: dict[str, str]) -> str:
    """What ``identity`` differs in from the newest of ``runs`` (``run_folders``),
    of those with its name where it has one and some have."""
    named = {key: folder for key, folder in runs.items() if identity.name == _name(key)}
    runs = named if identity.name and named else runs
    newest = max(runs, key=lambda run: _updated(runs[run]))
    try:
        manifest = read_manifest(runs[newest])
    except CheckpointError:
        manifest = None
    differs = (
        "an unreadable manifest"
        if manifest is None
        else describe_differences(identity.described, manifest.get("identity", {}))
    )
    return f"it differs from the newest, {newest}, in: {differs}"


def _updated(folder: str) -> float:
    """When the run folder ``folder`` last changed: on an object store, whose
    folders have no time, when its manifest did."""
    return storage.modified(storage.join(folder, MANIFEST) if storage.is_url(folder) else folder)


def run_folders(dirname: Path) -> dict[str, str]:
    """The run folders in ``dirname``, by run key (``RunIdentity.key``:
    the id, after the name for a named run)."""
    if storage.exists(dirname) and not storage.isdir(dirname):
        raise CheckpointError(
            f"{dirname} is a file, not a folder of runs: pass TrainingCheckpoint and "
            "ResumeTraining the name of a folder (created if missing)."
        )
    try:
        names = storage.listdir(dirname)
    except FileNotFoundError:
        return {}
    except NotADirectoryError as exc:
        raise CheckpointError(
            f"{dirname} cannot be a folder of runs: a part of its path is a file. Pass "
            "TrainingCheckpoint and ResumeTraining the name of a folder."
        ) from exc
    # on an object store, each name listed as a folder is one: no look each
    isdir = (lambda _: True) if storage.is_url(dirname) else os.path.isdir
    return {
        name[len(RUN_PREFIX) :]: storage.join(dirname, name)
        for name in sorted(names)
        if name.startswith(RUN_PREFIX) and isdir(storage.join(dirname, name))
    }


def find_run(runs: Mapping[str, str], wanted: str, own: RunIdentity | None = None) -> str | None:
    """The key in ``runs`` (``run_folders``) of the run that ``wanted``
    names by key, id or name; else None.

    A fit's own name, id or key (``own``, its ``RunIdentity``) names its own
    run, ``own.key``, whether its folder exists yet or not, and whatever
    other runs share the name: fits that differ under one name are runs of
    their own. The name of several other runs raises (which of them to
    continue from is the user's to say, not a guess).
    """
    if wanted in runs:
        return wanted
    if own is not None and wanted in (own.key, own.id, own.name):
        return own.key
    found = [key for key in runs if wanted in (key[-_ID_LENGTH:], _name(key))]
    if len(found) > 1:
        raise CheckpointError(
            f"ResumeTraining(run={wanted!r}): several runs are named {wanted!r} "
            f"({', '.join(found)}), fits that differ under that name; pass the id of the one "
            "to continue from (what went into each is in its folder's manifest.json)."
        )
    return found[0] if found else None


def read_manifest(folder: str) -> dict[str, Any] | None:
    """The manifest of a run folder, None where it has none yet; raises
    where it is not one that ``write_manifest`` wrote."""
    path = storage.join(folder, MANIFEST)
    try:
        manifest = json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{path} is not a readable run manifest ({type(exc).__name__}: {exc}). Restore it, "
            f"or delete the folder {folder} to drop that run."
        ) from exc
    expected = storage.split(folder)[1][len(RUN_PREFIX) :]
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != _FORMAT
        or manifest.get("run") != expected
        or not isinstance(manifest.get("epochs"), list)
    ):
        raise CheckpointError(
            f"{path} is not the manifest of run {expected}: it was edited or replaced. Restore "
            f"it, or delete the folder {folder} to drop that run."
        )
    return manifest


def write_manifest(
    folder: str, identity: RunIdentity, positions: Iterable[Position], status: str
) -> None:
    """Write the manifest of a run folder, atomically; ``positions`` are the
    ``(epoch, batch)`` of its training states (``positions.checkpoint_files``)."""
    manifest = {
        "format": _FORMAT,
        "run": identity.key,
        "id": identity.id,
        "name": identity.name,
        "refused": identity.refused,
        "status": status,
        "epochs": sorted(epoch for epoch, batch in positions if not batch),
        "inside_epochs": sorted([epoch + 1, batch] for epoch, batch in positions if batch),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "identity": identity.described,
    }
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    if storage.is_url(folder):
        storage.write_bytes(storage.join(folder, MANIFEST), text)
    else:
        atomic_write(os.path.join(folder, MANIFEST), lambda f: f.write(text))
