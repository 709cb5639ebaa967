"""Training states saved as DCP folders (``dcp_folder``): a net's asynchronous
saves (``StateSaves``: the save in flight and its gloo group), and one
``CheckpointError`` for a save that failed on any rank.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from accel_mixin.checkpoint import storage
from accel_mixin.checkpoint.atomic_files import check_directory, without_name, write_cause
from accel_mixin.checkpoint.dcp_folder import (
    checkpoint_exception,
    is_state_folder,
    remove_partial_folders,
    save_folder,
)
from accel_mixin.errors import CheckpointError, Stalled

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.api import WRAPPED_EXCEPTION

__all__ = ["SaveInFlight", "StateSaves", "save_state_folder"]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _failed_writes(directory: str, exc: BaseException, rank: int) -> str:
    """Every rank's failure in ``exc`` (DCP's, or this rank's own), each with
    the cause and fix of a failed write into ``directory`` where known."""
    # DCP's failures are (exception, traceback) pairs
    items: list[tuple[int, BaseException | WRAPPED_EXCEPTION]]
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


def _save_error(
    path: str | os.PathLike[str], exc: BaseException, alone: bool = False
) -> CheckpointError:
    """``CheckpointError`` for the save of ``path`` that ``exc`` ended; rank 0
    (or a process that saved ``alone``) removes the save's partial folder first."""
    directory, name = storage.split(path)
    rank = torch.distributed.get_rank() if _distributed() else 0
    # the cause looked up before the partial folder frees the space
    failed = _failed_writes(directory, exc, rank)
    if alone or rank == 0:
        remove_partial_folders(directory, name)
    before = "the state saved there before is intact" if _saved_before(path) else "none was"
    return CheckpointError(
        f"Cannot save the training state {path}: writing it failed on {failed}. "
        f"{path} was not written ({before}); its partial folder is removed."
    )


def _saved_before(path: str | os.PathLike[str]) -> bool:
    if not storage.is_url(path):
        return os.path.exists(path)
    try:
        return is_state_folder(path)
    except (OSError, CheckpointError):  # the store unreachable: none that this save knows of
        return False


def save_state_folder(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    asynchronous: bool = False,
    group: ProcessGroup | None = None,
    on_committed: Callable[[], object] | None = None,
    alone: bool = False,
    stager: Any = None,
) -> SaveInFlight | None:
    """``dcp_folder.save_folder`` whose failures raise ``CheckpointError``;
    asynchronous: a ``SaveInFlight``. Where the directory to save in is
    missing, every rank raises before anything is written (DCP would create
    it; an object store has no folders to check)."""
    if not storage.is_url(path):
        check_directory(path)
    try:
        future = save_folder(
            state,
            path,
            asynchronous=asynchronous,
            group=group,
            on_committed=on_committed,
            alone=alone,
            stager=stager,
        )
    except (OSError, checkpoint_exception()) as exc:
        raise _save_error(path, exc, alone) from None
    return None if future is None else SaveInFlight(os.fspath(path), future, alone)


@dataclass(eq=False)
class SaveInFlight:
    """An asynchronous save: ``path``, the future that ends once its folder
    is committed, and whether this process saves it ``alone``. Its net holds
    it (``StateSaves.in_flight``) and waits for it; nothing else does."""

    path: str
    future: concurrent.futures.Future[None]
    alone: bool = False

    def wait(self, io_timeout: float | None) -> None:
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


@dataclass(eq=False)
class StateSaves:
    """A net's asynchronous saves in this process: the save ``in_flight``
    (at most one) and the gloo ``group`` they run on. An asynchronous save
    outlives the fit that started it: the next save, ``wait_for_saves``, a
    load and a failing fit wait for it."""

    in_flight: SaveInFlight | None = None
    group: ProcessGroup | None = None
    own: ProcessGroup | None = None
    kept: Any = None  # the stager of kept_stager()

    def kept_stager(self) -> Any:
        """DCP's stager for this net's asynchronous saves, kept between them:
        it keeps the CPU copy of each tensor it staged, and the next save
        copies into it. ``dcp.async_save`` makes a stager per save, which
        allocates the whole copy anew: on this machine, page faults took three
        quarters of staging 300 MB. The copy stays in memory as long as the
        net's tensors do, as torchtitan's asynchronous saves keep theirs.
        None where torch has no ``DefaultStager`` (older releases): DCP's own. One
        save at a time uses it: a save waits for the one in flight first."""
        if self.kept is None:
            try:
                # pylint: disable-next=import-outside-toplevel
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            except ImportError:
                return None
            # on the calling thread, without pinned or shared memory (CPU copies)
            self.kept = DefaultStager(StagingOptions(False, False, False, False))
        return self.kept

    def let_go_of_the_copy(self) -> None:
        """Leave the kept copy to a save that stalled, which may still write
        from it, or stage into it, in the background: the next save makes its
        own, so that it cannot change what that save commits later."""
        self.kept = None

    def save_group(self) -> ProcessGroup | None:
        """The process group of asynchronous saves: the one made before, or
        a new gloo group (a collective: every rank calls it); None without a
        process group.

        Never the default group, even where it is gloo's: DCP's thread runs its
        collectives while training's run on that group, and two threads' calls
        on one group pair up across ranks in whatever order each rank made them.
        """
        if not _distributed():
            return None
        if self.group is None:
            self.group = torch.distributed.new_group(backend="gloo")
        return self.group

    def own_group(self) -> ProcessGroup:
        """A gloo group of this process alone, made once, for the saves it
        writes by itself (``save_on_each_node``'s copies): only this rank
        takes part in making it. DCP given no group would assume one process
        without torch.distributed and warn so from its writer thread, where
        no filter of the caller's applies."""
        if self.own is None:
            rank = torch.distributed.get_rank()
            self.own = torch.distributed.new_group(
                ranks=[rank], backend="gloo", use_local_synchronization=True
            )
        return self.own

    def wait(self, io_timeout: float | None) -> None:
        """On this rank: wait for the save in flight, at most ``io_timeout``;
        raise what it raised. It is no longer in flight either way."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return
        try:
            in_flight.wait(io_timeout)
        finally:
            if not in_flight.future.done():
                self.let_go_of_the_copy()  # the stalled write still reads it

    @contextlib.contextmanager
    def finished_on_error(self, io_timeout: float | None) -> Iterator[None]:
        """Where the block raises, finish the save in flight, at most
        ``io_timeout``, and warn if it failed too, without hiding the block's
        error."""
        try:
            yield
        except BaseException:
            try:
                self.wait(io_timeout)
            except Exception as exc:  # pylint: disable=broad-except
                warnings.warn(
                    f"An asynchronous save_state failed too: {type(exc).__name__}: {exc}",
                    RuntimeWarning,
                )
            raise
