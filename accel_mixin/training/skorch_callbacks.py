"""What skorch's own callbacks need to run on several processes."""

from contextlib import contextmanager

from skorch.callbacks import EarlyStopping, EpochTimer, PrintLog, ProgressBar

from accel_mixin.internals import check_progress_bar

__all__ = ["main_process_only", "main_process_pickles", "progress_of_this_rank", "stopped_early"]


_LOGGERS = "skorch.callbacks.logging"
_RUN_EVERYWHERE = (EpochTimer, PrintLog, ProgressBar)
_MAIN_ONLY = {}


def main_process_only(callback):
    """Whether ``callback`` runs on the main process only.

    Loggers do: they record what every rank shares (the synced history, the
    parameters, which are the same everywhere), and from several processes
    they would record it several times. A logger is a callback of skorch's
    ``skorch.callbacks.logging`` (``TensorBoard``, ``WandbLogger``,
    ``MlflowLogger``, ``NeptuneLogger``, ``SacredLogger``) or a subclass of
    one, except ``EpochTimer``, which records into the history, and
    ``PrintLog`` and ``ProgressBar``, which other processes run silenced, so
    that their state, and the pickles that hold it, are the same on every
    rank. Any callback can say otherwise with a ``main_process_only``
    attribute. Callbacks that change training run on every rank.
    """
    explicit = getattr(callback, "main_process_only", None)
    if explicit is not None:
        return bool(explicit)
    cls = type(callback)
    if cls not in _MAIN_ONLY:
        _MAIN_ONLY[cls] = any(
            base.__module__ == _LOGGERS for base in cls.__mro__
        ) and not issubclass(cls, _RUN_EVERYWHERE)
    return _MAIN_ONLY[cls]


@contextmanager
def main_process_pickles(callbacks, is_main_process):
    """Let only the main process write ``f_pickle`` files.

    skorch's ``Checkpoint`` (and ``TrainEndCheckpoint``, through its
    ``checkpoint_``) pickles the whole net into ``f_pickle`` on whichever
    process runs it; on several processes they would all write the same
    file. Elsewhere ``f_pickle`` is set aside for the duration of the block.

    """
    if is_main_process:
        yield
        return
    saved = []
    for _, cb in callbacks:
        for obj in (cb, getattr(cb, "checkpoint_", None)):
            if getattr(obj, "f_pickle", None):
                saved.append((obj, obj.f_pickle))
                obj.f_pickle = None
    try:
        yield
    finally:
        for obj, value in saved:
            obj.f_pickle = value


def _share(batches, num_processes, rank, even):
    """How many of ``batches`` a rank runs: rank ``r`` takes ``r, r + N, ...``;
    with even batches the ranks with one less run a padding batch too."""
    if even:
        return -(-batches // num_processes)
    return len(range(rank, batches, num_processes))


def progress_of_this_rank(net, dataset_train=None, dataset_valid=None):
    """Let ``ProgressBar`` count the batches this rank runs.

    With ``batches_per_epoch='auto'`` it counts the batches of the whole
    data, with ``'count'`` the previous epoch's records of all ranks; a rank
    runs its share of them, so the bar stopped halfway. Called after the
    callbacks' ``on_epoch_begin``, on several processes.
    """
    check_progress_bar()
    accelerator = net.accelerator
    share = lambda batches: _share(  # noqa: E731
        batches, accelerator.num_processes, accelerator.process_index, accelerator.even_batches
    )
    for _, cb in net.callbacks_:
        if not isinstance(cb, ProgressBar) or getattr(cb, "pbar_", None) is None:
            continue
        if cb.batches_per_epoch == "auto":
            total = sum(
                share(cb._get_batches_per_epoch_phase(net, dataset, training))  # pylint: disable=protected-access
                for dataset, training in ((dataset_train, True), (dataset_valid, False))
            )
        elif cb.batches_per_epoch == "count" and len(net.history) > 1:
            records = net.history[-2, "batches"]
            total = sum(
                share(sum(f"{phase}_batch_size" in record for record in records))
                for phase in ("train", "valid")
            )
        else:
            continue
        cb.pbar_.total = total
        cb.pbar_.refresh()


def stopped_early(callbacks):
    """Whether an ``EarlyStopping`` among ``callbacks`` (skorch's
    ``callbacks_``) has just decided to stop training."""
    return any(
        isinstance(cb, EarlyStopping) and getattr(cb, "misses_", None) == cb.patience
        for _, cb in callbacks
    )
