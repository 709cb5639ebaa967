"""State dicts that load whatever wrapper wrote them, with errors that say why.

DDP and DataParallel save keys under ``module.``, ``torch.compile`` under
``_orig_mod.``, and wrappers nest. A prefix is removed only when every key
carries it, as super-gradients does: a partial prefix means a different
model, and is reported rather than guessed at.
"""

from collections.abc import Mapping

import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from accel_mixin.errors import CheckpointError
from accel_mixin.internals import compiled_inner, copy_state_dict

__all__ = [
    "CheckpointError",
    "clean_state_dict",
    "load_module_state",
    "strip_wrapper_prefixes",
    "unwrap_module",
]

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SHOWN = 5
_OTHER_MODEL = (
    "The file was saved from another architecture, or with other module "
    "parameters: initialize the net as it was when the file was saved."
)


def strip_wrapper_prefixes(state_dict):
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
    copied = False
    while state_dict:
        prefix = next(
            (p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state_dict)), None
        )
        if prefix is None:
            break
        if not copied:
            state_dict = copy_state_dict(state_dict)
            copied = True
        consume_prefix_in_state_dict_if_present(state_dict, prefix)
    return state_dict


def unwrap_module(module):
    """The module inside DDP, DataParallel and torch.compile wrappers."""
    while True:
        if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            module = module.module
        elif compiled_inner(module) is not None:
            module = compiled_inner(module)
        else:
            return module


def clean_state_dict(module):
    """The state dict of ``module`` under keys without wrapper prefixes."""
    return unwrap_module(module).state_dict()


def _shorten(keys):
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _mismatch_message(source, name, missing, unexpected):
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


def _extra_prefix(unexpected, missing):
    """A prefix that, taken off the unexpected keys, gives the missing ones."""
    if not unexpected or len(unexpected) != len(missing):
        return None
    first_key = sorted(unexpected)[0]
    for cut in range(len(first_key)):
        if first_key[cut] == ".":
            prefix = first_key[: cut + 1]
            if sorted(k[len(prefix) :] for k in unexpected if k.startswith(prefix)) == sorted(
                missing
            ):
                return prefix
    return None


def describe_content(value):
    """What ``value`` is, in words, for a message."""
    if isinstance(value, torch.Tensor):
        return f"a single tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is None:
            return f"a dict with the keys {_shorten(list(value))}"
        return f"a dict whose keys are not names (e.g. {bad!r} of type {type(bad).__name__})"
    if value is None:
        return "None"
    return f"a {type(value).__name__}"


def check_is_state_dict(state, *, source, name):
    """Raise a ``CheckpointError`` that says what the file ``source`` holds
    instead, unless ``state`` is a dict of tensors under names."""
    if isinstance(state, Mapping) and all(isinstance(k, str) for k in state):
        return
    raise CheckpointError(
        f"{source} is not a state dict for {name}: it holds {describe_content(state)}. save_params "
        f"writes what module.state_dict() returns (a dict of tensors under parameter "
        "names); save it with net.save_params(f_params=...) or "
        "torch.save(module.state_dict(), path)."
    )


def load_module_state(module, state_dict, *, source, name):
    """Load ``state_dict`` into ``module``, tolerating wrapper prefixes.

    Parameters
    ----------
    module : torch.nn.Module
      The target; wrappers around it are looked through.

    state_dict : dict
      What the file holds.

    source : str
      The file, for error messages.

    name : str
      The net's attribute, e.g. ``'module_'``, for error messages.

    Raises
    ------
    CheckpointError
      If keys are missing or unexpected, or a shape differs; the message
      names the file, the keys and both shapes.

    """
    target = unwrap_module(module)
    check_is_state_dict(state_dict, source=source, name=name)
    state_dict = strip_wrapper_prefixes(state_dict)
    expected = target.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        raise CheckpointError(_mismatch_message(source, name, missing, unexpected))
    for key, value in state_dict.items():
        shape = getattr(value, "shape", None)
        if shape is not None and tuple(shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"{source} does not fit {name}: {key!r} has shape {tuple(shape)} in the "
                f"file but {tuple(expected[key].shape)} in the module. {_OTHER_MODEL}"
            )
    target.load_state_dict(state_dict)
