"""``save_params`` and ``load_params`` files at fsspec URLs.

skorch and ``atomic_files`` write and read local files: a URL's file is
written locally first, in a temporary folder, and uploaded once every file
of the call is complete; a URL is downloaded into one before it is read, so
module files still load memory-mapped. Each upload shows whole or not at all,
so a failed or interrupted save leaves each file as it was or complete; the
files of one call are uploaded one after the other, not as one unit, which
no object store offers.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from accel_mixin.checkpoint import storage
from accel_mixin.errors import CheckpointError

__all__ = ["fetched", "uploaded"]


def _staged(folder: str, files: Mapping[str, Any]) -> dict[str, str]:
    """A local file in ``folder`` for each URL of ``files``, by key."""
    return {
        key: os.path.join(folder, f"{number}-{storage.split(url)[1] or 'file'}")
        for number, (key, url) in enumerate(files.items())
        if storage.is_url(url)
    }


@contextlib.contextmanager
def uploaded(files: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """``files`` with each URL replaced by a local file to write, uploaded
    to the URL once the block succeeded."""
    if not any(storage.is_url(f) for f in files.values()):
        yield dict(files)
        return
    with tempfile.TemporaryDirectory(prefix="accel_mixin-upload-") as folder:
        staged = _staged(folder, files)
        with _named_as(staged, files):
            yield {**files, **staged}
            for key, path in staged.items():
                if os.path.exists(path):  # skorch writes no file for a missing attribute
                    _upload(path, files[key])


def _upload(path: str, url: str) -> None:
    try:
        storage.put_file(path, url)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"Cannot save {url}: the upload failed ({type(exc).__name__}: {exc}). The file "
            "that was there before is unchanged; check the store's address and credentials "
            "(fsspec's configuration, or the environment).",
        ) from exc


@contextlib.contextmanager
def fetched(files: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """``files`` with each URL replaced by a local copy of its file."""
    if not any(storage.is_url(f) for f in files.values()):
        yield dict(files)
        return
    with tempfile.TemporaryDirectory(prefix="accel_mixin-download-") as folder:
        staged = _staged(folder, files)
        for key, path in staged.items():
            try:
                storage.get_file(files[key], path)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"No checkpoint at {files[key]}: check the URL; nothing was saved there."
                ) from None
        with _named_as(staged, files):
            yield {**files, **staged}


@contextlib.contextmanager
def _named_as(staged: Mapping[str, str], files: Mapping[str, Any]) -> Iterator[None]:
    """A ``CheckpointError`` or ``OSError`` raised in the block names the
    URL where it named its local copy: the user never saw that one."""
    try:
        yield
    except (CheckpointError, OSError) as exc:
        said = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        text = said
        for key, path in staged.items():
            text = text.replace(path, str(files[key]))
        if text == said:
            raise
        if isinstance(exc, CheckpointError):
            raise CheckpointError(text) from exc
        raise type(exc)(exc.errno, text) from exc
