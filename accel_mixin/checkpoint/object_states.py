"""Training states on object stores, where no rename is atomic.

A state at the URL ``<state>`` is a prefix that holds DCP folders, one per
save, ``<state>/v-<token>/``, and the commit marker ``<state>/committed.json``
that names the one that is whole. A save writes a new version with DCP's
fsspec writer (DCP writes its ``.metadata`` once every rank's data is
written); then the first process uploads the marker, the one commit (a
store shows an upload whole or not at all), and removes the other versions.
A save killed before the marker leaves the previous version named by it,
loadable; its own version is removed by the next save of the state or the
next rotation of its folder (``remove_uncommitted``).

``dcp_folder`` saves and reads through these names: nothing else differs
from a state in a local folder, resharding included.
"""

from __future__ import annotations

import contextlib
import json

from accel_mixin.checkpoint import storage
from accel_mixin.errors import CheckpointError

__all__ = [
    "MARKER",
    "commit",
    "committed_version",
    "remove_state",
    "remove_uncommitted",
    "version_folder",
]

MARKER = "committed.json"
_VERSION = "v-"
_FORMAT = "accel_mixin.object-state"
_METADATA = ".metadata"


def version_folder(url: str, token: str) -> str:
    """The DCP folder of the save of the state ``url`` with ``token``."""
    return storage.join(url, _VERSION + token)


def _marker(url: str) -> str | None:
    """The version the marker of ``url`` names, None without a marker."""
    path = storage.join(url, MARKER)
    try:
        text = storage.read_bytes(path)
    except FileNotFoundError:
        return None
    try:
        marker = json.loads(text)
        version = marker["version"]
        if marker.get("format") != _FORMAT or not isinstance(version, str):
            raise ValueError("not a commit marker of accel_mixin")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{path} is not the commit marker of a training state ({exc}): it was edited or "
            f"replaced. Remove {url} to drop the state."
        ) from None
    return version


def committed_version(url: str) -> str | None:
    """The DCP folder of the committed state ``url``, or None where no save
    of it committed."""
    version = _marker(url)
    if version is None:
        return None
    folder = storage.join(url, version)
    if not storage.exists(storage.join(folder, _METADATA)):
        raise CheckpointError(
            f"{url}: its commit marker names {folder}, which holds no {_METADATA}: the "
            "state was changed by something else than save_state. Remove it, or load "
            "another one."
        )
    return folder


def commit(url: str, token: str) -> None:
    """On the first process, once DCP's save of ``version_folder(url,
    token)`` ended: the marker names it, and the other versions go."""
    version = _VERSION + token
    marker = json.dumps({"format": _FORMAT, "version": version}).encode()
    storage.write_bytes(storage.join(url, MARKER), marker)
    _remove_versions(url, keep=version)


def _remove_versions(url: str, keep: str | None) -> None:
    with contextlib.suppress(FileNotFoundError):
        for name in storage.listdir(url):
            if name.startswith(_VERSION) and name != keep:
                storage.remove(storage.join(url, name))


def remove_state(url: str) -> None:
    """Remove the state ``url``: its marker first, so that a removal cut
    short leaves no state that looks whole and is not."""
    with contextlib.suppress(FileNotFoundError):
        storage.remove(storage.join(url, MARKER))
    storage.remove(url)


def remove_uncommitted(directory: str, name: str | None = None) -> None:
    """Remove what killed saves left in the folder ``directory`` (of the
    state ``name`` only, if given): versions that no marker names, and
    states without a marker. Only where no save into ``directory`` is in flight."""
    try:
        names = [name] if name is not None else storage.listdir(directory)
    except FileNotFoundError:
        return
    for entry in names:
        url = storage.join(directory, entry)
        try:
            inside = storage.listdir(url)
        except (FileNotFoundError, NotADirectoryError):
            continue
        if not any(part.startswith(_VERSION) for part in inside):
            continue  # not a state (a manifest, another file)
        keep = _marker(url) if MARKER in inside else None
        if keep is None:
            storage.remove(url)
        else:
            _remove_versions(url, keep)
