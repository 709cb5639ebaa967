"""Where checkpoints live: a local path, or an fsspec URL (``s3://``,
``gs://``, ``memory://``, any protocol fsspec knows).

A ``file://`` URL is a local path (``local``) and goes through the POSIX code
of ``atomic_files`` and ``dcp_folder``, whose renames are atomic. Every
other URL goes to fsspec, which gives each protocol's filesystem and its
settings (endpoint, credentials) from fsspec's configuration and the
environment, as Lightning's and Ray Train's paths do. An object store has
folders only as prefixes and no rename: a file is written in one upload,
which the store shows whole or not at all, and a training state commits
with a marker (``object_states``).

The functions here answer for both kinds, so the callers keep one path
type; fsspec's listings cache is dropped before each look, since another
process (another rank) changes the store between two of them.
"""

from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING, Any, TypeVar, Union, cast

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = [
    "exists",
    "filesystem",
    "is_url",
    "isdir",
    "join",
    "listdir",
    "local",
    "makedirs",
    "modified",
    "read_bytes",
    "remove",
    "split",
    "write_bytes",
]

# a place as the user gives it: a path or a URL
Where = Union[str, "os.PathLike[str]"]
_T = TypeVar("_T")


def local(path: _T) -> _T:
    """``path``, with a ``file://`` URL as the local path it names."""
    if isinstance(path, str) and path.startswith("file://"):
        return cast("_T", path[len("file://") :] or "/")
    return path


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL of another filesystem than the local one."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """fsspec's filesystem of ``url`` and the path in it; an error that
    names the URL and the package to install where fsspec lacks the protocol."""
    import fsspec  # pylint: disable=import-outside-toplevel

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        protocol = url.split("://", 1)[0]
        raise ValueError(
            f"Cannot reach {url}: fsspec has no filesystem for {protocol}:// here ({exc}). "
            f"Install its package (s3fs for s3://, gcsfs for gs://, adlfs for az://)."
        ) from exc


def _fresh(url: str) -> tuple[AbstractFileSystem, str]:
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    return fs, path


def join(base: Where, *names: str) -> str:
    """``os.path.join`` for paths, ``/`` between the parts of a URL."""
    if is_url(base):
        return posixpath.join(str(base).rstrip("/"), *names)
    return os.path.join(base, *names)


def split(path: Where) -> tuple[str, str]:
    """``(directory, name)`` of ``path``: the absolute directory of a path,
    the URL up to its last part of a URL."""
    if is_url(path):
        head, _, name = str(path).rstrip("/").rpartition("/")
        return head, name
    return os.path.split(os.path.abspath(os.fspath(path)))


def listdir(path: Where) -> list[str]:
    """The names in the folder ``path``; ``FileNotFoundError`` where it is
    missing (on an object store: where nothing is under it)."""
    if not is_url(path):
        return os.listdir(path)
    fs, inner = _fresh(str(path))
    return [posixpath.basename(entry.rstrip("/")) for entry in fs.ls(inner, detail=False)]


def isdir(path: Where) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, inner = _fresh(str(path))
    return bool(fs.isdir(inner))


def exists(path: Where) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, inner = _fresh(str(path))
    return bool(fs.exists(inner))


def makedirs(path: Where) -> None:
    """Create the folder ``path``; on an object store a folder is a prefix
    and comes with its first file (a missing bucket is created)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)
        return
    fs, inner = filesystem(str(path))
    fs.makedirs(inner, exist_ok=True)


def remove(path: Where) -> None:
    """Remove the file or folder ``path`` of a URL, with all under it;
    nothing where it is gone."""
    fs, inner = _fresh(str(path))
    try:
        fs.rm(inner, recursive=True)
    except FileNotFoundError:
        pass


def modified(path: Where) -> float:
    """When ``path`` last changed, in seconds since the epoch; 0 for an
    object store's folder, which has no time of its own."""
    if not is_url(path):
        return os.path.getmtime(path)
    fs, inner = _fresh(str(path))
    try:
        stamp: Any = fs.modified(inner)
    except (FileNotFoundError, NotImplementedError, IsADirectoryError, OSError):
        return 0.0
    return float(stamp.timestamp())


def read_bytes(path: Where) -> bytes:
    """The content of the file ``path``; ``FileNotFoundError`` where it is missing."""
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    fs, inner = _fresh(str(path))
    return bytes(fs.cat_file(inner))


def write_bytes(url: str, data: bytes) -> None:
    """Write the file ``url`` of an object store in one upload: it is there
    whole, or the previous one is."""
    fs, inner = filesystem(url)
    fs.pipe_file(inner, data)
    fs.invalidate_cache(inner)


def put_file(local_path: str, url: str) -> None:
    """Upload the local file ``local_path`` as ``url`` (whole or not at all)."""
    fs, inner = filesystem(url)
    fs.put_file(local_path, inner)
    fs.invalidate_cache(inner)


def get_file(url: str, local_path: str) -> None:
    """Download ``url`` into the local file ``local_path``."""
    fs, inner = _fresh(url)
    fs.get_file(inner, local_path)
