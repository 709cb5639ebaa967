"""Each rank's share of the last global batch, so that N processes train as one.

With even batches accelerate pads an epoch's last global batch with samples
from the epoch's start, so that every rank takes the step. One process with
N times the batch trains that step on the mean loss over the real samples
only. Each rank therefore trains on its real samples alone, with the
gradient of its mean loss weighted by its share of them: ``real * N /
remainder``. DDP averages the gradients over the N ranks, which gives the
gradient of the mean over all real samples. A rank holding padding alone
still runs its batch, so that DDP stays in step, with weight 0.

This holds where the loss is a mean over the batch's samples, which a
criterion says with ``reduction="mean"`` (torch's default); other losses
train on the padded batch as before, with one warning.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.data_loader import IterableDatasetShard
from skorch.dataset import get_len

if TYPE_CHECKING:
    from accelerate.state import GradientState
    from skorch import NeuralNet

__all__ = [
    "counts_as_batch",
    "criterion_is_mean",
    "data_batch_size",
    "loss_weight",
    "real_samples",
    "samples_in",
    "scale_gradient",
    "warn_padding_trains",
]

_WARNED: set[tuple[type, type]] = set()


def _partial_remainder(gradient_state: GradientState, num_processes: int) -> int | None:
    """The real samples of an epoch's last global batch where accelerate
    padded it, else None: ``remainder`` is -1 with ``drop_last``, 0 where the
    data divides."""
    # end_of_dataloader first: it holds in an epoch's last batch only, and
    # each of GradientState's properties walks its dataloader references
    if num_processes == 1 or not gradient_state.end_of_dataloader:
        return None
    remainder = gradient_state.remainder
    return remainder if remainder and remainder > 0 else None


def real_samples(
    gradient_state: GradientState, num_processes: int, process_index: int, batch_size: int
) -> int:
    """How many samples of this rank's current batch are real rather than
    padding: the gathered last batches hold the real samples first."""
    remainder = _partial_remainder(gradient_state, num_processes)
    if remainder is None:
        return batch_size
    return min(max(remainder - process_index * batch_size, 0), batch_size)


def samples_in(batch: Any) -> int:
    """The samples of a batch: those of its first part, for a tuple or list."""
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    # a tensor's or an array's length is len(); skorch's get_len walks any data
    return len(first) if isinstance(first, (torch.Tensor, np.ndarray)) else get_len(first)


def data_batch_size(dataloader: Any) -> int | None:
    """The batch size of the data, before accelerate shared its batches among
    the ranks (a prepared ``dataloader``'s), or None where none is known."""
    sampler = getattr(dataloader, "batch_sampler", None)
    dataset = getattr(dataloader, "dataset", None)
    sources = (
        getattr(sampler, "batch_sampler", None),  # BatchSamplerShard's
        dataset if isinstance(dataset, IterableDatasetShard) else None,
        dataloader,  # DataLoaderDispatcher: a stream's
        sampler,  # DataLoaderDispatcher: a Dataset's
    )
    for source in sources:
        size = getattr(source, "batch_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return None


def counts_as_batch(
    gradient_state: GradientState,
    num_processes: int,
    process_index: int,
    sizes: tuple[int, int],
    data_batch: int | None,
) -> bool:
    """Whether this rank's batch (``sizes``: its samples, and how many are
    real) counts as one of the data's batches in the history, so that N
    processes count what one does: the step's ``G`` real samples hold
    ``ceil(G / data_batch)`` batches of the data, which the first ranks count.
    accelerate splits a batch of the data among the ranks with
    ``split_batches``, and a last one when it dispatches a stream."""
    size, real = sizes
    if not real or data_batch is None:
        return bool(real)
    remainder = _partial_remainder(gradient_state, num_processes)
    step = num_processes * size if remainder is None else remainder
    return process_index * data_batch < step


def loss_weight(gradient_state: GradientState, num_processes: int, real: int) -> float:
    """The weight of this rank's mean loss in the current step: 1 except in an
    epoch's last global batch when it is partial."""
    remainder = _partial_remainder(gradient_state, num_processes)
    return 1.0 if remainder is None else real * num_processes / remainder


class _ScaleGradient(torch.autograd.Function):
    """The identity, whose gradient is multiplied by ``weight``: the loss's
    value, recorded in the history, stays the mean of its real samples."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, weight: float) -> torch.Tensor:  # pylint: disable=arguments-differ
        ctx.weight = weight
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # pylint: disable=arguments-differ
        return grad * ctx.weight, None


def scale_gradient(loss: Any, weight: float) -> Any:
    """``loss``, whose gradient is ``weight`` times its own."""
    if weight == 1 or not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return loss
    return _ScaleGradient.apply(loss, weight)


def criterion_is_mean(criterion: object) -> bool:
    """Whether ``criterion`` (a DDP wrapper's module counts) averages over samples."""
    criterion = getattr(criterion, "module", criterion)
    return getattr(criterion, "reduction", None) == "mean"


def warn_padding_trains(net: NeuralNet, criterion: object) -> None:
    """Once per net class and criterion, on the main process: this loss is not
    known to be a mean, so the padded samples of the last batch train."""
    key = (type(net), type(criterion))
    if key in _WARNED or not net.accelerator.is_main_process:
        return
    _WARNED.add(key)
    warnings.warn(
        f"The criterion {type(criterion).__name__} has reduction="
        f"{getattr(criterion, 'reduction', None)!r}: accel_mixin cannot weight its loss "
        "by each rank's share of the real samples, so the samples accelerate repeats to "
        "fill the last batch of the epoch train, and N processes do not train exactly as "
        "one. Use a criterion with reduction='mean', or batches that divide the data "
        "(iterator_train__drop_last=True).",
        UserWarning,
        stacklevel=2,
    )
