"""State dict files: read safely, loaded whatever wrapper wrote them, with
errors that say which file is wrong and what to do.

DDP and DataParallel save keys under ``module.``, ``torch.compile`` under
``_orig_mod.``, and wrappers nest. A prefix is removed only when every key
carries it: a partial prefix means a different model, and is reported rather
than guessed at. Reading refuses pickles that would run code and maps torch
files into memory.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import pickletools
import zipfile
from collections.abc import Iterable, Mapping
from typing import IO, TYPE_CHECKING, Any, Union, cast

import safetensors
import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from accel_mixin.distributed.sharding import shard_like
from accel_mixin.errors import CheckpointError
from accel_mixin.internals import compiled_inner, copy_state_dict

if TYPE_CHECKING:
    from typing import TypeGuard

# a file as torch.load and skorch's save_params take it: a name or an open file
File = Union[str, "os.PathLike[str]", IO[bytes]]

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SHOWN = 5
_OTHER_MODEL = (
    "The file was saved from another architecture, or with other module "
    "parameters: initialize the net as it was when the file was saved."
)


def strip_wrapper_prefixes(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """Remove the prefixes that DDP, DataParallel and torch.compile add to keys.

    A prefix (``module.``, ``_orig_mod.``, repeated or combined) is removed
    only while every key carries it, so a state dict whose keys differ in
    their prefixes is returned unchanged. The argument is not modified.

    Parameters
    ----------
    state_dict : dict
      A module's state dict.

    Returns
    -------
    state_dict : dict
      The same entries, under keys without the wrapper prefixes.

    Examples
    --------
    >>> from accel_mixin import strip_wrapper_prefixes
    >>> state = torch.load('saved_from_ddp.pt', weights_only=True)
    >>> module.load_state_dict(strip_wrapper_prefixes(state))

    """
    stripped: dict[str, Any] | None = None  # the copy, once a prefix goes
    while state_dict:
        prefix = next(
            (p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state_dict)), None
        )
        if prefix is None:
            break
        if stripped is None:
            state_dict = stripped = copy_state_dict(state_dict)
        consume_prefix_in_state_dict_if_present(stripped, prefix)
    return state_dict


def unwrap_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP, DataParallel and torch.compile wrappers."""
    while True:
        if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            module = module.module
        elif (inner := compiled_inner(module)) is not None:
            module = inner
        else:
            return module


def clean_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    """The state dict of ``module`` under keys without wrapper prefixes."""
    return unwrap_module(module).state_dict()


def _shorten(keys: Iterable[Any]) -> str:
    ordered = sorted(keys)
    shown = ", ".join(repr(k) for k in ordered[:_SHOWN])
    return shown + (f" and {len(ordered) - _SHOWN} more" if len(ordered) > _SHOWN else "")


def _mismatch_message(source: object, name: str, missing: list[str], unexpected: list[str]) -> str:
    lines = [f"{source} does not fit {name}:"]
    if missing:
        lines.append(f"  missing keys ({len(missing)}): {_shorten(missing)}")
    if unexpected:
        lines.append(f"  unexpected keys ({len(unexpected)}): {_shorten(unexpected)}")
    prefix = _extra_prefix(unexpected, missing)
    if prefix:
        lines.append(
            f"  Every key of the file carries the prefix {prefix!r} that the module's keys "
            "lack: it was saved from a module that wrapped this one. Remove the prefix "
            "from the keys (as strip_wrapper_prefixes does for DDP and torch.compile) "
            "and load the result."
        )
    else:
        lines.append("  " + _OTHER_MODEL)
    return "\n".join(lines)


def _extra_prefix(unexpected: list[str], missing: list[str]) -> str | None:
    """A prefix that, taken off the unexpected keys, gives the missing ones."""
    if not unexpected or len(unexpected) != len(missing):
        return None
    first_key = min(unexpected)
    for cut, char in enumerate(first_key):
        prefix = first_key[: cut + 1]
        rest = sorted(k[len(prefix) :] for k in unexpected if k.startswith(prefix))
        if char == "." and rest == sorted(missing):
            return prefix
    return None


def describe_content(value: object) -> str:
    """What ``value`` is, in words, for a message."""
    if isinstance(value, torch.Tensor):
        return f"a single tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is None:
            return f"a dict with the keys {_shorten(list(value))}"
        return f"a dict whose keys are not names (e.g. {bad!r} of type {type(bad).__name__})"
    return "None" if value is None else f"a {type(value).__name__}"


def load_module_state(
    module: torch.nn.Module, state_dict: object, *, source: object, name: str
) -> None:
    """Load ``state_dict`` into ``module`` (wrappers looked through), tolerating
    wrapper prefixes; a ``CheckpointError`` names the file ``source``, the
    attribute ``name``, the keys and both shapes."""
    target = unwrap_module(module)
    if not (isinstance(state_dict, Mapping) and all(isinstance(k, str) for k in state_dict)):
        raise CheckpointError(
            f"{source} is not a state dict for {name}: it holds {describe_content(state_dict)}. "
            "save_params writes what module.state_dict() returns (a dict of tensors under "
            "parameter names); save it with net.save_params(f_params=...) or "
            "torch.save(module.state_dict(), path)."
        )
    state_dict = strip_wrapper_prefixes(state_dict)
    expected = target.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        raise CheckpointError(_mismatch_message(source, name, missing, unexpected))
    for key in expected:  # the module's order, whatever order the state was read in
        shape = getattr(state_dict[key], "shape", None)
        if shape is not None and tuple(shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"{source} does not fit {name}: {key!r} has shape {tuple(shape)} in the "
                f"file but {tuple(expected[key].shape)} in the module. {_OTHER_MODEL}"
            )
    # a sharded module (FSDP2) takes this rank's shard of every full tensor
    target.load_state_dict(shard_like(expected, state_dict))


def _is_path(f: object) -> TypeGuard[str | os.PathLike[str]]:
    return isinstance(f, (str, os.PathLike))


def check_readable(f: File | None) -> None:
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


def read_state(f: File, *, torch_load_kwargs: Mapping[str, Any] | None = None) -> Any:
    """Load a training state to the CPU, with ``weights_only=True`` unless
    skorch's ``torch_load_kwargs`` say otherwise; a bad file raises a
    ``CheckpointError``."""
    check_readable(f)
    kwargs: dict[str, Any] = (
        {"weights_only": True} if torch_load_kwargs is None else dict(torch_load_kwargs)
    )
    kwargs.setdefault("map_location", "cpu")
    try:
        return torch.load(f, **kwargs)
    except Exception as exc:  # pylint: disable=broad-except
        error = read_error(f, exc, weights_only=kwargs.get("weights_only"))
        if error is None:
            raise
        raise error from exc


# how torch words the refusal of a global under weights_only, across releases
_REFUSALS = ("allowed global", "unsupported global", "unsupported class", "blocked")


def read_error(
    f: File, exc: BaseException, *, weights_only: bool | None, use_safetensors: bool = False
) -> CheckpointError | None:
    """The ``CheckpointError`` that says what is wrong with the file ``f`` whose
    reading raised ``exc``; None where the environment failed, not the file."""
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
        # torch's unpickler stops at protocol 4's first frame, before the
        # global of a plain pickle: those it would call are read here
        refused = any(hint in str(exc).lower() for hint in _REFUSALS)
        calls = [] if refused or not weights_only else _plain_pickle_calls(f) or []
        if weights_only and (refused or calls):
            more = f" and {len(calls) - _SHOWN} more" if len(calls) > _SHOWN else ""
            named = f" (it calls {', '.join(calls[:_SHOWN])}{more})" if calls else ""
            return CheckpointError(
                f"Refused to load {f}: it holds objects whose unpickling would run "
                f"code{named}, and files are loaded with weights_only=True. If you trust the "
                "file and its source, pass torch_load_kwargs={'weights_only': False} to the net."
            )
    elif isinstance(exc, (RuntimeError, EOFError, ValueError, zipfile.BadZipFile)):
        return CheckpointError(
            f"{f} is not a complete torch file, it may be truncated or corrupt "
            f"({type(exc).__name__}: {exc}){_safetensors_hint(f)}; load an earlier checkpoint "
            "or save again."
        )
    elif isinstance(exc, (OSError, ImportError, MemoryError)):
        return None  # the environment, not the file
    # garbage makes the unpickler fail in any way (IndexError, KeyError, ...)
    return CheckpointError(
        f"{f} is not a readable torch file (corrupt?{_safetensors_hint(f)}): "
        f"{type(exc).__name__}: {exc}"
    )


# the opcodes that push the name of a module or of a global, for STACK_GLOBAL
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"}
_STORE = {"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"}
_FETCH = {"GET", "BINGET", "LONG_BINGET"}


def _plain_pickle_calls(f: File) -> list[str] | None:
    """The globals (``module.name``) that the pickle ``f``, not a torch zip
    file, imports in order to call them, read without unpickling; None where
    ``f`` is no whole pickle."""
    if not _is_path(f) or zipfile.is_zipfile(f):
        return None
    calls: list[str] = []
    pushed: collections.deque[Any] = collections.deque(maxlen=2)
    memo: dict[Any, Any] = {}
    try:
        with open(f, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            # genops reads through read and readline only, which _Bounded has
            for op, arg, _ in pickletools.genops(_Bounded(file, size)):  # type: ignore[arg-type]
                if op.name in ("GLOBAL", "INST"):
                    # their argument is "module name"
                    calls.append(cast(str, arg).replace(" ", "."))

                elif op.name == "STACK_GLOBAL":
                    names = list(pushed)
                    known = len(names) == 2 and all(isinstance(n, str) for n in names)
                    calls.append(".".join(names) if known else "a global")
                elif op.name in _STORE:
                    memo[len(memo) if arg is None else arg] = pushed[-1] if pushed else None
                elif op.name not in ("PROTO", "FRAME"):
                    strings = op.name in _STRINGS
                    pushed.append(arg if strings else memo.get(arg) if op.name in _FETCH else None)
            whole = file.tell() == size  # garbage that parses rarely ends at its STOP
    except (OSError, ValueError, EOFError):
        return None
    return list(dict.fromkeys(calls)) if whole else None


class _Bounded:
    """A file whose reads stop at its end: the length of an argument in
    garbage may be any number, which ``read`` would allocate first."""

    _LINE = 1 << 16  # the text opcodes' arguments are names and numbers

    def __init__(self, file: IO[bytes], size: int) -> None:
        self._file, self._size = file, size

    def read(self, n: int = -1) -> bytes:
        return self._file.read(min(n, self._size) if n >= 0 else self._size)

    def readline(self) -> bytes:
        return self._file.readline(self._LINE)


def _safetensors_hint(f: File) -> str:
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


def history_error(f: File, exc: BaseException) -> CheckpointError | None:
    """The ``CheckpointError`` for the history file ``f`` whose reading raised
    ``exc``, or None if the file is not to blame."""
    if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError, TypeError)):
        return CheckpointError(
            f"{f} is not a history file that save_params wrote (invalid JSON: {exc})"
        )
    return None
