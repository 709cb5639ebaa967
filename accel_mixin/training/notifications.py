"""How a net notifies its callbacks on several processes.

Every notification is a section of the coordinator's protocol, so that a
callback's error on one rank reaches the others at their next barrier, not
after DDP's timeout; per-batch ones (ranks may run different numbers of
batches) report to the enclosing section. Loggers run on the main process
only. Hooks only ``AccelerateMixin`` calls: ``during_fit(net, fit)``, a
context around every fit, given its ``training.fit.Fit``;
``on_batch_finished(net, training, batches)`` after a training batch;
``on_epoch_finished(net, stopped)`` once the ranks agreed on an epoch's end
(``TrainingCheckpoint`` uses all three).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from skorch.callbacks import EarlyStopping, EpochTimer, PrintLog, ProgressBar

from accel_mixin.errors import DistributedError, Preempted
from accel_mixin.internals import batches_per_epoch_phase

if TYPE_CHECKING:
    from types import TracebackType

    from skorch import NeuralNet
    from skorch.callbacks import Callback
    from torch.utils.data import Dataset

    from accel_mixin.distributed.control import Control as Coordinator
    from accel_mixin.training.fit import Fit

# skorch's ``callbacks_``: (name, callback) pairs
_Callbacks = Sequence[tuple[str, "Callback"]]

__all__ = [
    "Notification",
    "batch_failed",
    "callbacks_during_fit",
    "callbacks_of_this_rank",
    "hook",
    "main_process_only",
    "main_process_pickles",
    "per_batch",
    "progress_of_this_rank",
    "runs_everywhere",
    "stopped_early",
]

_BARRIER_AFTER = frozenset(["on_train_begin", "on_epoch_begin"])
_PER_BATCH = frozenset(["on_batch_begin", "on_batch_end", "on_grad_computed"])
_LOGGERS = "skorch.callbacks.logging"
_RUN_EVERYWHERE = (EpochTimer, PrintLog, ProgressBar)
_MAIN_ONLY: dict[type, bool] = {}


class Notification:
    """The context of the notification ``method_name``: the net notifies
    inside it. Entered on every batch, so a plain class.

    Per-batch notifications (ranks may run different numbers of batches)
    fail the enclosing section on an error; the others are a section of
    their own, with a barrier at the end of ``on_train_begin`` and
    ``on_epoch_begin``, after which ``flag`` holds the largest any rank set.
    """

    __slots__ = ("_control", "_name", "_section", "flag")

    def __init__(self, control: Coordinator, method_name: str) -> None:
        self._control, self._name = control, method_name
        self._section: AbstractContextManager[object] | None = None
        # set in the block: the barrier after it gives every rank the largest
        self.flag = 0

    def __enter__(self) -> Notification:
        if self._control.distributed and self._name not in _PER_BATCH:
            self._section = section = self._control.section(self._name)
            section.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        section = self._section
        if section is None:
            if exc is not None:
                batch_failed(self._control, self._name, exc)
            return False
        if exc is None and self._name in _BARRIER_AFTER:
            try:
                self.flag = self._control.barrier(self._name, flag=self.flag)
            except BaseException as error:
                section.__exit__(type(error), error, error.__traceback__)
                raise
        return bool(section.__exit__(exc_type, exc, traceback))


def batch_failed(control: Coordinator, method_name: str, exc: BaseException) -> None:
    """The per-batch notification ``method_name`` raised ``exc`` here: fail
    the enclosing section, which names it on the other ranks at their next
    barrier (ranks may run different numbers of batches: no barrier per batch)."""
    if (
        isinstance(exc, Exception)
        and control.distributed
        and not isinstance(exc, (DistributedError, Preempted))
    ):
        control.fail(method_name, exc)


def per_batch(method_name: str) -> bool:
    """Whether ``method_name`` is notified per batch (no section of its own)."""
    return method_name in _PER_BATCH


def runs_everywhere(callbacks: _Callbacks) -> bool:
    """Whether every rank runs all of ``callbacks``: none is a logger kept to the main process."""
    return not any(main_process_only(cb) for _, cb in callbacks)


def main_process_only(callback: object) -> bool:
    """Whether ``callback`` runs on the main process only: skorch's loggers
    (``skorch.callbacks.logging``) and their subclasses, except ``EpochTimer``,
    ``PrintLog`` and ``ProgressBar``, which record alike on every rank. A
    ``main_process_only`` attribute decides otherwise."""
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
def callbacks_of_this_rank(net: NeuralNet, coordinator: Coordinator) -> Iterator[None]:
    """Within the block ``net.callbacks_`` holds what this rank runs: loggers
    on the main process only, where a collective they make raises on every
    rank, naming the logger (``save_params`` writes alone)."""
    callbacks = net.callbacks_
    if runs_everywhere(callbacks):
        yield
        return
    main = net.accelerator.is_main_process
    net.callbacks_ = [
        (name, _RunningAlone(cb, coordinator, name) if main_process_only(cb) else cb)
        for name, cb in callbacks
        if main or not main_process_only(cb)
    ]
    try:
        yield
    finally:
        net.callbacks_ = callbacks


class _RunningAlone:
    """A main-process-only callback whose notifications run alone."""

    def __init__(self, callback: Callback, coordinator: Coordinator, name: str) -> None:
        self._callback = callback
        self._coordinator = coordinator
        self._who = f"the callback {name!r}"

    def __reduce__(self) -> tuple[Callable[[Callback], Callback], tuple[Callback]]:
        # a copy of the net made mid-fit (Checkpoint's f_pickle, deepcopy)
        # holds the user's own callback, the same object as in net.callbacks;
        # the wrapper and its coordinator belong to this process's fit
        return _unwrapped, (self._callback,)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._callback, name)
        if not name.startswith("on_") or not callable(attr):
            return attr

        def alone(*args: Any, **kwargs: Any) -> Any:
            with self._coordinator.running_alone(self._who):
                return attr(*args, **kwargs)

        return alone


def _unwrapped(callback: Callback) -> Callback:
    return callback


def hook(callback: object, name: str) -> Callable[..., Any] | None:
    """The bound hook ``name`` of ``callback``, or None; looked up on its class,
    so that a ``Mock`` has none."""
    return getattr(callback, name) if callable(getattr(type(callback), name, None)) else None


@contextmanager
def callbacks_during_fit(net: NeuralNet, fit: Fit) -> Iterator[None]:
    """Enter the ``during_fit(net, fit)`` context of every callback that has one."""
    with ExitStack() as stack:
        for _, cb in net.callbacks_:
            during_fit = hook(cb, "during_fit")
            if during_fit is not None:
                stack.enter_context(during_fit(net, fit))
        yield


@contextmanager
def main_process_pickles(callbacks: _Callbacks, is_main_process: bool) -> Iterator[None]:
    """Let only the main process write the ``f_pickle`` of skorch's
    ``Checkpoint`` (and ``TrainEndCheckpoint``'s ``checkpoint_``)."""
    if is_main_process:
        yield
        return
    saved: list[tuple[Any, str]] = []
    for _, cb in callbacks:
        owners: tuple[Any, ...] = (cb, getattr(cb, "checkpoint_", None))
        for obj in owners:
            if getattr(obj, "f_pickle", None):
                saved.append((obj, obj.f_pickle))
                obj.f_pickle = None
    try:
        yield
    finally:
        for obj, value in saved:
            obj.f_pickle = value


def progress_of_this_rank(
    net: NeuralNet, dataset_train: Dataset | None = None, dataset_valid: Dataset | None = None
) -> None:
    """Let each ``ProgressBar`` count the batches this rank runs, after the
    callbacks' ``on_epoch_begin``."""
    accelerator = net.accelerator
    n, rank = accelerator.num_processes, accelerator.process_index

    def share(batches: int) -> int:  # rank r runs r, r + n, ...; even batches pad the rest
        return -(-batches // n) if accelerator.even_batches else len(range(rank, batches, n))

    for _, cb in net.callbacks_:
        if not isinstance(cb, ProgressBar) or getattr(cb, "pbar_", None) is None:
            continue
        if cb.batches_per_epoch == "auto":
            total = sum(
                share(batches_per_epoch_phase(cb, net, dataset, training))
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


def stopped_early(callbacks: _Callbacks) -> bool:
    """Whether an ``EarlyStopping`` in ``callbacks`` has just decided to stop."""
    return any(
        isinstance(cb, EarlyStopping) and getattr(cb, "misses_", None) == cb.patience
        for _, cb in callbacks
    )
