"""One history on every rank.

With even batches, accelerate pads the last batches of an epoch with samples
from its start, so that every rank takes the same number of steps. The net
records, for every batch, the loss and the number of real samples, and shows
callbacks only the real ones. At the end of an epoch the ranks exchange their
batch records and the predictions that scoring callbacks cached, once, and
every rank then holds the records and caches of the whole epoch, in dataset
order. Epoch scores computed from them are the scores of one process on the
whole data; rank 0's row is then taken as the row of every rank.

A skorch ``DistributedHistory`` is therefore not needed: a net given one
records into its plain ``History`` instead (``adopt_history``).
"""

import warnings

import numpy as np
import torch
from accelerate.utils import gather_object, recursively_apply
from skorch.callbacks import EpochScoring
from skorch.history import DistributedHistory

from accel_mixin.distributed.coordination import failure_message
from accel_mixin.errors import DistributedError
from accel_mixin.internals import wrapped_history

__all__ = [
    "NOTICE",
    "adopt_history",
    "agree_on_row",
    "interleave",
    "leading_samples",
    "merge_epoch",
    "real_samples",
]


NOTICE = (
    "accel_mixin shares the history across processes itself: the net records into "
    "the plain History inside its DistributedHistory, whose store is not needed "
    "(history=DistributedHistory(...) and its TCPStore can go)"
)


def adopt_history(net):
    """Record into the plain ``History`` inside a ``DistributedHistory``.

    skorch's ``DistributedHistory`` writes every batch record to a store and
    reads every rank's back; the net shares its records itself, so through
    the store every batch would be recorded twice. The net takes the
    ``History`` the ``DistributedHistory`` wraps: its rows are those of a
    net given a plain ``History``, the user's ``DistributedHistory`` shows
    them too (nothing waits in its queue), and the store is never touched,
    so it stays the user's. The main process says so once, in one line.
    """
    history = net.history_
    if not isinstance(history, DistributedHistory):
        return
    net.history_ = wrapped_history(history)
    if net.accelerator.is_main_process:
        warnings.warn(NOTICE, UserWarning, stacklevel=2)


def real_samples(gradient_state, num_processes, process_index, batch_size):
    """How many samples of the current batch are real rather than padding.

    The padding that even batches add sits at the end of the last step: the
    gathered last batches of all ranks hold ``remainder`` real samples first,
    as ``gather_for_metrics`` assumes.

    """
    if num_processes == 1 or not gradient_state.end_of_dataloader:
        return batch_size
    remainder = gradient_state.remainder
    if remainder is None or remainder <= 0:
        return batch_size
    return min(max(remainder - process_index * batch_size, 0), batch_size)


def leading_samples(data, n):
    """The first ``n`` samples of a batch or a model output (nested tensors)."""
    return recursively_apply(lambda tensor: tensor[:n], data)


def _portable(tensor):
    # numpy arrays pickle several times faster than tensors
    tensor = tensor.detach().cpu()
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor
    return tensor.numpy()


def _to_numpy(data):
    return recursively_apply(_portable, data)


def _to_tensor(data):
    if isinstance(data, np.ndarray):
        return torch.from_numpy(data)
    if isinstance(data, (list, tuple)):
        return type(data)(_to_tensor(item) for item in data)
    if isinstance(data, dict):
        return {key: _to_tensor(value) for key, value in data.items()}
    return data


def interleave(per_rank):
    """Merge per-rank lists step by step: rank 0's first item, rank 1's, ...

    Rank ``r`` takes batches ``r, r + N, ...`` of the dataset, so this
    restores dataset order; lists may be one item short at the end.

    """
    longest = max((len(items) for items in per_rank), default=0)
    return [items[i] for i in range(longest) for items in per_rank if i < len(items)]


def _cached_scorers(net):
    """EpochScoring callbacks whose on_epoch_end uses the cached predictions."""
    for name, cb in net.callbacks_:
        if not isinstance(cb, EpochScoring):
            continue
        use_caching = cb.use_caching if net.use_caching == "auto" else net.use_caching
        if use_caching and cb.use_caching:
            yield name, cb


def _local_caches(net, batches):
    caches = {}
    for name, cb in _cached_scorers(net):
        key = ("train" if cb.on_train else "valid") + "_batch_size"
        sizes = [batch[key] for batch in batches if key in batch]
        # batches with no real sample were cached whole; drop them
        keep = [i for i, size in enumerate(sizes) if size > 0]
        preds = [_to_numpy(cb.y_preds_[i]) for i in keep if i < len(cb.y_preds_)]
        trues = [_to_numpy(cb.y_trues_[i]) for i in keep if i < len(cb.y_trues_)]
        caches[name] = (preds, trues)
    return caches


def _padding_only(batch):
    return any(key.endswith("_batch_size") and size == 0 for key, size in batch.items())


def merge_epoch(net):
    """Give every rank the batch records and scoring caches of all ranks.

    One collective. Afterwards the epoch's ``batches`` hold every rank's
    records in dataset order, ``*_batch_count`` count them all, and each
    caching ``EpochScoring`` holds the predictions of the whole data. A batch
    that held nothing but padding is neither kept nor counted: the history
    is the one of a single process.

    """
    row = net.history[-1]
    batches = row.get("batches", [])
    payload = {
        "batches": batches,
        "counts": {k: v for k, v in row.items() if k.endswith("_batch_count")},
        "caches": _local_caches(net, batches),
    }
    payloads = gather_object([payload])

    # padding-only batches are the last of their rank: dropping them after
    # interleaving keeps the dataset order
    row["batches"] = [
        batch for batch in interleave([p["batches"] for p in payloads]) if not _padding_only(batch)
    ]
    for key in payload["counts"]:
        row[key] = sum(p["counts"][key] for p in payloads)
    callbacks = dict(net.callbacks_)
    for name in payload["caches"]:
        for attr, index in (("y_preds_", 0), ("y_trues_", 1)):
            merged = interleave([p["caches"][name][index] for p in payloads])
            setattr(callbacks[name], attr, [_to_tensor(item) for item in merged])


def agree_on_row(net, stop, error=None):
    """Take rank 0's epoch row everywhere; learn whether any rank stopped or failed.

    One collective, which every rank joins even after an error in its
    callbacks. Rows already agree on everything computed from synced data;
    this settles what each rank measured itself (``dur``).

    Returns
    -------
    stop : bool
      Whether any rank asked to stop training.

    failure : str or None
      The first rank's error, named, if any rank failed.

    """
    accelerator = net.accelerator
    row = net.history[-1]
    mine = {k: v for k, v in row.items() if k != "batches"} if accelerator.is_main_process else None
    message = None
    if error is not None:
        message = (
            str(error)
            if isinstance(error, DistributedError)
            else failure_message("on_epoch_end", accelerator.process_index, error)
        )
    answers = gather_object([(mine, bool(stop), message)])
    row.update(answers[0][0])
    failures = [message for _, _, message in answers if message]
    return any(stop for _, stop, _ in answers), (failures[0] if failures else None)
