"""Checkpoint files: written atomically, read safely, errors that name the file.

A file is written under a temporary name in its target directory, flushed,
fsynced and renamed into place, so a crash or an error mid-write leaves the
previous file as it was. Temporary files that writers left behind are removed by
the next write to the same directory: at once where the writer was a process of
this machine that is gone, after ``ABANDONED_AFTER`` seconds without a change
where it was another machine's. Reading refuses pickles that
would run code, maps torch files into memory instead of copying them, and
turns the errors of torch, safetensors and json into messages that say which
file is wrong and what to do.
"""

import contextlib
import errno
import hashlib
import json
import os
import pickle
import secrets
import shutil
import socket
import stat
import time
import zipfile

import safetensors
import safetensors.torch
import torch

from accel_mixin.errors import CheckpointError

__all__ = [
    "atomic_files",
    "atomic_write",
    "check_readable",
    "check_same_save",
    "history_error",
    "read_error",
    "read_state",
    "write_state",
]

_TMP = ".accel_mixin-tmp-"
# In temporary names: a process id means something on its own machine only,
# and a shared filesystem may hold the writes of several machines.
# Hashed to a fixed length, so that temporary names are short whatever the
# host (a pod's name may be 63 characters).
_HOST = hashlib.blake2s(socket.gethostname().encode(), digest_size=4).hexdigest()


def _is_path(f):
    return isinstance(f, (str, os.PathLike))


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# A temporary file of another machine (or of a process whose id this machine
# cannot check) is abandoned once nothing wrote to it for this long: a write
# in progress touches its file continuously, and a machine that died and was
# replaced never comes back to finish its multi-GB partial file.
ABANDONED_AFTER = 6 * 3600


def _sweep(path):
    """Remove the abandoned temporary files in the directory of ``path``.

    A temporary file is abandoned when its writer was a process of this
    machine that is gone, or when nobody wrote to it for ``ABANDONED_AFTER``
    seconds, whichever machine wrote it. A file that is being written is
    never removed: on this machine its writer is alive, elsewhere it keeps
    being modified.
    """
    directory = os.path.dirname(os.path.abspath(path))
    mine = f"{_TMP}{_HOST}-"
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            if not entry.startswith(".") or _TMP not in entry:
                continue
            full = os.path.join(directory, entry)
            owner = entry.split(mine, 1)[1] if mine in entry else ""
            pid = owner.split("-", 1)[0]
            if pid.isdigit():
                abandoned = not _pid_alive(int(pid))
            else:
                try:
                    abandoned = now - os.stat(full).st_mtime > ABANDONED_AFTER
                except OSError:
                    continue
            if abandoned:
                with contextlib.suppress(OSError):
                    os.unlink(full)


def _resolve_target(path):
    """The file to replace for ``path``, and its status (None if missing)."""
    path = os.fspath(path)
    target = _target_status(path)
    if target is not None and stat.S_ISLNK(target.st_mode):
        # update the file the link points to; replacing the link itself
        # would cut it off from its target
        path = os.path.realpath(path)
        target = _target_status(path)
    if target is not None and stat.S_ISDIR(target.st_mode):
        raise IsADirectoryError(
            f"Cannot save to {path}: it is a directory; pass a file name such as "
            f"{os.path.join(path, 'params.pt')}"
        )
    return path, target


# In a directory, which files of the last saves belong together: save id ->
# {name: [size, mtime_ns, inode]} of each file as that save wrote it
SETS = ".accel_mixin-sets.json"
_SETS_KEPT = 8


def _identity(st):
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_sets(directory):
    try:
        with open(os.path.join(directory, SETS), encoding="utf-8") as f:
            sets = json.load(f)
        return sets if isinstance(sets, dict) else {}
    except (OSError, ValueError):
        return {}


def _record_set(written):
    """Record, in each directory, which files this save writes together: as
    they will be once renamed (a rename keeps size, time and inode). It is
    renamed into place before them, so that a save interrupted between its
    renames leaves files that the record tells apart."""
    by_directory = {}
    for path, _, fd, _ in written:
        by_directory.setdefault(os.path.dirname(os.path.abspath(path)), {})[
            os.path.basename(path)
        ] = _identity(os.fstat(fd))
    save = f"{time.time():.6f}-{secrets.token_hex(4)}"
    for directory, files in by_directory.items():
        sets = _read_sets(directory)
        sets[save] = files
        kept = dict(sorted(sets.items())[-_SETS_KEPT:])
        with atomic_files([os.path.join(directory, SETS)]) as (tmp,):
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(kept, f)


def _when(save):
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(save.split("-")[0])))


def check_same_save(paths):
    """Raise a ``CheckpointError`` if files of ``paths`` that one directory's
    record knows come from different saves; files it does not know (written
    otherwise, or changed since) are not checked."""
    by_directory = {}
    for path in paths:
        if _is_path(path):
            by_directory.setdefault(os.path.dirname(os.path.abspath(path)), []).append(path)
    for directory, files in by_directory.items():
        if len(files) < 2:
            continue
        sets = _read_sets(directory)
        if not sets:
            continue
        saves = {}
        for path in files:
            try:
                identity = _identity(os.stat(path))
            except OSError:
                continue
            name = os.path.basename(path)
            save = next(
                (
                    s
                    for s, members in sorted(sets.items(), reverse=True)
                    if members.get(name) == identity
                ),
                None,
            )
            if save is not None:
                saves[os.fspath(path)] = save
        if len(set(saves.values())) > 1:
            listed = ", ".join(f"{path} (saved {_when(save)})" for path, save in saves.items())
            raise CheckpointError(
                f"These files come from different saves: {listed}. A save of the set failed "
                "or was cut off part way, or the files were saved apart; load files that one "
                "save_params call wrote together (or load them one by one, if that is what "
                "you mean)."
            )


@contextlib.contextmanager
def atomic_files(paths, *, record=False):
    """Write the files ``paths`` as one unit: all of them or none.

    Yields the names of temporary files, one per path in the same order and
    directory, for the block to write (by name). After the block each is
    fsynced and, once all are complete, renamed into place; an error before
    that leaves every target as it was and removes the temporary files.
    With ``record=True`` the directory's record of which files belong
    together (``check_same_save``) learns of them first.
    """
    written = []  # (target, temporary, fd, mode)
    try:
        for path in paths:
            path, target = _resolve_target(path)
            _sweep(path)
            fd, tmp = _create_temporary(path)
            written.append((path, tmp, fd, _Mode(fd, target)))
        yield [tmp for _, tmp, _, _ in written]
        for _, _, fd, mode in written:
            mode.finish()
            os.fsync(fd)  # the same file, however it was written
        if (
            record
            and written
            and (len(written) > 1 or any(_read_sets(os.path.dirname(p)) for p, *_ in written))
        ):
            _record_set(written)
        for path, tmp, _, _ in written:
            os.replace(tmp, path)
    except BaseException as exc:
        # before the temporary files go, which frees the space they took
        error = write_error([p for p, *_ in written] or list(paths), exc)
        for _, tmp, _, _ in written:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if error is None:
            raise
        raise error from exc
    finally:
        for _, _, fd, _ in written:
            os.close(fd)
    for directory in {os.path.dirname(os.path.abspath(path)) for path, _, _, _ in written}:
        with contextlib.suppress(OSError):  # make the renames themselves durable
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


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


def write_error(paths, exc):
    """An ``OSError`` that names the files ``paths``, the cause of ``exc``
    in words and what to do, or None where ``exc`` says it already."""
    if isinstance(exc, CheckpointError) or not isinstance(exc, (OSError, RuntimeError)):
        return None
    directory = os.path.dirname(os.path.abspath(paths[0])) if paths else "."
    code = getattr(exc, "errno", None)
    if code is None:
        # torch's C++ writer reports a full disk without an errno
        with contextlib.suppress(OSError):
            if shutil.disk_usage(directory).free == 0:
                code = errno.ENOSPC
    if code not in _WRITE_CAUSES:
        return None
    cause, fix = _WRITE_CAUSES[code]
    names = ", ".join(os.fspath(p) for p in paths)
    return OSError(
        code,
        f"Cannot save {names}: {cause.format(dir=directory)}; {fix}. The files that were "
        f"there before are unchanged. ({type(exc).__name__}: {exc})",
    )


def atomic_write(path, write, *, by_name=False):
    """Write ``path`` through ``write``, all or nothing.

    Parameters
    ----------
    path : str or os.PathLike
      The target.

    write : callable
      Writes the content into the binary file object it is given, or, with
      ``by_name=True``, into the file named by the path it is given.

    by_name : bool (default=False)
      Give ``write`` the temporary file's name instead of a file object:
      ``torch.save`` writes a named file through its own C++ writer, which
      is faster than through a Python file object.

    """
    with atomic_files([path]) as (tmp,):
        if by_name:
            write(tmp)
        else:
            with open(tmp, "wb") as f:
                write(f)


def _target_status(path):
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _create_temporary(path):
    """Create a new temporary file next to the target; return (fd, path).

    It gets the mode a plain open would give it: the umask applies.
    """
    directory = os.path.dirname(os.path.abspath(path))
    # Of a fixed length (under 50 bytes), not the target's name and more: any
    # name the filesystem admits for the target saves. It ends in ".tmp":
    # torch.save refuses a file whose name, up to its last dot, is empty.
    prefix = os.path.join(directory, f"{_TMP}{_HOST}-{os.getpid()}-")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = prefix + secrets.token_hex(4) + ".tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
        except (FileNotFoundError, NotADirectoryError):
            parent = _existing_parent(directory)
            if parent is not None and not os.path.isdir(parent):
                raise NotADirectoryError(
                    f"Cannot save to {path}: {parent} is a file, not a directory; "
                    "choose another path, or move that file away"
                ) from None
            if not os.path.isdir(directory):
                raise FileNotFoundError(
                    f"Cannot save to {path}: the directory {directory} does not exist; "
                    "create it first"
                ) from None
            raise


def _existing_parent(directory):
    """The deepest existing path on the way to ``directory``, or None."""
    while directory and not os.path.lexists(directory):
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent
    return directory or None


class _Mode:
    """The temporary file's mode while it is written and once it is done.

    It ends with the mode of the file it replaces, or the mode a plain open
    gives a new one. While it is written it must be writable by its owner:
    ``torch.save`` opens it again by name, which a read-only target's mode,
    or a umask that removes the owner's write bit, would refuse. Some
    filesystems (vfat, exFAT, some SMB and FUSE mounts) refuse chmod: their
    files have the mode the mount gives them, which a plain open gets too.
    """

    def __init__(self, fd, target):
        self.fd = fd
        created = stat.S_IMODE(os.fstat(fd).st_mode)
        self.final = created if target is None else stat.S_IMODE(target.st_mode)
        self.now = created
        self._set(created | stat.S_IWUSR)

    def finish(self):
        self._set(self.final)

    def _set(self, mode):
        if mode != self.now:
            with contextlib.suppress(OSError):
                os.fchmod(self.fd, mode)
                self.now = mode


def _write(f, write, *, by_name=False):
    if _is_path(f):
        atomic_write(f, write, by_name=by_name)
    else:  # a file object the caller opened: theirs to make safe
        write(f)


def write_state(state, f, *, use_safetensors=False):
    """Save a state dict to a path (atomically) or a file object."""
    if use_safetensors:
        _write(f, lambda fh: fh.write(safetensors.torch.save(state)))
    else:
        _write(f, lambda target: torch.save(state, target), by_name=True)


def check_readable(f):
    if not _is_path(f):
        return
    if os.path.isdir(f):
        raise IsADirectoryError(
            f"Cannot load {f}: it is a directory; pass the path of a file that "
            "save_params wrote, e.g. " + os.path.join(os.fspath(f), "params.pt")
        )
    if not os.path.exists(f):
        raise FileNotFoundError(
            f"No checkpoint at {f}: check the path; on several machines, the file "
            "must be where each process runs (a shared filesystem, or "
            "ProjectConfiguration(save_on_each_node=True))"
        )


def read_state(f, *, use_safetensors=False, torch_load_kwargs=None, map_location="cpu", mmap=True):
    """Load a state dict, refusing pickles that would run code.

    Parameters
    ----------
    f : str, os.PathLike or file object
      What save_params wrote.

    use_safetensors : bool (default=False)
      Whether the file is a safetensors file.

    torch_load_kwargs : dict or None (default=None)
      skorch's parameter: keyword arguments for ``torch.load``; by default
      ``weights_only=True``.

    map_location : str or torch.device (default='cpu')
      Where tensors are loaded.

    mmap : bool (default=True)
      Map a torch zip file into memory rather than reading it, so that
      loading does not hold a second copy of the weights.

    Raises
    ------
    FileNotFoundError, IsADirectoryError
      If ``f`` is not a file.

    CheckpointError
      If the file is truncated, corrupt, or would run code when unpickled.

    """
    check_readable(f)
    if use_safetensors:
        return _read_safetensors(f, map_location)
    kwargs = {"weights_only": True} if torch_load_kwargs is None else dict(torch_load_kwargs)
    kwargs.setdefault("map_location", map_location)
    if mmap and _is_path(f) and "mmap" not in kwargs and zipfile.is_zipfile(f):
        kwargs["mmap"] = True
    try:
        return torch.load(f, **kwargs)
    except Exception as exc:  # pylint: disable=broad-except
        error = read_error(f, exc, weights_only=kwargs.get("weights_only"))
        if error is None:
            raise
        raise error from exc


# how torch words the refusal of a global under weights_only, across releases
_REFUSALS = ("allowed global", "unsupported global", "unsupported class", "blocked")


def read_error(f, exc, *, weights_only, use_safetensors=False):
    """The ``CheckpointError`` that says what is wrong with the file ``f``,
    whose reading raised ``exc``; None where the environment failed, not the
    file (``OSError``, ``ImportError``, ``MemoryError``)."""
    if isinstance(exc, CheckpointError):
        return exc
    if use_safetensors:
        if isinstance(exc, (safetensors.SafetensorError, ValueError, OSError)):
            return CheckpointError(
                f"{f} is not a complete safetensors file, it may be truncated, corrupt, or "
                f"saved without use_safetensors=True ({exc})"
            )
        return None
    if isinstance(exc, pickle.UnpicklingError):
        if weights_only and any(hint in str(exc).lower() for hint in _REFUSALS):
            return CheckpointError(
                f"Refused to load {f}: it holds objects whose unpickling would run code, "
                "and files are loaded with weights_only=True. If you trust the file and "
                "its source, pass torch_load_kwargs={'weights_only': False} to the net."
            )
        return _unreadable(f, exc)
    if isinstance(exc, (RuntimeError, EOFError, ValueError, zipfile.BadZipFile)):
        return CheckpointError(
            f"{f} is not a complete torch file, it may be truncated or corrupt "
            f"({type(exc).__name__}: {exc}){_safetensors_hint(f)}; load an earlier checkpoint "
            "or save again."
        )
    if isinstance(exc, (OSError, ImportError, MemoryError)):
        return None  # the environment, not the file
    # garbage makes the unpickler fail in any way (IndexError, KeyError, ...)
    return _unreadable(f, exc)


def _unreadable(f, exc):
    return CheckpointError(
        f"{f} is not a readable torch file (corrupt?{_safetensors_hint(f)}): "
        f"{type(exc).__name__}: {exc}"
    )


def _safetensors_hint(f):
    """A pointer to use_safetensors=True where ``f`` looks like a safetensors file."""
    if not _is_path(f):
        return ""
    try:
        with open(f, "rb") as file:
            head = file.read(9)
    except OSError:
        return ""
    # a safetensors file starts with the length of its JSON header, then '{'
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 2**27:
        return "; it looks like a safetensors file: load it with use_safetensors=True"
    return ""


def _read_safetensors(f, map_location):
    device = str(map_location)
    try:
        if _is_path(f):
            return safetensors.torch.load_file(f, device=device)
        return safetensors.torch.load(f.read())
    except (safetensors.SafetensorError, ValueError, OSError) as exc:
        raise read_error(f, exc, weights_only=True, use_safetensors=True) from exc


def history_error(f, exc):
    """The ``CheckpointError`` for the history file ``f`` whose reading
    raised ``exc``, or None if the file is not to blame."""
    if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError, TypeError)):
        return CheckpointError(
            f"{f} is not a history file that save_params wrote (invalid JSON: {exc})"
        )
    return None
