"""Which training-state files a folder holds, and which one every rank has.

``TrainingCheckpoint`` names its files after the position of training they
hold: ``training-state-<epoch>.pt`` after ``epoch`` epochs, and
``training-state-<epoch>-batch-<batch>-ranks-<n>.pt`` after ``batch``
training batches of the next epoch on ``n`` processes (such a state resumes
on ``n`` processes only: each holds its own part of the epoch). Positions
``(epoch, batch)`` order the files (an epoch's end is ``(epoch, 0)``). Each
file is renamed into place once complete, so a file with such a name is whole.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import TYPE_CHECKING

from accelerate.utils import gather_object

from accel_mixin.errors import CheckpointError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from accel_mixin.checkpoint.files import Path


# a training state's place in training: (epochs done, batches of the next)
Position = tuple[int, int]

_CHECKPOINT_RE = re.compile(r"^training-state-(\d{6,})(?:-batch-(\d{6,})-ranks-(\d+))?\.pt$")


def checkpoint_name(epoch: int, batch: int = 0, processes: int = 1) -> str:
    """The file name of the training state after ``epoch`` epochs and
    ``batch`` training batches of the next one, on ``processes`` processes."""
    if batch:
        return f"training-state-{epoch:06d}-batch-{batch:06d}-ranks-{processes}.pt"
    return f"training-state-{epoch:06d}.pt"


def describe_position(position: Position) -> str:
    epoch, batch = position
    return f"epoch {epoch}" if not batch else f"batch {batch} of epoch {epoch + 1}"


def position_of(path: str) -> Position | None:
    """The ``(epoch, batch)`` of a training-state file by its name, None
    for a name that ``checkpoint_name`` does not give."""
    match = _CHECKPOINT_RE.match(os.path.basename(path))
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def _describe_positions(positions: list[Position]) -> str:
    ends = [epoch for epoch, batch in positions if not batch]
    return ", ".join([f"epochs {ends}"] + [describe_position(p) for p in positions if p[1]])


def checkpoint_positions(dirname: Path, processes: int | None = None) -> dict[Position, str]:
    """The complete training-state files in ``dirname``, by ``(epoch, batch)``;
    with ``processes``, only those that resume on that many processes."""
    try:
        names = os.listdir(dirname)
    except FileNotFoundError:
        return {}
    return {
        (int(m.group(1)), int(m.group(2) or 0)): os.path.join(dirname, n)
        for n in names
        for m in [_CHECKPOINT_RE.match(n)]
        if m and (processes is None or not m.group(2) or int(m.group(3)) == processes)
    }


def checkpoint_files(dirname: Path) -> list[str]:
    """The complete training-state files in ``dirname``, oldest first."""
    found = checkpoint_positions(dirname)
    return [found[position] for position in sorted(found)]


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
