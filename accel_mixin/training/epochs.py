"""One epoch on every rank: its batches, and its end.

With even batches, accelerate pads the last batches of an epoch so that every
rank takes the same number of steps. The padding trains (it keeps the ranks
in step) but is not counted: the history records the loss and size of the
real samples of each batch, and callbacks see only those (an empty batch,
recorded with size 0 and loss 0, where a rank's batch is all padding).
skorch's own ``run_single_epoch`` runs the loop (``EpochBatches``).

At the end of an epoch the ranks share their records (``history_sync``), every
rank runs the callbacks on the same row, and the ranks agree on the row, on
whether to stop and on any error, before the replica check and the hooks that
save the finished epoch (``on_epoch_finished``).
"""

import inspect

import torch
from skorch.dataset import get_len, unpack_data

from accel_mixin.checkpoint.state_values import restore_rng
from accel_mixin.distributed.history_sync import (
    agree_on_row,
    leading_samples,
    merge_epoch,
    real_samples,
)
from accel_mixin.distributed.replicas import check_net_replicas, check_same_steps
from accel_mixin.errors import DistributedError
from accel_mixin.resume.data_order import skipping_batches, start_workers_without_draws
from accel_mixin.training.notifications import hook
from accel_mixin.training.process_state import process_state
from accel_mixin.training.skorch_callbacks import main_process_pickles, stopped_early

__all__ = ["EpochBatches", "end_epoch"]


class EpochBatches:
    """One epoch's batches for skorch's ``run_single_epoch``.

    Iterating it yields the batches of ``iterator``, each as the view of its
    real samples (padding off; empty where the batch is all padding), and
    ``step(step_fn)`` is the step function to pass beside it: it trains on
    the whole batch and returns the step of its real samples. So skorch's own
    loop (and a user's override of it) records and notifies what one process
    would. ``batch_count`` counts the batches with real samples.

    While training batches run, the net's process state holds the position
    a training state saved there records; a resumed epoch skips the batches
    its state had done (``resume/data_order.py``). After each training batch, callbacks
    with an ``on_batch_finished(net, training, batches)`` hook run, after
    every callback's ``on_batch_end``, with ``batches``, the training batches
    done in the epoch: ``TrainingCheckpoint`` saves there.

    Parameters
    ----------
    net : AccelerateMixin net
      The net running the epoch.

    iterator : DataLoader
      Prepared by accelerate.

    training : bool
      Whether the epoch trains.

    autocast : callable
      The context manager of the net's precision, for the loss of the real
      samples of a padded batch.

    """

    def __init__(self, net, iterator, training, autocast):
        self.net = net
        self.iterator = iterator
        self.training = training
        self.autocast = autocast
        accelerator = net.accelerator
        self.processes, self.rank = accelerator.num_processes, accelerator.process_index
        # without even batches nothing is padded: every sample is real
        self.padded = self.processes > 1 and accelerator.even_batches
        self.process = process_state(net)
        self.resume, self.done, self.batch_count, self.finished = None, 0, 0, []
        self._batch = self._real = None
        if training:
            plan = self.process.plan
            self.resume = plan.resume_point() if plan is not None else None
            if self.resume is not None:
                self.done, self.batch_count = self.resume["batches"], self.resume["batch_count"]
            self.finished = [
                h for _, cb in net.callbacks_ for h in [hook(cb, "on_batch_finished")] if h
            ]

    def __len__(self):
        return len(self.iterator)

    def __getattr__(self, name):
        # an override of run_single_epoch may read the DataLoader's attributes
        if name == "iterator":
            raise AttributeError(name)
        return getattr(self.iterator, name)

    def __iter__(self):
        net, accelerator = self.net, self.net.accelerator
        if self.training and self.processes > 1:
            check_same_steps(accelerator, self.iterator)
        try:
            with skipping_batches(self.iterator, self.done):
                if self.process.plan is not None and len(net.history) > 1:
                    # the uninterrupted run started them in its first epoch
                    start_workers_without_draws(self.iterator)
                for batch in self.iterator:
                    if self.resume is not None:
                        # the generators as they were after the last batch trained
                        restore_rng(self.resume["rng"])
                        self.resume = None
                    size = _size(batch)
                    real = (
                        real_samples(accelerator.gradient_state, self.processes, self.rank, size)
                        if self.padded
                        else size
                    )
                    self._batch, self._real = batch, real
                    yield batch if real == size else leading_samples(batch, real)
                    # skorch recorded the batch and notified on_batch_end
                    for finish in self.finished:
                        finish(net, training=True, batches=self.done)
            if self.resume is not None:  # every batch was done already
                restore_rng(self.resume["rng"])
                # as accelerate counts a pass that yields batches
                self.iterator.iteration = getattr(self.iterator, "iteration", 0) + 1
        finally:
            if self.training:
                self.process.position = None

    def step(self, step_fn):
        """``step_fn`` on the whole batch; the step of its real samples."""

        def real_step(view, **fit_params):
            batch, real = self._batch, self._real
            step = step_fn(batch, **fit_params)
            self.batch_count += bool(real)  # padding alone is no batch of the data
            if self.training:
                self.done += 1
                self.process.position = (self.done, self.batch_count)
            if view is batch:
                return step
            return _real_step(self.net, step, view, real, self.training, self.autocast)

        return real_step


def _size(batch):
    return get_len(batch[0]) if isinstance(batch, (tuple, list)) else get_len(batch)


def _real_step(net, step, view, real, training, autocast):
    """The step's loss and prediction for the real samples of its batch."""
    y_pred = leading_samples(step["y_pred"], real)
    if not real:
        return dict(step, loss=torch.zeros((), device=step["loss"].device), y_pred=y_pred)
    Xi, yi = unpack_data(view)
    with torch.no_grad(), autocast():
        loss = net.get_loss(y_pred, yi, X=Xi, training=training)
    return dict(step, loss=loss, y_pred=y_pred)


def end_epoch(net, coordinator, notify_callbacks, **cb_kwargs):
    """Sync the epoch, run the callbacks, agree on the row and on stopping.

    Callbacks decide on scores of the whole data, the same on every rank.
    EarlyStopping stops training by raising KeyboardInterrupt; if any rank
    stops, all do. An error in a callback on any rank makes every rank raise:
    the rank that failed still joins the final exchange, which carries its
    error to the others. Then callbacks with an ``on_epoch_finished(net,
    stopped)`` hook see the finished epoch, ``stopped`` saying whether
    ``EarlyStopping`` ends training there (a Ctrl-C or another callback's
    stop does not count: a rerun goes on).

    Parameters
    ----------
    net : AccelerateMixin net
      Training.

    coordinator : coordination.Coordinator
      The net's coordinator.

    notify_callbacks : callable
      ``notify_callbacks(method_name, **cb_kwargs)`` runs the callbacks.

    """
    distributed = net.accelerator.num_processes > 1
    if distributed:
        coordinator.barrier("history sync")
        merge_epoch(net)
    stop, error = False, None
    try:
        with main_process_pickles(net.callbacks_, net.accelerator.is_main_process):
            notify_callbacks("on_epoch_end", **cb_kwargs)
    except KeyboardInterrupt:
        stop = True
    except Exception as exc:  # pylint: disable=broad-except
        if not distributed:
            raise
        error = exc
        if not isinstance(exc, DistributedError):
            # ranks waiting in a save inside a callback learn of it now
            coordinator.fail("on_epoch_end", exc)
    if distributed:
        stop, failure = agree_on_row(net, stop, error)
        if error is not None:
            raise error
        if failure is not None:
            raise DistributedError(failure)
        every = net.replica_check_every
        if every and len(net.history) % every == 0:
            # before a training state is saved: never save a divergence
            check_net_replicas(net, f"after epoch {len(net.history)}")
    stopped = stop and stopped_early(net.callbacks_)
    for _, cb in net.callbacks_:
        finished = hook(cb, "on_epoch_finished")
        if finished is not None:
            # hooks written as on_epoch_finished(net) still work
            finished(net, **({"stopped": stopped} if _takes(finished, "stopped") else {}))
    if stop:
        raise KeyboardInterrupt


def _takes(function, name):
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)
