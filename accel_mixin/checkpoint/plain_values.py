"""The pieces of a training state that are not weights (the history, the
schedulers' and callbacks' values) as tensors and plain Python values, so
that a training state loads with ``weights_only=True``; CPU snapshots of a
state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

_PLAIN_SCALARS = (bool, int, float, str, type(None))


class _NotPlain(Exception):
    pass


def as_plain(value: Any, arrays: bool = True) -> Any:
    """``value`` as tensors and plain Python values (NumPy values converted),
    or raise _NotPlain; with ``arrays=False`` tensors and arrays raise too."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and not arrays:
        raise _NotPlain(type(value).__name__)
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.generic):  # before the scalars: np.float64 is a float
        return value.item()
    if isinstance(value, _PLAIN_SCALARS):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, (list, tuple)):
        return type(value)(as_plain(item, arrays) for item in value)
    if isinstance(value, dict):
        return {as_plain(key, arrays): as_plain(item, arrays) for key, item in value.items()}
    raise _NotPlain(type(value).__name__)


NOT_PLAIN = object()


def plain_or_not(value: Any) -> Any:
    """``as_plain(value)``, or ``NOT_PLAIN`` where it is not plain data."""
    try:
        return as_plain(value)
    except _NotPlain:
        return NOT_PLAIN


def history_state(rows: Iterable[dict[str, Any]]) -> list[Any]:
    """The history's rows as plain values; tensors and arrays are refused,
    which a resumed history would not give back as they were."""
    try:
        return as_plain(list(rows), arrays=False)
    except _NotPlain as exc:
        raise TypeError(
            f"The history holds a {exc}, which a training state cannot keep: "
            "record numbers, strings, or lists, tuples and dicts of them."
        ) from None


def cpu_snapshot(state: Any, reuse: Any = None) -> Any:
    """A copy of ``state`` whose tensors live on the CPU and share nothing
    with training; tensors are copied into those of ``reuse`` (an earlier
    snapshot) where they match, faster than allocating memory anew."""
    if isinstance(state, torch.Tensor):
        tensor = state.detach()
        if (
            isinstance(reuse, torch.Tensor)
            and reuse.shape == tensor.shape
            and reuse.dtype == tensor.dtype
            and reuse.device.type == "cpu"
        ):
            return reuse.copy_(tensor)
        return tensor.to("cpu", copy=True)
    if isinstance(state, dict):
        reuse = reuse if isinstance(reuse, dict) else {}
        return {key: cpu_snapshot(value, reuse.get(key)) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        if not (isinstance(reuse, (list, tuple)) and len(reuse) == len(state)):
            reuse = [None] * len(state)
        return type(state)(cpu_snapshot(item, old) for item, old in zip(state, reuse))
    return state
