"""skorch's ``Dataset`` over arrays, with its rows indexed as tensors.

skorch's ``Dataset`` indexes one sample at a time through ``multi_indexing``
and hands NumPy rows to the DataLoader's collation, which converts each row to
a tensor on its own. For the small models skorch users train, those
per-sample conversions were the largest part of the gap to a hand-written
accelerate loop (``scripts/benchmarks/vs_lightning.py``). Viewing the arrays
as tensors once, without a copy, gives the same batches: the same values,
dtypes and shapes, in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import numpy as np
import torch
from skorch.dataset import Dataset

__all__ = ["TensorRows", "tensor_rows"]

# a sample's data viewed as tensors: one, or a mapping of names to them
_Tensors = Union[torch.Tensor, dict[Any, torch.Tensor]]


def _as_tensor(data: Any) -> torch.Tensor | None:
    """``data`` viewed as a tensor, or None where skorch's rows would differ."""
    if isinstance(data, torch.Tensor):
        return data
    # a read-only array would warn where skorch's collation warns later, or
    # not at all; other byte orders, negative strides and object arrays
    # cannot be viewed
    if not isinstance(data, np.ndarray) or not data.flags.writeable:
        return None
    try:
        return torch.from_numpy(data)
    except (TypeError, ValueError, RuntimeError):
        return None


def _as_tensors(data: Any) -> _Tensors | None:
    """``data`` (an array, a tensor or a mapping of them) as tensors, or None."""
    if isinstance(data, Mapping):
        tensors = {key: _as_tensor(value) for key, value in data.items()}
        viewed = {key: value for key, value in tensors.items() if value is not None}
        return None if len(viewed) < len(tensors) else viewed
    return _as_tensor(data)


def _row(tensors: _Tensors, i: Any) -> _Tensors:
    if isinstance(tensors, dict):
        return {key: value[i] for key, value in tensors.items()}
    return tensors[i]


def _rows(tensors: _Tensors, index: torch.Tensor) -> list[_Tensors]:
    """The rows at ``index``, each as ``_row`` gives it, from one gather."""
    if isinstance(tensors, dict):
        columns = {key: value[index].unbind(0) for key, value in tensors.items()}
        return [dict(zip(columns, row)) for row in zip(*columns.values())]
    return list(tensors[index].unbind(0))


class TensorRows(Dataset):
    """skorch's ``Dataset``, whose rows are indexed from tensor views.

    Built by :func:`tensor_rows` only where every row equals skorch's own.
    The views are rebuilt after unpickling (DataLoader workers started by
    ``spawn``), so they never travel through shared memory.
    """

    def __init__(self, X: Any, y: Any = None, length: int | None = None) -> None:
        super().__init__(X, y=y, length=length)
        self._view()

    def _view(self) -> None:
        self._X_rows = _as_tensors(self.X)
        self._y_rows = None if self.y is None else _as_tensors(self.y)

    def __getitem__(self, i: Any) -> tuple[_Tensors, _Tensors]:
        # skorch's placeholder for a missing ``y``
        # tensor_rows uses only a TensorRows whose data all viewed
        assert self._X_rows is not None and (self.y is None or self._y_rows is not None)
        yi = torch.Tensor([0]) if self._y_rows is None else _row(self._y_rows, i)
        return _row(self._X_rows, i), yi

    def __getitems__(self, indices: list[int]) -> list[tuple[_Tensors, _Tensors]]:
        """A batch's samples, as ``__getitem__`` gives them one by one: the
        DataLoader's fetcher asks for them together, and one gather per batch
        costs less than an indexing per sample."""
        assert self._X_rows is not None and (self.y is None or self._y_rows is not None)
        index = torch.as_tensor(indices, dtype=torch.int64)
        X_rows = _rows(self._X_rows, index)
        if self._y_rows is None:
            return [(X_row, torch.Tensor([0])) for X_row in X_rows]
        return list(zip(X_rows, _rows(self._y_rows, index)))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_X_rows"], state["_y_rows"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._view()


def tensor_rows(dataset: Dataset) -> Dataset:
    """``dataset``, or a :class:`TensorRows` over the same data that gives the
    same batches.

    Only a dataset of skorch's own ``Dataset`` class (not a subclass, which may
    override ``transform``) over tensors, writable NumPy arrays or mappings of
    them is replaced.

    Parameters
    ----------
    dataset : torch.utils.data.Dataset
      What ``get_dataset`` returned.

    Returns
    -------
    dataset : torch.utils.data.Dataset
      ``dataset`` itself, or the replacement.
    """
    if type(dataset) is not Dataset:  # pylint: disable=unidiomatic-typecheck
        return dataset
    rows = TensorRows(dataset.X, dataset.y, length=len(dataset))
    # pylint: disable-next=protected-access
    viewed = rows._X_rows is not None and (rows.y is None or rows._y_rows is not None)
    return rows if viewed else dataset
