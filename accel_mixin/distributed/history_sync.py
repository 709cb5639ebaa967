"""One history on every rank.

With even batches, accelerate pads an epoch's last batches with samples from
its start; the net records each batch's loss and number of real samples and
shows callbacks only the real ones. At an epoch's end the ranks exchange
their batch records, once, in dataset order (the scoring callbacks'
predictions go to the main process alone: ``epoch_scores``): epoch scores
are those of one process on the whole data, and rank 0's row is every
rank's. A skorch ``DistributedHistory`` is not needed:
the net records into the plain ``History`` inside it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply
from skorch.history import DistributedHistory

from accel_mixin.distributed.control import failure_message
from accel_mixin.errors import DistributedError
from accel_mixin.internals import wrapped_history

if TYPE_CHECKING:
    from skorch import NeuralNet

    from accel_mixin.distributed.object_gather import Gather

__all__ = [
    "NOTICE",
    "adopt_history",
    "agree_on_row",
    "interleave",
    "leading_samples",
    "merge_epoch",
    "pad_to_largest",
]

T = TypeVar("T")

NOTICE = (
    "accel_mixin shares the history across processes itself: the net records into "
    "the plain History inside its DistributedHistory, whose store is not needed "
    "(history=DistributedHistory(...) and its TCPStore can go)"
)


def adopt_history(net: NeuralNet) -> None:
    """Record into the plain ``History`` inside a ``DistributedHistory``: its
    store would record every batch twice; the main process says so once."""
    history = net.history_
    if not isinstance(history, DistributedHistory):
        return
    net.history_ = wrapped_history(history)
    if net.accelerator.is_main_process:
        warnings.warn(NOTICE, UserWarning, stacklevel=2)


def leading_samples(data: Any, n: int) -> Any:
    """The first ``n`` samples of a batch or a model output (nested tensors);
    a 0-d tensor (a scalar a module returns besides) stays as it is."""
    return recursively_apply(lambda tensor: tensor[:n] if tensor.dim() else tensor, data)


def _padded_ones(data: Any, in_mapping: bool = False) -> list[torch.Tensor]:
    """The tensors of ``data`` that ``pad_to_largest`` pads, in order."""
    if isinstance(data, torch.Tensor):
        return [data] if in_mapping or data.dim() >= 3 else []
    if isinstance(data, Mapping):
        return [t for value in data.values() for t in _padded_ones(value, True)]
    if isinstance(data, (list, tuple)):
        return [t for value in data for t in _padded_ones(value, in_mapping)]
    return []


def pad_to_largest(data: Any) -> Any:
    """Pad the tensors of a model output past their first dimension to the
    largest size any rank has there, with zeros at the end, so that the rows
    of all ranks can be gathered: ranks that cut their batches to their own
    longest sequence give outputs of other lengths. The tensors of a mapping
    (a ``ModelOutput``) and tensors of 3 or more dimensions take part, at one
    small collective per batch; tensors of 1 or 2 dimensions otherwise, as
    tabular models return, are gathered as they are."""
    padded = _padded_ones(data)
    if not padded:
        return data
    sizes = torch.tensor([size for t in padded for size in t.shape[1:]], device=padded[0].device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    largest: Iterator[int] = iter(sizes.tolist())
    wanted: dict[int, list[int]] = {}
    for tensor in padded:
        wanted[id(tensor)] = [next(largest) for _ in tensor.shape[1:]]

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in wanted:
            return tensor
        padding = []  # torch's order: from the last dimension on
        for size, want in zip(reversed(tensor.shape[1:]), reversed(wanted[id(tensor)])):
            padding += [0, want - size]
        return torch.nn.functional.pad(tensor, padding) if any(padding) else tensor

    return recursively_apply(pad, data)


def interleave(per_rank: Sequence[Sequence[T]]) -> list[T]:
    """Merge per-rank lists step by step (rank ``r`` takes batches ``r, r + N,
    ...``), restoring dataset order; lists may be one item short."""
    longest = max((len(items) for items in per_rank), default=0)
    return [items[i] for i in range(longest) for items in per_rank if i < len(items)]


def _padding_only(batch: dict[str, Any]) -> bool:
    # the scan for a 0 runs in C: an epoch may have hundreds of thousands of batches
    return 0 in batch.values() and any(
        key.endswith("_batch_size") and size == 0 for key, size in batch.items()
    )


def merge_epoch(net: NeuralNet, gather: Gather) -> None:
    """Give every rank the batch records of all ranks, in dataset order, in
    one ``gather``; batches of padding only are dropped."""
    row = net.history[-1]
    batches = row.get("batches", [])
    payload = {
        "batches": batches,
        "counts": {k: v for k, v in row.items() if k.endswith("_batch_count")},
    }
    payloads = gather("history merge", payload)
    # padding-only batches are the last of their rank: dropped after
    # interleaving, the dataset order stays
    row["batches"] = [
        batch for batch in interleave([p["batches"] for p in payloads]) if not _padding_only(batch)
    ]
    for key in payload["counts"]:
        row[key] = sum(p["counts"][key] for p in payloads)


def agree_on_row(
    net: NeuralNet,
    gather: Gather,
    stop: bool,
    error: BaseException | None = None,
    fingerprints: list[int] | None = None,
) -> tuple[bool, str | None, list[list[int] | None]]:
    """Take rank 0's epoch row everywhere (``dur`` differs); return whether any
    rank stopped, the first rank's failure, named, or None, and every rank's
    ``fingerprints`` (a replica check's, which rides on this collective).

    One ``gather``, which every rank joins even after an error in its callbacks.
    """
    accelerator = net.accelerator
    row = net.history[-1]
    mine = {k: v for k, v in row.items() if k != "batches"} if accelerator.is_main_process else None
    message = None
    if isinstance(error, DistributedError):
        message = str(error)
    elif error is not None:
        message = failure_message("on_epoch_end", accelerator.process_index, error)
    answers = gather("epoch row", (mine, bool(stop), message, fingerprints))
    row.update(answers[0][0])
    failures = [message for _, _, message, _ in answers if message]
    return (
        any(stop for _, stop, _, _ in answers),
        failures[0] if failures else None,
        [prints for *_, prints in answers],
    )
