"""One training state, one ``torch.distributed.checkpoint`` (DCP) folder.

Every rank writes its own part with DCP into ``.<name>.partial-<token>/``
beside the target; rank 0 renames the folder to ``<name>`` once DCP's
``.metadata`` is in it (DCP writes it after every rank reported its data
written): that rename is the one commit marker, so a folder under a
state's name is whole. Plain values (the history, positions, callbacks'
values, generators) travel as one DCP item per key (``plain``) and load with
``weights_only=True``: DCP's own planner loads them with
``weights_only=False``, and its reader unpickles ``.metadata`` without
restriction, so both are replaced here.

At an fsspec URL (an object store, where nothing renames) the folder is a
new version of the state and a marker uploaded last is the commit
(``object_states``); DCP's fsspec writer and reader do the rest.

``save_state`` writes training states with it (``state_saves``); see
``docs/guide/architecture.md``, "Checkpoint format".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pickle
import secrets
import shutil
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from accel_mixin.checkpoint import object_states, storage
from accel_mixin.errors import CheckpointError

if TYPE_CHECKING:
    import io

    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import ReadItem

__all__ = [
    "PARTIAL",
    "WeightsOnlyPlanner",
    "checkpoint_exception",
    "commit_folder",
    "failures",
    "is_state_folder",
    "load_folder",
    "partial_folder",
    "plain",
    "read_full",
    "remove_partial_folders",
    "save_folder",
    "saved_keys",
    "set_aside",
    "unplain",
]

PARTIAL = ".partial-"
_ASIDE = ".old-"
METADATA = ".metadata"

_T = TypeVar("_T")
# a state to load into, filled in place and returned
_State = TypeVar("_State", bound="dict[str, Any]")


def plain(value: _T) -> tuple[_T]:
    """``value`` (tensors and plain values) as one DCP item: DCP walks into
    dicts and lists, one item per leaf, and keeps a tuple whole."""
    return (value,)


def unplain(loaded: object) -> Any:
    """The value that ``plain`` wrapped, as loaded."""
    return loaded[0] if isinstance(loaded, tuple) and len(loaded) == 1 else loaded


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, but plain values load as ``torch.load`` with
    ``torch_load_kwargs`` (``weights_only=True`` unless they say otherwise)
    loads them; missing keys are allowed where ``allow_partial_load``."""

    def __init__(self, torch_load_kwargs: Mapping[str, Any] | None = None, **kwargs: bool) -> None:
        super().__init__(**kwargs)
        self.torch_load_kwargs: dict[str, Any] = (
            {"weights_only": True} if torch_load_kwargs is None else dict(torch_load_kwargs)
        )

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, **{"map_location": "cpu", **self.torch_load_kwargs})
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# what DCP's .metadata holds: its own dataclasses, shapes, dtypes, paths
_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
)
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if (
            module in _METADATA_MODULES
            or (module, name) in _METADATA_GLOBALS
            or (module == "torch" and isinstance(found, torch.dtype))
        ):
            return found
        raise pickle.UnpicklingError(
            f"{module}.{name} is not what a DCP .metadata holds; refused, since loading it "
            "could run code"
        )


class _SafeMetadata:
    """A DCP reader whose ``.metadata`` unpickles DCP's own classes only."""

    fs: Any
    path: Any
    load_id: str

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self.fs.concat_path(self.path, METADATA)
        with self.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeReader(_SafeMetadata, FileSystemReader):
    """DCP's reader of a local folder, whose ``.metadata`` is read safely."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """DCP's reader of a folder of fsspec's, whose ``.metadata`` is read safely."""


def reader(path: str | os.PathLike[str]) -> FileSystemReader:
    """The safe DCP reader of the training state ``path``: a local folder,
    or the committed version of a state on an object store."""
    if not storage.is_url(path):
        return SafeReader(os.fspath(path))
    folder = object_states.committed_version(str(path))
    if folder is None:
        raise CheckpointError(
            f"{path} is not a training state: no save of it committed there (no "
            f"{object_states.MARKER}). Load a complete one (ResumeTraining finds the newest)."
        )
    return SafeFsspecReader(folder)


def is_state_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a committed DCP folder (``.metadata`` inside; on
    an object store, a commit marker)."""
    if storage.is_url(path):
        return object_states.committed_version(str(path)) is not None
    return os.path.isfile(os.path.join(os.fspath(path), METADATA))


def partial_folder(path: str | os.PathLike[str], token: str) -> str:
    """Where the save of ``path`` with ``token`` writes before its commit."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    return os.path.join(directory, f".{name}{PARTIAL}{token}")


def new_token(group: ProcessGroup | None = None) -> str:
    """A token for one save, the same on every rank (a collective where a
    process group exists)."""
    token = [secrets.token_hex(6)]
    if _distributed():
        torch.distributed.broadcast_object_list(token, src=0, group=group)
    return token[0]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def checkpoint_exception() -> type[CheckpointException]:
    """DCP's ``CheckpointException``: a ``BaseException``, which ``except
    Exception`` lets through."""
    from torch.distributed.checkpoint.api import (  # pylint: disable=import-outside-toplevel
        CheckpointException,
    )

    return CheckpointException


def failures(exc: CheckpointException) -> str:
    """Every rank's failure in DCP's ``CheckpointException``, one line each."""
    lines = []
    for rank, failure in sorted(exc.failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        lines.append(f"rank {rank}: {type(error).__name__}: {error}")
    return "; ".join(lines) or str(exc)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_folder(partial: str, path: str | os.PathLike[str]) -> None:
    """On rank 0, once DCP's save into ``partial`` completed: put it in
    place as ``path``. An existing ``path`` is renamed aside first and
    removed after; a crash between the renames leaves it whole under
    ``.<name>.old-<token>``."""
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    _fsync_dir(partial)
    aside = None
    if os.path.lexists(path):
        aside = os.path.join(directory, f".{name}{_ASIDE}{secrets.token_hex(6)}")
        os.rename(path, aside)
    try:
        os.rename(partial, path)
    except OSError:
        if aside is not None:  # the previous state back under its name
            with contextlib.suppress(OSError):
                os.rename(aside, path)
        raise
    _fsync_dir(directory)
    if aside is not None:
        _remove(aside)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def set_aside(path: str | os.PathLike[str]) -> list[str]:
    """The committed folders that replacing ``path`` renamed aside and a
    crash left there (``commit_folder``), newest first."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    found = [
        os.path.join(directory, entry)
        for entry in entries
        if entry.startswith(f".{name}{_ASIDE}") and is_state_folder(os.path.join(directory, entry))
    ]
    return sorted(found, key=os.path.getmtime, reverse=True)


def remove_partial_folders(directory: str | os.PathLike[str], name: str | None = None) -> None:
    """Remove the partial and aside folders in ``directory`` (of ``name``
    only, if given): what killed saves left. Only where no save into
    ``directory`` is in flight."""
    if storage.is_url(directory):
        object_states.remove_uncommitted(str(directory), name)
        return
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            if not entry.startswith("."):
                continue
            base, sep, _ = entry[1:].rpartition(PARTIAL)
            if not sep:
                base, sep, _ = entry[1:].rpartition(_ASIDE)
            if sep and (name is None or base == name):
                _remove(os.path.join(directory, entry))


@contextlib.contextmanager
def one_process_quietly(no_dist: bool = False) -> Iterator[None]:
    """Without a process group (or ``no_dist``: DCP told to run without one)
    DCP warns that it assumes one process: it is one."""
    with warnings.catch_warnings():
        if no_dist or not _distributed():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def save_folder(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    asynchronous: bool = False,
    group: ProcessGroup | None = None,
    on_committed: Callable[[], object] | None = None,
    alone: bool = False,
    stager: Any = None,
) -> concurrent.futures.Future[None] | None:
    """Save ``state`` (a dict of ``Stateful`` objects and values) as the
    DCP folder ``path``; every rank calls it, or with ``alone`` this process
    only, which then writes the whole folder by itself, with a token of its
    own and no collective (one machine's copy, ``save_on_each_node``).
    ``stager``: DCP's ``AsyncStager`` of an asynchronous save (None: a new
    one of DCP's, as ``dcp.async_save`` makes).

    Synchronous: returns once the folder is committed (on rank 0; the others
    once DCP's save ended, which waits for rank 0's ``.metadata``).
    Asynchronous: returns a future once the state is staged in CPU memory,
    which ends once DCP's save ended and (on rank 0) the folder is
    committed. ``group`` is the process group of the save's collectives (a
    gloo group for ``async_save``, which wants one with a CPU backend; with
    ``alone``, a group of this process only); ``on_committed`` runs on rank 0
    (or ``alone``) after the commit.
    """
    import torch.distributed.checkpoint as dcp  # pylint: disable=import-outside-toplevel

    token = secrets.token_hex(6) if alone else new_token(group)
    commits = alone or not _distributed() or torch.distributed.get_rank() == 0
    # on an object store: a new version of the state, committed by its marker
    remote = storage.is_url(path)
    partial = (
        object_states.version_folder(str(path), token) if remote else partial_folder(path, token)
    )
    target: dict[str, Any] = (
        # uploads are durable once closed: no fsync, which would sync the machine's disks
        {"storage_writer": FsspecWriter(partial, sync_files=False)}
        if remote
        else {"checkpoint_id": partial}
    )

    def commit() -> None:
        if commits:
            if remote:
                object_states.commit(str(path), token)
            else:
                commit_folder(partial, path)
            if on_committed is not None:
                on_committed()

    # alone, this process's own group keeps DCP from the default group's collectives
    no_dist = not _distributed() or (alone and group is None)
    with one_process_quietly(no_dist):
        if not asynchronous:
            dcp.save(state, **target, process_group=group, no_dist=no_dist)
            commit()
            return None
        # a Future: DCP returns an AsyncSaveResponse only where the stager's
        # staging is asynchronous itself; the kept stager stages on this thread
        future = cast(
            "concurrent.futures.Future[Metadata]",
            dcp.async_save(
                state,
                **target,
                process_group=group,
                no_dist=no_dist,
                **({} if stager is None else {"async_stager": stager}),
            ),
        )

    # the caller's future ends once committed: DCP's ends before its callbacks ran
    committed: concurrent.futures.Future[None] = concurrent.futures.Future()

    def done(finished: concurrent.futures.Future[Metadata]) -> None:
        try:
            finished.result()
            commit()
        except BaseException as exc:  # pylint: disable=broad-except
            committed.set_exception(exc)
        else:
            committed.set_result(None)

    future.add_done_callback(done)
    return committed


def saved_keys(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """The top-level keys of the DCP folder ``path`` and, for each, the
    flattened keys under it (``.metadata`` read safely)."""
    metadata = reader(path).read_metadata()
    keys: dict[str, list[str]] = {}
    for fqn in metadata.state_dict_metadata:
        keys.setdefault(fqn.split(".", 1)[0], []).append(fqn)
    return keys


def load_folder(
    state: _State,
    path: str | os.PathLike[str],
    *,
    torch_load_kwargs: Mapping[str, Any] | None = None,
    group: ProcessGroup | None = None,
    partial: bool = False,
) -> _State:
    """Fill ``state`` (a dict of ``Stateful`` objects and values laid out as
    saved) from the DCP folder ``path``, resharding; every rank calls it.
    ``partial``: keys of ``state`` that the folder lacks stay as they are."""
    import torch.distributed.checkpoint as dcp  # pylint: disable=import-outside-toplevel

    with one_process_quietly():
        dcp.load(
            state,
            storage_reader=reader(path),
            planner=WeightsOnlyPlanner(torch_load_kwargs, allow_partial_load=partial),
            process_group=group,
            no_dist=not _distributed(),
        )
    return state


def read_full(
    path: str | os.PathLike[str],
    keys: Collection[str] | None = None,
    *,
    torch_load_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The entries of the DCP folder ``path`` (those under the top-level
    ``keys``, or all), whole: full tensors whatever layout saved them, plain
    values as saved, nested as they were saved (mapping keys as strings).
    Each process that calls it reads alone (no collective): for DDP and one
    process, whose every rank needs the whole state."""
    from torch.distributed.checkpoint.metadata import (  # pylint: disable=import-outside-toplevel
        TensorStorageMetadata,
    )

    # one reader for both reads: on an object store each looks up the commit marker
    source = reader(path)
    metadata = source.read_metadata()
    paths = metadata.planner_data or {}
    flat: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if keys is not None and fqn.split(".", 1)[0] not in keys:
            continue
        if isinstance(item, TensorStorageMetadata):
            flat[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            flat[fqn] = None
    with warnings.catch_warnings():
        # one reader alone, whatever process group exists
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        import torch.distributed.checkpoint as dcp  # pylint: disable=import-outside-toplevel

        planner = WeightsOnlyPlanner(torch_load_kwargs, flatten_state_dict=False)
        dcp.load(flat, storage_reader=source, planner=planner, no_dist=True)
    # DCP loads into a shallow copy: tensors are filled in place, plain values
    # are in the planner's dict only
    flat.update((fqn, value) for fqn, value in planner.state_dict.items() if flat[fqn] is None)
    nested: dict[str, Any] = {}
    for fqn, value in flat.items():
        set_element(nested, paths.get(fqn, (fqn,)), value)
    return nested
