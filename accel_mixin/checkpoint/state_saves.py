"""Training states saved as DCP folders (``dcp_folder``): the gloo group of
asynchronous saves, the save in flight, and one ``CheckpointError`` for a
save that failed on any rank.
"""

import concurrent.futures
import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from accel_mixin.checkpoint.dcp_folder import (
    checkpoint_exception,
    remove_partial_folders,
    save_folder,
)
from accel_mixin.checkpoint.files import check_directory, without_name, write_cause
from accel_mixin.errors import CheckpointError, Stalled

__all__ = [
    "SaveInFlight",
    "finished_on_error",
    "save_group",
    "save_state_folder",
]


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def save_group(held):
    """The process group of asynchronous saves: ``held``, or a new gloo group
    (a collective: every rank calls it); None without a process group.

    Never the default group, even where it is gloo's: DCP's thread runs its
    collectives while training's run on that group, and two threads' calls
    on one group pair up across ranks in whatever order each rank made them.
    """
    if not _distributed():
        return None
    return held if held is not None else torch.distributed.new_group(backend="gloo")


def _failed_writes(directory, exc, rank):
    """Every rank's failure in ``exc`` (DCP's, or this rank's own), each with
    the cause and fix of a failed write into ``directory`` where known."""
    if isinstance(exc, checkpoint_exception()):
        items = sorted(exc.failures.items())
    else:
        items = [(rank, exc)]
    lines = []
    for failed_rank, failure in items:
        error = failure[0] if isinstance(failure, tuple) else failure
        line = f"rank {failed_rank}: {without_name(error)}"
        cause = write_cause(directory, error)
        if cause and cause[1] not in line:
            line += f" ({cause[1]})"
        lines.append(line)
    return "; ".join(lines) or str(exc)


def _save_error(path, exc, alone=False):
    """``CheckpointError`` for the save of ``path`` that ``exc`` ended; rank 0
    (or a process that saved ``alone``) removes the save's partial folder first."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    rank = torch.distributed.get_rank() if _distributed() else 0
    # the cause looked up before the partial folder frees the space
    failed = _failed_writes(directory, exc, rank)
    if alone or rank == 0:
        remove_partial_folders(directory, name)
    before = "the state saved there before is intact" if os.path.exists(path) else "none was"
    return CheckpointError(
        f"Cannot save the training state {path}: writing it failed on {failed}. "
        f"{path} was not written ({before}); its partial folder is removed."
    )


def save_state_folder(
    state, path, *, asynchronous=False, group=None, on_committed=None, alone=False
):
    """``dcp_folder.save_folder`` whose failures raise ``CheckpointError``;
    asynchronous: a ``SaveInFlight``. Where the directory to save in is
    missing, every rank raises before anything is written (DCP would create
    it)."""
    check_directory(path)
    try:
        future = save_folder(
            state,
            path,
            asynchronous=asynchronous,
            group=group,
            on_committed=on_committed,
            alone=alone,
        )
    except (OSError, checkpoint_exception()) as exc:
        raise _save_error(path, exc, alone) from None
    return None if future is None else SaveInFlight(os.fspath(path), future, alone)


@dataclass(eq=False)
class SaveInFlight:
    """An asynchronous save: ``path``, the future that ends once its folder
    is committed, and whether this process saves it ``alone``. Its net holds
    it (``ProcessState.save_in_flight``) and waits for it; nothing else does."""

    path: str
    future: Any
    alone: bool = False

    def wait(self, io_timeout: Optional[float]):
        """Wait for the save, at most ``io_timeout`` seconds; raise what it raised."""
        try:
            self.future.result(timeout=io_timeout)
        except concurrent.futures.TimeoutError:
            raise Stalled(
                f"The asynchronous save of the training state {self.path} did not end within "
                f"io_timeout={io_timeout} s: its storage stalls. Check the filesystem, or "
                "raise io_timeout if it is slow."
            ) from None
        except (OSError, checkpoint_exception()) as exc:
            raise _save_error(self.path, exc, self.alone) from None


@contextlib.contextmanager
def finished_on_error(process, io_timeout):
    """Where the block raises, finish ``process``'s save in flight (its
    ``save_in_flight``), at most ``io_timeout``, and warn if it failed too,
    without hiding the block's error."""
    try:
        yield
    except BaseException:
        in_flight, process.save_in_flight = process.save_in_flight, None
        if in_flight is not None:
            try:
                in_flight.wait(io_timeout)
            except Exception as exc:  # pylint: disable=broad-except
                warnings.warn(
                    f"An asynchronous save_state failed too: {type(exc).__name__}: {exc}",
                    RuntimeWarning,
                )
        raise
