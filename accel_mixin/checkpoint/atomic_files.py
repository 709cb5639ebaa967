"""Checkpoint files written atomically, with errors that name the file.

A file is written to a temporary file in its target directory, fsynced and
renamed into place: a crash or an error mid-write leaves the previous file as
it was. After a crash of the machine the name holds the previous file or the
new one, each whole: the content is on disk before the rename. The directory
is not fsynced, as DCP's commit of its ``.metadata`` is not: that would make
the rename itself durable at once rather than at the filesystem's next commit
(seconds), which no promise needs, for a tenth of a small save's time.

Each save has a temporary file of its own, locked (``flock``) while the save
lives: the next save of the same file removes what a killed save of it left
(its lock went with its process), and a run folder's rotation
(``remove_temporaries``) removes the rest; a live save's file is never taken
for a leftover. Where the filesystem has no locks, leftovers stay.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Collection, Iterator, Sequence
from types import ModuleType
from typing import Any, Union

from accel_mixin.errors import CheckpointError

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows: no locks, leftovers stay
    fcntl = None


_TMP = ".accel_mixin-tmp-"

# a file name as open() takes it
Path = Union[str, "os.PathLike[str]"]


def _directory(path: Path) -> str:
    return os.path.dirname(os.path.abspath(path))


def remove_temporaries(directory: str, prefix: str = _TMP) -> None:
    """Remove the temporary files in ``directory`` (those of one target with
    its ``prefix``) that no live save holds: what killed saves left."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            name = os.path.join(directory, entry)
            if entry.startswith(prefix) and _left_over(name):
                with contextlib.suppress(OSError):
                    os.unlink(name)


def _lock(fd: int) -> bool:
    """Hold ``fd``'s file for this save; True where the filesystem locks."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _left_over(name: str) -> bool:
    """Whether no live save holds the file ``name`` (a killed one's lock is gone)."""
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        return _lock(fd)
    finally:
        os.close(fd)


def _resolve_target(path: Path) -> tuple[str, os.stat_result | None]:
    """The file to replace for ``path`` (a link's target), and its status or None."""
    name, target = os.fspath(path), None
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        target = os.lstat(name)
        if stat.S_ISLNK(target.st_mode):  # replacing the link would cut it off
            name, target = os.path.realpath(name), None
            target = os.lstat(name)
    if target is not None and stat.S_ISDIR(target.st_mode):
        raise IsADirectoryError(
            f"Cannot save to {name}: it is a directory; pass a file name such as "
            f"{os.path.join(name, 'params.pt')}"
        )
    return name, target


def check_directory(path: Path) -> None:
    """Raise, naming ``path`` and what to do, where the directory to save
    ``path`` in is missing or a file."""
    directory = _directory(path)
    parent = directory
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(
            f"Cannot save to {path}: {parent} is a file, not a directory; "
            "choose another path, or move that file away"
        )
    if parent != directory:
        raise FileNotFoundError(
            f"Cannot save to {path}: the directory {directory} does not exist; create it first"
        )


def _create_temporary(path: str) -> tuple[int, str]:
    """Create this save's temporary file for ``path``, locked; return (fd, name)."""
    directory = _directory(path)
    # A prefix per target of fixed length, so that any name the filesystem
    # admits saves, and a token per save; ".tmp" at the end, since torch.save
    # refuses a name that is empty up to its last dot.
    digest = hashlib.blake2s(os.path.basename(path).encode(), digest_size=8).hexdigest()
    prefix = f"{_TMP}{digest}-"
    remove_temporaries(directory, prefix)
    tmp = os.path.join(directory, f"{prefix}{secrets.token_hex(4)}.tmp")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, flags, 0o666)
    except (FileNotFoundError, NotADirectoryError):
        check_directory(path)
        raise
    _lock(fd)  # until the fd closes, after the rename
    return fd, tmp


def _concurrent(path: str) -> FileExistsError:
    return FileExistsError(
        errno.EEXIST,
        f"Cannot save {path}: something replaced this save's temporary file while it "
        "wrote (another save of the same file, on a filesystem without locks?); save each "
        "file from one process at a time. The file that was there before is unchanged.",
    )


def _ours(tmp: str, created: os.stat_result) -> bool:
    """Whether the name ``tmp`` is still the file created as ``created`` (no
    other save replaced it)."""
    try:
        st = os.stat(tmp)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (created.st_dev, created.st_ino)


def _chmod(fd: int, mode: int) -> None:
    # some filesystems (vfat, exFAT, some SMB and FUSE mounts) refuse chmod:
    # their files keep the mount's mode, which a plain open gets too
    with contextlib.suppress(OSError):
        os.fchmod(fd, mode)


@contextlib.contextmanager
def atomic_files(paths: Collection[Path]) -> Iterator[list[str]]:
    """Write the files ``paths`` as one unit: all of them or none.

    Yields one temporary file name per path, for the block to write. Once all
    are written they are fsynced and renamed into place; an error before that
    leaves every target as it was.
    """
    # (target, temporary, fd, its status at creation, the mode it ends with)
    written: list[tuple[str, str, int, os.stat_result, int]] = []
    try:
        for given in paths:
            path, target = _resolve_target(given)
            fd, tmp = _create_temporary(path)
            created = os.fstat(fd)
            # the mode of the file it replaces, or a plain open's; meanwhile
            # writable by its owner, for torch.save opens it again by name
            now = stat.S_IMODE(created.st_mode)
            mode = now if target is None else stat.S_IMODE(target.st_mode)
            written.append((path, tmp, fd, created, mode))
            if not now & stat.S_IWUSR:
                _chmod(fd, now | stat.S_IWUSR)
        yield [tmp for _, tmp, *_ in written]
        for _, _, fd, created, mode in written:
            if mode != stat.S_IMODE(created.st_mode) or not mode & stat.S_IWUSR:
                _chmod(fd, mode)
            os.fsync(fd)  # the same file, however it was written
        for path, tmp, _, created, _ in written:
            if not _ours(tmp, created):
                raise _concurrent(path)
        for path, tmp, *_ in written:
            os.replace(tmp, path)
    except BaseException as exc:
        # before the temporary files go, which frees the space they took
        error = write_error([p for p, *_ in written] or list(paths), exc)
        for _, tmp, _, created, _ in written:
            if _ours(tmp, created):  # not a concurrent save's
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        if error is None:
            raise
        raise error from exc
    finally:
        for _, _, fd, *_ in written:
            os.close(fd)


def atomic_write(path: Path, write: Callable[[Any], object], *, by_name: bool = False) -> None:
    """Write ``path`` all or nothing: ``write`` gets a binary file object, or
    with ``by_name=True`` the temporary file's name."""
    with atomic_files([path]) as (tmp,):
        if by_name:
            write(tmp)
        else:
            with open(tmp, "wb") as f:
                write(f)


_WRITE_CAUSES = {
    errno.ENOSPC: ("no space is left on the device of {dir}", "free space or save elsewhere"),
    errno.EDQUOT: ("the disk quota of {dir} is exceeded", "free space or save elsewhere"),
    errno.EROFS: ("{dir} is on a read-only filesystem", "save to a writable directory"),
    errno.EACCES: (
        "permission to write in {dir} is denied",
        "save to a directory this user can write to, or change its permissions",
    ),
    errno.EPERM: (
        "the filesystem of {dir} does not permit the write",
        "save to a directory this user can write to",
    ),
}


def write_cause(directory: str, exc: BaseException) -> tuple[int, str] | None:
    """``(errno, "cause; fix")`` of a failed write into ``directory``, or
    None where ``exc`` is no error of the filesystem this knows."""
    if isinstance(exc, CheckpointError) or not isinstance(exc, (OSError, RuntimeError)):
        return None
    code = getattr(exc, "errno", None)
    if code is None:  # torch's C++ writer reports a full disk without an errno
        with contextlib.suppress(OSError):
            if shutil.disk_usage(directory).free == 0:
                code = errno.ENOSPC
    if code not in _WRITE_CAUSES:
        return None
    cause, fix = _WRITE_CAUSES[code]
    return code, f"{cause.format(dir=directory)}; {fix}"


def write_error(paths: Sequence[Path], exc: BaseException) -> OSError | None:
    """An ``OSError`` naming ``paths``, the cause of ``exc`` and the fix; None
    where ``exc`` says it already."""
    directory = _directory(paths[0]) if paths else "."
    found = write_cause(directory, exc)
    if found is None:
        return None
    code, cause = found
    names = ", ".join(os.fspath(p) for p in paths)
    return OSError(
        code,
        f"Cannot save {names}: {cause}. The files that were there before are unchanged. "
        f"({without_name(exc)})",
    )


def without_name(exc: BaseException) -> str:
    """``exc`` as its type and text, less the file it names: a temporary
    file's name, which the user never chose, would only confuse."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: [Errno {exc.errno}] {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"
