"""Which training states a folder holds, and which one every rank has.

``TrainingCheckpoint`` names its states (folders) after the position of
training they hold: ``training-state-<epoch>`` after ``epoch`` epochs, and
``training-state-<epoch>-batch-<batch>-ranks-<n>`` after ``batch`` training
batches of the next epoch on ``n`` processes (such a state resumes on ``n``
processes only: each holds its own part of the epoch). Positions ``(epoch,
batch)`` order them (an epoch's end is ``(epoch, 0)``). Each is renamed into
place once complete, so a state with such a name is whole. Earlier releases
wrote single files, the same names with ``.pt``: they are found and read too;
where a folder and a file hold the same position, the folder is the newer.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import TYPE_CHECKING

from accelerate.utils import gather_object

from accel_mixin.checkpoint import storage
from accel_mixin.checkpoint.dcp_folder import is_state_folder
from accel_mixin.errors import CheckpointError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from accel_mixin.checkpoint.atomic_files import Path


# a training state's place in training: (epochs done, batches of the next)
Position = tuple[int, int]

_CHECKPOINT_RE = re.compile(
    r"^training-state-(\d{6,})(?:-batch-(\d{6,})-ranks-(\d+))?(?P<file>\.pt)?$"
)


def checkpoint_name(epoch: int, batch: int = 0, processes: int = 1) -> str:
    """The name of the training state after ``epoch`` epochs and ``batch``
    training batches of the next one, on ``processes`` processes."""
    if batch:
        return f"training-state-{epoch:06d}-batch-{batch:06d}-ranks-{processes}"
    return f"training-state-{epoch:06d}"


def describe_position(position: Position) -> str:
    epoch, batch = position
    return f"epoch {epoch}" if not batch else f"batch {batch} of epoch {epoch + 1}"


def position_of(path: str) -> Position | None:
    """The ``(epoch, batch)`` of a training state by its name, None for a
    name that ``checkpoint_name`` does not give (with or without ``.pt``)."""
    match = _CHECKPOINT_RE.match(os.path.basename(path))
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def _describe_positions(positions: list[Position]) -> str:
    ends = [epoch for epoch, batch in positions if not batch]
    return ", ".join([f"epochs {ends}"] + [describe_position(p) for p in positions if p[1]])


def checkpoint_positions(dirname: Path, processes: int | None = None) -> dict[Position, str]:
    """The complete training states in ``dirname`` (folders, and files of
    earlier releases), by ``(epoch, batch)``; with ``processes``, only those
    that resume on that many processes."""
    return {
        position: paths[-1][0]
        for position, paths in _states(dirname).items()
        if processes is None or not position[1] or paths[-1][1] == processes
    }


# a state found: its path, the processes it resumes on (None: any), a folder?
_Found = tuple[str, "int | None", bool]


def _states(dirname: Path) -> dict[Position, list[_Found]]:
    """``{(epoch, batch): [(path, processes, folder), ...]}``: files before folders."""
    try:
        names = sorted(storage.listdir(dirname))
    except FileNotFoundError:
        return {}
    remote = storage.is_url(dirname)
    found: dict[Position, list[_Found]] = {}
    for name in names:
        match = _CHECKPOINT_RE.match(name)
        if match is None:
            continue
        path = storage.join(dirname, name)
        is_file = match.group("file") is not None
        if remote:  # states only, no earlier release's files
            if is_file or not is_state_folder(path):
                continue
        elif is_file != os.path.isfile(path) or not (is_file or is_state_folder(path)):
            continue  # a folder without .metadata, a file named as a folder
        position = (int(match.group(1)), int(match.group(2) or 0))
        processes = int(match.group(3)) if match.group(2) else None
        found.setdefault(position, []).append((path, processes, not is_file))
    return {position: sorted(paths, key=lambda e: e[2]) for position, paths in found.items()}


def checkpoint_files(dirname: Path, every: bool = False) -> list[str]:
    """The complete training states in ``dirname``, oldest first (with
    ``every``, also a file that a folder of the same position shadows)."""
    states = _states(dirname)
    return [
        entry[0]
        for position in sorted(states)
        for entry in (states[position] if every else states[position][-1:])
    ]


def agreed_checkpoint(dirname: Path, accelerator: Accelerator) -> str | None:
    """The newest training state in ``dirname`` that every rank has, or None.

    Machines that share no filesystem (``save_on_each_node``) can hold
    different files (one killed during a write, a new machine with none): all
    resume from the newest position they all have. A ``CheckpointError`` on
    every rank where some ranks have none in common, or cannot read ``dirname``.
    """
    try:
        found, error = checkpoint_positions(dirname, accelerator.num_processes), None
    except OSError as exc:
        found, error = {}, f"{type(exc).__name__}: {exc}"
    # gathered, a rank's positions arrive as lists
    everyone: list[tuple[list[Position], str | None]] = [(sorted(found), error)]

    if accelerator.num_processes > 1:
        everyone = gather_object(everyone)
    errors = [f"rank {rank}: {err}" for rank, (_, err) in enumerate(everyone) if err]
    if errors:
        raise CheckpointError(f"Cannot look for training states in {dirname}: {'; '.join(errors)}.")
    common = set.intersection(*({(e, b) for e, b in positions} for positions, _ in everyone))
    newest = {
        rank: max((e, b) for e, b in positions)
        for rank, (positions, _) in enumerate(everyone)
        if positions
    }
    if common:
        position = max(common)
        ahead = sorted(rank for rank, last in newest.items() if last > position)
        if ahead and accelerator.is_main_process:
            warnings.warn(
                f"Resuming from {describe_position(position)}, the newest training state in "
                f"{dirname} that every rank has; rank(s) {ahead} also have newer ones.",
                RuntimeWarning,
            )
        return found[position]
    if newest:
        have = ", ".join(
            f"rank {rank}: {_describe_positions(positions)}"
            for rank, (positions, _) in enumerate(everyone)
        )
        raise CheckpointError(
            f"No training state in {dirname} is on every rank ({have}). Copy the newest "
            f"file to {dirname} on every machine, or remove the files everywhere to "
            "start afresh."
        )
    return None
