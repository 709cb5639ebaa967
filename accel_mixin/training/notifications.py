"""How a net notifies its callbacks when it runs on several processes.

Every notification is a section of the coordinator's protocol: an error in a
callback on one rank reaches the other ranks at their next barrier, instead
of leaving them waiting in DDP's collectives for the process group's
timeout. After ``on_train_begin`` and ``on_epoch_begin`` the ranks go into
collectives that a failed rank would never join, so a barrier ends those
notifications; ``on_epoch_end`` has its own exchange (``epochs.end_epoch``).
Per-batch notifications get no barrier, which would cost one per batch, and
number no section: ranks may run different numbers of batches
(``even_batches=False``), and their keys would drift apart. An error there
is reported to the enclosing section.

Loggers (``skorch_callbacks.main_process_only``) run on the main process
only, and record once.

Beside skorch's notifications, callbacks may have hooks that only
``AccelerateMixin`` calls: ``during_fit(net)``, a context entered around
every ``fit`` and ``partial_fit``; ``on_batch_finished(net, training,
batches)`` after every callback's ``on_batch_end`` of a training batch; and
``on_epoch_finished(net, stopped)`` once the ranks agreed on an epoch's end
(``epochs``). ``TrainingCheckpoint`` uses all three.
"""

from contextlib import ExitStack, contextmanager

from accel_mixin.errors import DistributedError, Preempted
from accel_mixin.training.skorch_callbacks import main_process_only

__all__ = ["callbacks_during_fit", "callbacks_of_this_rank", "hook", "notify_in_section"]

_BARRIER_AFTER = frozenset(["on_train_begin", "on_epoch_begin"])
_PER_BATCH = frozenset(["on_batch_begin", "on_batch_end", "on_grad_computed"])


def notify_in_section(coordinator, method_name, notify):
    """Run ``notify()`` for the notification ``method_name`` as a section."""
    if not coordinator.distributed:
        notify()
    elif method_name in _PER_BATCH:
        try:
            notify()
        except Exception as exc:
            if not isinstance(exc, (DistributedError, Preempted)):
                coordinator.fail(method_name, exc)
            raise
    else:
        with coordinator.section(method_name):
            notify()
            if method_name in _BARRIER_AFTER:
                coordinator.barrier(method_name)


@contextmanager
def callbacks_of_this_rank(net, coordinator):
    """Within the block ``net.callbacks_`` holds what this rank runs, for
    skorch's ``notify``: loggers on the main process only, where a collective
    call that one makes raises at once on every rank, naming the logger
    (``save_params`` excepted, which the main process then writes alone:
    ``WandbLogger(save_model=True)``, ``MlflowLogger``). Without loggers (the
    common case) nothing changes."""
    callbacks = net.callbacks_
    if not any(main_process_only(cb) for _, cb in callbacks):
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

    def __init__(self, callback, coordinator, name):
        self._callback = callback
        self._coordinator = coordinator
        self._who = f"the callback {name!r}"

    def __getattr__(self, name):
        attr = getattr(self._callback, name)
        if not name.startswith("on_") or not callable(attr):
            return attr

        def alone(*args, **kwargs):
            with self._coordinator.running_alone(self._who):
                return attr(*args, **kwargs)

        return alone


def hook(callback, name):
    """The bound hook ``name`` of ``callback``, or None: looked up on its
    class, so that an object that answers every attribute (a ``Mock``) has
    none."""
    return getattr(callback, name) if callable(getattr(type(callback), name, None)) else None


@contextmanager
def callbacks_during_fit(net):
    """Enter the ``during_fit(net)`` context of every callback that has one."""
    with ExitStack() as stack:
        for _, cb in net.callbacks_:
            during_fit = hook(cb, "during_fit")
            if during_fit is not None:
                stack.enter_context(during_fit(net))
        yield
