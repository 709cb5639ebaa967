"""Runs: which training states belong to which fit.

A checkpoint folder outlives the fit that wrote it: the folds of a
cross-validation, the candidates of a search and a rerun on other data may
all use the same one. Every fit therefore has a run identity, a hash of what
makes it that fit:

- the net's class and its hyperparameters (``get_params``), except those that
  only say how long or how loudly to train: ``max_epochs`` (so that raising
  it continues the run), ``verbose``, ``warm_start``, ``device``, the
  accelerator (a run resumes on another number of processes) and the
  mixin's ``unwrap_after_train`` and ``replica_check_every``;
- every callback with its parameters (``callbacks__*`` included), except
  those that only log or checkpoint: skorch's logging callbacks (``PrintLog``,
  ``ProgressBar``, ``EpochTimer``, the loggers), ``TrainingCheckpoint`` and
  ``ResumeTraining``, and callbacks of your own whose class sets
  ``in_run_identity = False`` (a logger, a preemption hook);
- a fingerprint of ``X`` and ``y``: type, length, shapes and dtypes, and the
  bytes of up to 64 rows at evenly spaced positions (cheap for any size of
  data, and different for any other fold of it).

The same script on the same data after a crash computes the same identity by
itself; another fold, other data or another hyperparameter does not.
Values are described by what they are, never by their address: classes and
functions by their qualified names, estimators by their parameters, other
objects by their type.

Layout::

    dirname/
      run-3f2a9c1b04de/
        manifest.json                 run id, its identity, epochs saved, status
        training-state-000003.pt
        training-state-000004.pt
      run-8b0e77a2c5f1/
        ...

Rotation and numbering only ever look at the run's own folder.
"""

import functools
import hashlib
import json
import os
import time

import numpy as np
import torch
from skorch.callbacks import Callback
from skorch.callbacks import logging as skorch_logging
from skorch.dataset import get_len
from skorch.utils import multi_indexing

from accel_mixin.files import atomic_write
from accel_mixin.state_dict import CheckpointError

__all__ = [
    "MANIFEST",
    "RunIdentity",
    "describe_differences",
    "read_manifest",
    "run_folders",
    "run_identity",
    "write_manifest",
]

MANIFEST = "manifest.json"
RUN_PREFIX = "run-"
_FORMAT = "accel_mixin.run"
_SAMPLE_ROWS = 64

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
    ]
)


def _is_bookkeeping(callback):
    """Callbacks that log or checkpoint but do not change what is trained
    (``TrainingCheckpoint`` and ``ResumeTraining`` say so themselves)."""
    return (
        type(callback).__module__ == skorch_logging.__name__
        or getattr(callback, "in_run_identity", True) is False
    )


def _name_of(obj):
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def describe(value):
    """``value`` as plain JSON data that says what it is, never where."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)  # exact, and NaN-safe in JSON
    if isinstance(value, (list, tuple)):
        return [describe(item) for item in value]
    if isinstance(value, dict):
        return {str(key): describe(item) for key, item in sorted(value.items(), key=str)}
    if isinstance(value, functools.partial):  # skorch's Freezer keeps `at` so
        return {
            "partial": describe(value.func),
            "args": describe(value.args),
            "keywords": describe(value.keywords),
        }
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return _name_of(value)
    if isinstance(value, torch.nn.Module):
        return {"class": _name_of(type(value)), "architecture": repr(value)}
    get_params = getattr(value, "get_params", None)
    if callable(get_params):
        try:
            params = get_params(deep=False)
        except TypeError:
            params = get_params()
        return {"class": _name_of(type(value)), "params": describe(params)}
    return {"class": _name_of(type(value))}


def _leaves(data):
    """The arrays and tensors in ``data`` (nested in dicts, lists, tuples)."""
    if isinstance(data, dict):
        for key in sorted(data, key=str):
            yield from _leaves(data[key])
    elif isinstance(data, (list, tuple)):
        for item in data:
            yield from _leaves(item)
    elif isinstance(data, torch.Tensor):
        yield data.detach().cpu().contiguous().numpy()
    elif isinstance(data, np.ndarray):
        yield np.ascontiguousarray(data)
    elif hasattr(data, "to_numpy"):  # pandas
        yield np.ascontiguousarray(data.to_numpy())
    elif data is not None:
        yield np.asarray(repr(data))


def fingerprint(data):
    """Type, length, shapes and dtypes of ``data``, and a hash of up to 64
    evenly spaced rows: cheap for large data, different for another fold."""
    if data is None:
        return None
    out = {"type": _name_of(type(data))}
    try:
        n = get_len(data)
    except (TypeError, ValueError):
        return out  # an iterable: its type is all that can be said cheaply
    out["length"] = n
    rows = np.unique(np.linspace(0, n - 1, min(n, _SAMPLE_ROWS)).round().astype(np.int64))
    try:
        sample = multi_indexing(data, rows)
    except Exception:  # pylint: disable=broad-except
        sample = [data[int(i)] for i in rows]  # a Dataset
    digest = hashlib.sha256(rows.tobytes())
    shapes = []
    for leaf in _leaves(sample):
        shapes.append([str(leaf.dtype), list(leaf.shape[1:])])
        digest.update(str(leaf.dtype).encode())
        digest.update(leaf.tobytes() if leaf.dtype != object else repr(leaf.tolist()).encode())
    out["rows"] = shapes
    out["sample_sha256"] = digest.hexdigest()
    return out


class RunIdentity:
    """What makes a fit that fit, and its id.

    Attributes
    ----------
    id : str
      12 hexadecimal digits.

    described : dict
      What went into it, as plain JSON data: ``net`` (class and
      hyperparameters), ``callbacks``, ``data`` (fingerprints of X and y).

    """

    def __init__(self, described):
        self.described = described
        text = json.dumps(described, sort_keys=True)
        self.id = hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def folder(self):
        return RUN_PREFIX + self.id


def run_identity(net, X, y=None):
    """The identity of fitting ``net`` (initialized) on ``X`` and ``y``."""
    params = net.get_params(deep=False)
    hyper = {
        key: describe(value)
        for key, value in params.items()
        if key not in _CONTINUING and key != "callbacks" and not key.startswith("callbacks__")
    }
    callbacks = {
        name: describe(cb)
        for name, cb in net.callbacks_
        if isinstance(cb, Callback) and not _is_bookkeeping(cb)
    }
    return RunIdentity(
        {
            "net": {"class": _name_of(type(net)), "params": hyper},
            "callbacks": callbacks,
            "data": {"X": fingerprint(X), "y": fingerprint(y)},
        }
    )


def _flatten(described, prefix=""):
    if isinstance(described, dict) and described:
        out = {}
        for key, value in described.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: described}


def describe_differences(new, old, most=4):
    """What differs between two identities' descriptions, in a few words."""
    new_flat, old_flat = _flatten(new), _flatten(old)
    keys = sorted(k for k in set(new_flat) | set(old_flat) if new_flat.get(k) != old_flat.get(k))
    parts = []
    for key in keys[:most]:
        if key.startswith("data."):
            parts.append(f"{key.split('.')[1]} (other data)")
        else:
            name = key[len("net.params.") :] if key.startswith("net.params.") else key
            parts.append(f"{name}: {old_flat.get(key)} -> {new_flat.get(key)}")
    if len(keys) > most:
        parts.append(f"and {len(keys) - most} more")
    return ", ".join(dict.fromkeys(parts)) or "nothing that the identity records"


def run_folders(dirname):
    """The run folders in ``dirname``, by run id."""
    if os.path.exists(dirname) and not os.path.isdir(dirname):
        raise CheckpointError(
            f"{dirname} is a file, not a folder of runs: pass TrainingCheckpoint and "
            "ResumeTraining the name of a folder (created if missing)."
        )
    try:
        names = os.listdir(dirname)
    except FileNotFoundError:
        return {}
    except NotADirectoryError as exc:
        raise CheckpointError(
            f"{dirname} cannot be a folder of runs: a part of its path is a file. Pass "
            "TrainingCheckpoint and ResumeTraining the name of a folder."
        ) from exc
    return {
        name[len(RUN_PREFIX) :]: os.path.join(dirname, name)
        for name in sorted(names)
        if name.startswith(RUN_PREFIX) and os.path.isdir(os.path.join(dirname, name))
    }


def read_manifest(folder):
    """The manifest of a run folder, or None where it has none yet.

    Raises
    ------
    CheckpointError
      If the manifest is not one that ``write_manifest`` wrote.

    """
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{path} is not a readable run manifest ({type(exc).__name__}: {exc}). Restore it, "
            f"or delete the folder {folder} to drop that run."
        ) from exc
    expected = os.path.basename(folder)[len(RUN_PREFIX) :]
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


def write_manifest(folder, identity, positions, status):
    """Write the manifest of a run folder, atomically; ``positions`` are the
    ``(epoch, batch)`` of its training states (``checkpoint_files``)."""
    manifest = {
        "format": _FORMAT,
        "run": identity.id,
        "status": status,
        "epochs": sorted(epoch for epoch, batch in positions if not batch),
        "inside_epochs": sorted([epoch + 1, batch] for epoch, batch in positions if batch),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "identity": identity.described,
    }
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    atomic_write(os.path.join(folder, MANIFEST), lambda f: f.write(text))
