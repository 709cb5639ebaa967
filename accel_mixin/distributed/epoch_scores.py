"""Epoch scores from cached predictions, computed once, on the main process.

A caching ``EpochScoring`` keeps the predictions of the batches its rank
ran. At an epoch's end the other ranks stream them to the main process
alone, as the bytes of their tensors (point to point, a megabyte at a
time), not as pickles of lists; the main process scores them in dataset
order, as one process would on the whole data, and sends the scores (or a
scorer's error) to the others. Every rank then records them at each
callback's turn, in the notification of the epoch's end (``notify_scored``),
without scoring: nothing is replaced on the callbacks or on their class.
So the main process holds one copy of the predictions, the others their
own part only.

A callback that needs the whole predictions on every rank says so with
``predictions_on_every_rank = True``: every rank then receives a gathered
copy (and pays its memory) and scores itself, at the callback's turn. An
``EpochScoring`` subclass that overrides ``on_epoch_end`` or ``_scoring`` is
treated so, since it may read the predictions its own way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply
from skorch.callbacks import EpochScoring

from accel_mixin.distributed.control import failure_message
from accel_mixin.distributed.history_sync import interleave
from accel_mixin.errors import DistributedError
from accel_mixin.internals import cached_forward_iter, record_score, score_of

if TYPE_CHECKING:
    from accelerate import Accelerator
    from skorch import NeuralNet
    from skorch.callbacks import Callback
    from torch.utils.data import Dataset

    # per scorer's name: (score, None) or (None, error)
    Outcomes = dict[str, tuple[Any, BaseException | None]]

__all__ = ["everywhere", "notify_scored", "score_on_main", "share_predictions"]

_ALIGN = 16  # every tensor starts at an offset that any dtype can view
_CHUNK = 1 << 20  # bytes a rank stages at a time to send


def _caching(net: NeuralNet, cb: Callback) -> bool:
    """Whether ``cb`` is an ``EpochScoring`` that scores cached predictions."""
    if not isinstance(cb, EpochScoring):
        return False
    return cb.use_caching if net.use_caching == "auto" else bool(net.use_caching)


def everywhere(cb: Callback) -> bool:
    """Whether ``cb`` gets the whole predictions on every rank and scores there."""
    explicit = getattr(cb, "predictions_on_every_rank", None)
    if explicit is not None:
        return bool(explicit)
    return any(
        getattr(type(cb), m) is not getattr(EpochScoring, m) for m in ("on_epoch_end", "_scoring")
    )


class _Slot:
    """A tensor's place in a message: its dtype, shape and first byte."""

    __slots__ = ("dtype", "shape", "start")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], start: int) -> None:
        self.dtype, self.shape, self.start = dtype, shape, start

    def __reduce__(self) -> tuple[type[_Slot], tuple[torch.dtype, tuple[int, ...], int]]:
        return _Slot, (self.dtype, self.shape, self.start)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layout(items: Any) -> tuple[Any, list[tuple[torch.Tensor, _Slot]], int]:
    """``items`` with their tensors replaced by slots, the ``(tensor, slot)``
    pairs in order, and the bytes the tensors take together."""
    pairs: list[tuple[torch.Tensor, _Slot]]
    pairs, end = [], 0

    def slot(tensor: torch.Tensor) -> _Slot:
        nonlocal end
        placed = _Slot(tensor.dtype, tuple(tensor.shape), end)
        pairs.append((tensor.detach(), placed))
        end += _aligned(placed.nbytes)
        return placed

    return recursively_apply(slot, items), pairs, end


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _is_slot(x: object) -> bool:
    return isinstance(x, _Slot)


def _filled(layout: Any, data: torch.Tensor) -> Any:
    """The items of ``layout``, their tensors viewing the bytes of ``data``."""

    def view(placed: _Slot) -> torch.Tensor:
        data_of = data[placed.start : placed.start + placed.nbytes]
        return data_of.view(placed.dtype).view(placed.shape)

    return recursively_apply(view, layout, test_type=_is_slot)


def _slots(layout: Any) -> list[_Slot]:
    """The slots of ``layout``, in order."""
    slots: list[_Slot] = []
    recursively_apply(slots.append, layout, test_type=_is_slot)
    return slots


def _runs(slots: Sequence[_Slot]) -> list[list[Any]]:
    """What travels as one message: neighbouring slots up to ``_CHUNK``
    bytes together, a larger one alone; ``(first byte, stop, indices)``."""
    runs: list[list[Any]] = []  # [first byte, stop, indices]
    for index, placed in enumerate(slots):
        stop = placed.start + placed.nbytes
        if runs and stop - runs[-1][0] <= _CHUNK:
            runs[-1][1], runs[-1][2] = stop, runs[-1][2] + [index]
        else:
            runs.append([placed.start, stop, [index]])
    return runs


def _send(items: Any, device: torch.device, dsts: Sequence[int]) -> None:
    """Stream ``items`` to the ranks ``dsts``: the layout, then the tensors'
    bytes, staged ``_CHUNK`` bytes at a time, so that the rank never holds a
    second copy of its predictions."""
    layout, pairs, end = _layout(items)
    for dst in dsts:
        dist.send_object_list([layout, end], dst=dst, device=device)

    def send(message: torch.Tensor) -> None:
        for dst in dsts:
            dist.send(message, dst=dst)

    staging: torch.Tensor | None = None
    for first, stop, indices in _runs([placed for _, placed in pairs]):
        if len(indices) == 1:
            send(_bytes(pairs[indices[0]][0]).to(device))
            continue
        if staging is None:
            staging = torch.empty(_CHUNK, dtype=torch.uint8, device=device)
        for tensor, placed in (pairs[i] for i in indices):
            at = placed.start - first
            staging[at : at + placed.nbytes].copy_(_bytes(tensor))
        send(staging[: stop - first])


def _receive(rank: int, device: torch.device) -> Any:
    """What ``_send`` streamed from ``rank``, viewing one buffer of its bytes."""
    received: list[Any] = [None, None]
    dist.recv_object_list(received, src=rank, device=device)
    layout, end = received
    data = torch.empty(end, dtype=torch.uint8, device=device)
    for first, stop, _ in _runs(_slots(layout)):
        dist.recv(data[first:stop], src=rank)
    return _filled(layout, data)


def _wire(accelerator: Accelerator) -> torch.device:
    """Where messages travel from: the GPU under NCCL, else the CPU."""
    return accelerator.device if dist.get_backend() == "nccl" else torch.device("cpu")


def _to_main(items: Any, accelerator: Accelerator) -> list[Any] | None:
    """Every rank's ``items``, in rank order, on the main process (its own as
    they are); None on the others."""
    device = _wire(accelerator)
    if not accelerator.is_main_process:
        _send(items, device, [0])
        return None
    return [items] + [_receive(rank, device) for rank in range(1, accelerator.num_processes)]


def _to_all(items: Any, accelerator: Accelerator) -> list[Any]:
    """Every rank's ``items``, in rank order, on every rank (its own as they
    are): each rank in turn streams its own to all the others."""
    device, me, world = _wire(accelerator), accelerator.process_index, accelerator.num_processes
    everyone: list[Any] = []
    for rank in range(world):
        if rank == me:
            _send(items, device, [other for other in range(world) if other != me])
            everyone.append(items)
        else:
            everyone.append(_receive(rank, device))
    return everyone


def _kept(cb: Callback, batches: Sequence[Mapping[str, Any]]) -> tuple[list[Any], ...]:
    """The cached predictions and targets of ``cb``, without those of the
    batches that held padding only (the last of a rank)."""
    key = ("train" if cb.on_train else "valid") + "_batch_size"
    real = [batch[key] > 0 for batch in batches if key in batch]
    return tuple(
        [item for item, keep in zip(cached, real) if keep] for cached in (cb.y_preds_, cb.y_trues_)
    )


def share_predictions(
    net: NeuralNet,
    dataset_train: Dataset | None = None,
    dataset_valid: Dataset | None = None,
    **_: Any,
) -> list[str]:
    """Send the caching scorers' predictions where they are scored; return
    the names of those the main process scores for every rank.

    Call it with the rank's own batch records, before they are merged.
    Scorers without data (``valid_acc`` without a validation set) send
    nothing: skorch's ``EpochScoring`` records nothing then.
    """
    accelerator = net.accelerator
    batches = net.history[-1].get("batches", [])
    scorers = [
        (name, cb)
        for name, cb in net.callbacks_
        if _caching(net, cb) and (dataset_train if cb.on_train else dataset_valid) is not None
    ]
    on_main = [(name, cb) for name, cb in scorers if not everywhere(cb)]
    spread = [(name, cb) for name, cb in scorers if everywhere(cb)]
    for group, exchange in ((on_main, _to_main), (spread, _to_all)):
        if not group:
            continue
        everyone = exchange([_kept(cb, batches) for _, cb in group], accelerator)
        if everyone is None:  # a rank that sent to the main process keeps its own
            continue
        for index, (_, cb) in enumerate(group):
            cb.y_preds_ = interleave([rank[index][0] for rank in everyone])
            cb.y_trues_ = interleave([rank[index][1] for rank in everyone])
    return [name for name, _ in on_main]


def _score(
    net: NeuralNet, cb: Callback, dataset_train: Dataset | None, dataset_valid: Dataset | None
) -> Any:
    """What ``EpochScoring.on_epoch_end`` computes before recording it."""
    use_caching = _caching(net, cb)
    X_test, y_test, y_pred = cb.get_test_data(dataset_train, dataset_valid, use_caching=use_caching)
    if X_test is None:  # on every rank: its on_epoch_end records nothing
        return None
    with cached_forward_iter(net, cb.use_caching, y_pred) as cached_net:
        return score_of(cb, cached_net, X_test, y_test)


def score_on_main(
    net: NeuralNet,
    names: Sequence[str],
    dataset_train: Dataset | None = None,
    dataset_valid: Dataset | None = None,
    **_: Any,
) -> Outcomes:
    """The scores of the callbacks ``names``, computed on the main process and
    sent to all: per name, ``(score, None)`` or ``(None, error)``; the error is
    the exception on the main process and its message on the others."""
    accelerator = net.accelerator
    outcomes: Outcomes = {}
    if not names:
        return outcomes
    if accelerator.is_main_process:
        callbacks = dict(net.callbacks_)
        for name in names:
            try:
                outcomes[name] = (_score(net, callbacks[name], dataset_train, dataset_valid), None)
            except Exception as exc:  # pylint: disable=broad-except
                outcomes[name] = (None, exc)
    # per name (score, its error's message or None); rank 0's on every rank, unpickled
    sent: list[dict[str, tuple[Any, Any]]] = [
        {
            name: (score, failure_message("on_epoch_end", 0, error) if error else None)
            for name, (score, error) in outcomes.items()
        }
    ]
    dist.broadcast_object_list(sent, src=0)
    if accelerator.is_main_process:
        return outcomes
    return {
        name: (score, error and DistributedError(error)) for name, (score, error) in sent[0].items()
    }


def notify_scored(net: NeuralNet, outcomes: Outcomes, **cb_kwargs: Any) -> None:
    """Notify the net and its callbacks of the epoch's end, as skorch's
    ``notify("on_epoch_end")`` does, except that each callback named in
    ``outcomes`` records the main process's score at its turn (or raises its
    error) instead of scoring.

    The score travels in this call alone: a net pickled meanwhile
    (``Checkpoint``'s ``f_pickle``) holds its callbacks as they are, and
    ``EpochScoring`` is left alone.
    """
    net.on_epoch_end(net, **cb_kwargs)
    for name, cb in net.callbacks_:
        if name not in outcomes:
            cb.on_epoch_end(net, **cb_kwargs)
            continue
        score, error = outcomes[name]
        if error is not None:
            raise error
        if score is not None:  # None: no data, and skorch records nothing
            record_score(cb, net.history, score)
