"""Training states saved as DCP folders (``dcp_folder``): the gloo group of
asynchronous saves, the save in flight, and one ``CheckpointError`` for a
save that failed on any rank.

WIP (issue 47, point 2): ``CheckpointingMixin._save_state_folder`` uses it;
``save_state`` does not yet.
"""

import concurrent.futures
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from accel_mixin.checkpoint.dcp_folder import (
    checkpoint_exception,
    failures,
    remove_partial_folders,
    save_folder,
)
from accel_mixin.errors import CheckpointError, Stalled

__all__ = ["SaveInFlight", "save_group", "save_state_folder"]


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


def _save_error(path, exc):
    """``CheckpointError`` for the save of ``path`` that ``exc`` ended; rank 0
    removes the save's partial folder first."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    rank = torch.distributed.get_rank() if _distributed() else 0
    if rank == 0:
        remove_partial_folders(directory, name)
    failed = failures(exc) if isinstance(exc, checkpoint_exception()) else f"{exc}"
    before = "the state saved there before is intact" if os.path.exists(path) else "none was"
    return CheckpointError(
        f"Cannot save the training state {path}: writing it failed on {failed}. "
        f"{path} was not written ({before}); its partial folder is removed."
    )


def save_state_folder(state, path, *, asynchronous=False, group=None, on_committed=None):
    """``dcp_folder.save_folder`` whose failures raise ``CheckpointError``;
    asynchronous: a ``SaveInFlight``."""
    try:
        future = save_folder(
            state, path, asynchronous=asynchronous, group=group, on_committed=on_committed
        )
    except (OSError, checkpoint_exception()) as exc:
        raise _save_error(path, exc) from None
    return None if future is None else SaveInFlight(os.fspath(path), future)


@dataclass
class SaveInFlight:
    """An asynchronous save: ``path``, and the future that ends once its
    folder is committed."""

    path: str
    future: Any

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
            raise _save_error(self.path, exc) from None
