"""Damaged folders of shards: told apart from a net of other parameters,
and the newest intact training state beside them.

A load of shards (DCP's) fails in its ``plan`` step where the net does not
fit the state (a key missing, another shape) or the folder's ``.metadata``
is unreadable, and in its ``read`` step where a shard file is missing,
shorter than ``.metadata`` says or not a tensor's bytes. A state is intact
where its file loads and every shard file it names is there, as long as
``.metadata`` says: a deleted or truncated shard is found without reading
the tensors (DCP keeps no checksums, so bytes changed inside a tensor are
not).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import torch

from accel_mixin.checkpoint import storage
from accel_mixin.checkpoint.dcp_folder import SafeReader
from accel_mixin.checkpoint.positions import checkpoint_files

if TYPE_CHECKING:
    from torch.distributed.checkpoint import CheckpointException


__all__ = ["SHARDED", "damaged_message", "is_damage"]

# the marker of an earlier release's sharded entry: {SHARDED: its folder}
SHARDED = "accel_mixin:sharded"


def is_damage(exc: CheckpointException) -> bool:
    """Whether the failed load ``exc`` (DCP's ``CheckpointException``) is
    about the folder's files rather than a net of other parameters."""
    if not exc.args or exc.args[0] != "plan":
        return True
    for failure in exc.failures.values():
        error = failure[0] if isinstance(failure, tuple) else failure
        # the planner's own: "Missing key in checkpoint", "Size mismatch"
        if isinstance(error, (OSError, AssertionError, EOFError)) or not isinstance(
            error, (ValueError, RuntimeError, KeyError)
        ):
            return True
    return False


def _problems(folder: str) -> list[str]:
    """What is wrong with ``folder``'s files: its ``.metadata`` unreadable, or
    shard files it names missing or shorter than it says; [] if nothing."""
    try:
        metadata = SafeReader(folder).read_metadata()
    except Exception as exc:  # pylint: disable=broad-except
        return [f".metadata is unreadable ({type(exc).__name__})"]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, size in sorted(needed.items()):
        try:
            actual = os.path.getsize(os.path.join(folder, name))
        except OSError:
            problems.append(f"{name} is missing")
            continue
        if actual < size:
            problems.append(f"{name} is truncated ({actual} of {size} bytes)")
    return problems


def _folders(value: Any, found: set[str]) -> set[str]:
    """The folders of shards that markers in ``value`` name."""
    if isinstance(value, dict):
        if SHARDED in value:
            found.add(value[SHARDED])
        for item in value.values():
            _folders(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _folders(item, found)
    return found


def intact(path: str) -> bool:
    """Whether the training state ``path`` loads and its shards are complete."""
    if os.path.isdir(path):  # a folder: committed, and every file it names whole
        return os.path.isfile(os.path.join(path, ".metadata")) and not _problems(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # pylint: disable=broad-except
        return False
    directory = os.path.dirname(os.path.abspath(path))
    return not any(_problems(os.path.join(directory, name)) for name in _folders(state, set()))


def newest_intact(source: str) -> str | None:
    """The newest training state beside ``source``, but it, that is intact."""
    source = os.path.abspath(source)
    with contextlib.suppress(OSError):
        for path in reversed(checkpoint_files(os.path.dirname(source))):
            if os.path.abspath(path) != source and intact(path):
                return path
    return None


def damaged_message(source: str, folder: str, detail: str) -> str:
    """What to say of ``source``, whose folder of shards ``folder`` (for a
    training-state folder, itself) is damaged (``detail``: what failed), and
    what to do."""
    if storage.is_url(source):
        return (
            f"{source} cannot be loaded: its files are damaged or unreadable ({detail}); "
            "they were deleted or overwritten since it was saved, or the store failed. Load "
            "another state, or train afresh."
        )
    found = _problems(folder) if os.path.isdir(folder) else ["it is missing"]
    if found:
        detail = f"{'; '.join(found)}; {detail}"
    own = os.path.abspath(folder) == os.path.abspath(source)
    other = newest_intact(source)
    if other is None:
        advice = (
            "No other training state beside it is intact: restore the folder from a copy, "
            "or train afresh."
        )
    else:
        advice = (
            f"The newest intact state beside it is {other}: load it with "
            f"net.load_state({other!r}), or delete {source}"
            f"{'' if own else ' and its folder'} so that ResumeTraining resumes from it."
        )
    what = "its files are" if own else f"its folder of shards {folder} is"
    return (
        f"{source} cannot be loaded: {what} damaged or unreadable ({detail}); a file was "
        f"deleted, truncated or overwritten since it was saved. {advice}"
    )
