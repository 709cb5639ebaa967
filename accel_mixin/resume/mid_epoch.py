"""Training states inside an epoch, and resuming from them exactly.

A training state written after ``k`` training batches of an epoch holds, in
addition to what an epoch's end holds, each rank's part of the unfinished
epoch: its row of the history so far (the batch records), the predictions
that training-score callbacks cached (``EpochScoring(on_train=True)``), its
random number generators as they were when the epoch began and after batch
``k``, and the shuffling state of the training data as it was when the
epoch began.

Resuming replays the epoch's shuffled order from that state and skips the
first ``k`` batches at the sampler level: the indices of the skipped batches
are drawn (so the order, and the padding that even batches add at the end,
are those of the uninterrupted epoch) but no sample is loaded, so the time to
the first trained batch does not grow with ``k``. The random number
generators of the epoch's start are restored when it begins again (a
sampler without a generator of its own draws its order from them), those
after batch ``k`` just before the first resumed batch trains. This is
exact where loading a sample draws no random numbers (tensors, arrays,
datasets without random augmentation): with a dataset that augments at
random, the rest of the resumed epoch draws other numbers, for the
augmentations and, where the main process loads, for dropout too.
"""

from contextlib import contextmanager

from skorch.callbacks import EpochScoring

from accel_mixin.checkpoint.state_values import as_plain, cpu_snapshot, history_state
from accel_mixin.internals import batch_sampler_owner
from accel_mixin.training.process_state import process_state

__all__ = ["apply_partial_epoch", "partial_epoch", "resumable_inside_epochs", "skipping_batches"]


def resumable_inside_epochs(net, explain=False):
    """Whether the running fit's training data can resume inside an epoch:
    map-style data, whose batches have indices to skip. With ``explain``,
    raise the ``ValueError`` that says why not instead of returning False."""
    try:
        batch_sampler_owner(process_state(net).fit.running_train_iterator())
    except ValueError:
        if explain:
            raise
        return False
    return True


def _training_caches(net):
    for name, cb in net.callbacks_:
        if isinstance(cb, EpochScoring) and cb.on_train and hasattr(cb, "y_preds_"):
            yield name, cb


def partial_epoch(net, batch_count):
    """This rank's part of the unfinished epoch, as plain CPU values."""
    return {
        "row": history_state([net.history[-1]])[0],
        "batch_count": batch_count,
        "epoch_rng": process_state(net).fit.epoch_start_rng,
        "caches": {
            name: cpu_snapshot(as_plain([list(cb.y_preds_), list(cb.y_trues_)]))
            for name, cb in _training_caches(net)
        },
    }


def apply_partial_epoch(net, partial):
    """Put back this rank's part of the unfinished epoch, after the
    callbacks' ``on_epoch_begin`` (which starts a row and empties caches)."""
    net.history[-1] = partial["row"]
    device = net.accelerator.device
    callbacks = dict(net.callbacks_)
    for name, (preds, trues) in partial["caches"].items():
        callbacks[name].y_preds_ = [p.to(device) if hasattr(p, "to") else p for p in preds]
        callbacks[name].y_trues_ = list(trues)


class _SkipFirst:
    """A batch sampler that draws every batch of ``batch_sampler`` and
    yields all but the first ``skip``; everything else is the original's."""

    def __init__(self, batch_sampler, skip):
        self.batch_sampler = batch_sampler
        self.skip = skip

    def __iter__(self):
        batches = iter(self.batch_sampler)
        for _ in range(self.skip):
            if next(batches, None) is None:
                return
        yield from batches

    def __len__(self):
        return len(self.batch_sampler)

    def __getattr__(self, name):
        if name == "batch_sampler":
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


@contextmanager
def skipping_batches(dataloader, skip):
    """While the block runs, iterating ``dataloader`` (prepared by
    accelerate) skips its first ``skip`` batches without loading them."""
    if not skip:
        yield
        return
    owner = batch_sampler_owner(dataloader)
    original = owner.batch_sampler
    skipping = _SkipFirst(original, skip)
    # DataLoader refuses a new batch_sampler once built; the object is the
    # same one for the whole fit, so it is swapped for this epoch only
    object.__setattr__(owner, "batch_sampler", skipping)
    try:
        yield
    finally:
        object.__setattr__(owner, "batch_sampler", original)
        # persistent workers keep the sampler their iterator began with
        skipping.skip = 0
