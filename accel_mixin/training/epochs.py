"""One epoch on every rank: its batches, and its end.

With even batches accelerate pads an epoch's last batches so that every rank
takes the same number of steps. Each rank trains on its real samples, with
its share of the step's real samples as the weight of its loss
(``shares.py``), so that N processes train as one with N times the batch;
the history and the callbacks see the real samples of each batch (an empty
batch, size 0 and loss 0, where it is all padding). skorch's ``run_single_epoch``
runs the loop. At an epoch's end the ranks share their records, run the
callbacks on the same row, and agree on the row, on stopping and on any
error, before the replica check and the ``on_epoch_finished`` hooks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from skorch.dataset import unpack_data

from accel_mixin.distributed.control import agreed_failure
from accel_mixin.distributed.epoch_scores import score_on_main, share_predictions
from accel_mixin.distributed.history_sync import agree_on_row, leading_samples, merge_epoch
from accel_mixin.distributed.replicas import (
    check_same_steps,
    compare_replicas,
    replica_fingerprints,
)
from accel_mixin.errors import DistributedError
from accel_mixin.internals import dispatches
from accel_mixin.training.fit import Fit
from accel_mixin.training.net_objects import NetObjects, replica_parameters
from accel_mixin.training.notifications import hook, main_process_pickles, stopped_early
from accel_mixin.training.resumed_order import skipping_batches, start_workers_without_draws
from accel_mixin.training.rng import restore_rng
from accel_mixin.training.shares import (
    counts_as_batch,
    criterion_is_mean,
    data_batch_size,
    loss_weight,
    real_samples,
    samples_in,
    warn_padding_trains,
)
from accel_mixin.training.streams import SplitStream
from accel_mixin.training.trackers import log_row

if TYPE_CHECKING:
    from skorch import NeuralNet

    from accel_mixin.distributed.control import Control
    from accel_mixin.distributed.object_gather import Gather

__all__ = ["EpochBatches", "epoch_end"]


class EpochBatches:
    """One epoch's batches for skorch's ``run_single_epoch``.

    Iterating yields each batch of ``iterator`` as the view of its real
    samples; ``step(step_fn)`` trains on the whole batch and returns the step
    of the real samples. While training batches run, ``fit.position`` holds
    what a training state saved there records; a resumed epoch (``fit.plan``)
    skips the batches done. The steps weigh and autocast with ``fit.stepper``.
    ``on_batch_finished`` hooks run after each training batch.
    """

    def __init__(
        self, net: NeuralNet, iterator: Any, training: bool, fit: Fit, gather: Gather
    ) -> None:
        # iterator: skorch's, a DataLoader that accelerate prepared
        assert fit.stepper is not None, "a fit's stepper is made before its epochs"
        self.net, self.iterator, self.training = net, iterator, training
        self.gather = gather  # the coordinator's, for check_same_steps
        self.fit, self.stepper = fit, fit.stepper
        accelerator = net.accelerator
        self.processes, self.rank = accelerator.num_processes, accelerator.process_index
        # a stream that splits itself, and accelerate's dispatching loader, pad
        # their steps whatever even_batches says
        self.split = isinstance(iterator, SplitStream)
        self.padded = self.processes > 1 and (
            accelerator.even_batches or self.split or dispatches(iterator)
        )
        self.data_batch = None if self.split else data_batch_size(iterator)
        self.resume: dict[str, Any] | None = None
        self.done, self.batch_count = 0, 0
        self.finished: list[Callable[..., Any]] = []
        self._batch: Any = None
        self._real = 0
        self._weight = 1.0
        self._counted = False
        if training:
            plan = fit.plan
            self.resume = plan.resume_point() if plan is not None else None
            if self.resume is not None:
                self.done, self.batch_count = self.resume["batches"], self.resume["batch_count"]
            self.finished = [
                h for _, cb in net.callbacks_ for h in [hook(cb, "on_batch_finished")] if h
            ]

    def __len__(self) -> int:
        return len(self.iterator)

    def __getattr__(self, name: str) -> Any:
        # an override of run_single_epoch may read the DataLoader's attributes
        if name == "iterator":
            raise AttributeError(name)
        return getattr(self.iterator, name)

    def __iter__(self) -> Iterator[Any]:
        net, accelerator = self.net, self.net.accelerator
        if self.training and self.processes > 1:
            check_same_steps(accelerator, self.iterator, self.gather)
        try:
            if self.split and self.resume is not None:
                # a stream goes on from where it stopped: nothing to skip
                if self.resume.get("stream") is None or not self.iterator.keeps_state:
                    raise ValueError(
                        "The training state resumed from was saved inside an epoch, and this "
                        "fit's stream cannot go on from there: the state recorded no stream "
                        "position, or the stream is not read to record one. Resume with the "
                        "data the state was saved with and TrainingCheckpoint(every_n_batches="
                        "...) or DataLoaderConfiguration(use_stateful_dataloader=True), or "
                        "from an epoch's end."
                    )
                self.iterator.load_state_dict(self.resume["stream"])
            with skipping_batches(self.iterator, 0 if self.split else self.done):
                if self.fit.plan is not None and len(net.history) > 1:
                    # the uninterrupted run started them in its first epoch
                    start_workers_without_draws(self.iterator)
                for batch in self.iterator:
                    if self.resume is not None:
                        # the generators as they were after the last batch trained
                        restore_rng(self.resume["rng"])
                        self.resume = None
                    size = samples_in(batch)
                    gradient_state = accelerator.gradient_state
                    if self.split:
                        real, self._weight = self.iterator.real, self.iterator.weight
                    elif self.padded:
                        real = real_samples(gradient_state, self.processes, self.rank, size)
                        self._weight = loss_weight(gradient_state, self.processes, real)
                    else:
                        real = size
                    self._batch, self._real = batch, real
                    self._counted = (
                        self.iterator.counted
                        if self.split
                        else counts_as_batch(
                            gradient_state, self.processes, self.rank, (size, real), self.data_batch
                        )
                    )
                    yield batch if real == size else leading_samples(batch, real)
                    for finish in self.finished:  # after skorch's on_batch_end
                        finish(net, training=True, batches=self.done)
            if self.resume is not None:  # every batch was done already
                restore_rng(self.resume["rng"])
                # as accelerate counts a pass that yields batches
                self.iterator.iteration = getattr(self.iterator, "iteration", 0) + 1
        finally:
            if self.training:
                self.fit.position = None

    def step(self, step_fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        """``step_fn`` on the whole batch; the step of its real samples."""

        def real_step(view: Any, **fit_params: Any) -> dict[str, Any]:
            batch, real, weight = self._batch, self._real, self._weight
            trained = batch
            if not self.training or weight == 1:
                step = step_fn(batch, **fit_params)
            elif not real or criterion_is_mean(self.net.criterion_):
                # padding alone still runs, for DDP, with weight 0, which leaves
                # nothing of it whatever the loss's reduction
                trained = view if real else batch
                with self.stepper.weighting(weight):
                    step = step_fn(trained, **fit_params)
            else:
                warn_padding_trains(self.net, self.net.criterion_)
                step = step_fn(batch, **fit_params)
            self.batch_count += self._counted  # padding alone is no batch of the data
            if self.training:
                self.done += 1
                self.fit.position = (self.done, self.batch_count)
            if view is trained:
                return step
            return _real_step(self.net, step, view, real, self.training, self.stepper.autocast)

        return real_step


def _real_step(
    net: NeuralNet,
    step: dict[str, Any],
    view: Any,
    real: int,
    training: bool,
    autocast: Callable[[], Any],
) -> dict[str, Any]:
    """The step's loss and prediction for the real samples of its batch."""
    y_pred = leading_samples(step["y_pred"], real)
    if not real:
        return dict(step, loss=torch.zeros((), device=step["loss"].device), y_pred=y_pred)
    Xi, yi = unpack_data(view)
    with torch.no_grad(), autocast():
        loss = net.get_loss(y_pred, yi, X=Xi, training=training)
    return dict(step, loss=loss, y_pred=y_pred)


@contextmanager
def epoch_end(
    net: NeuralNet, coordinator: Control, objects: NetObjects, **cb_kwargs: Any
) -> Iterator[dict[str, Any]]:
    """The end of an epoch, around the net's notification of its callbacks
    (``objects``: the net's, whose replicas are checked).

    Before the block the ranks sync the epoch, and the main process scores
    for all: the block gets ``scores``, those the callbacks record at their
    turn (``notify_scored``; empty with one process). After it the ranks
    agree on the row and on stopping, and every error leaving the block is
    raised again.

    EarlyStopping's KeyboardInterrupt on any rank stops all; a callback's error
    on any rank makes every rank raise (the failed rank still joins the final
    exchange). The row then goes to accelerate's trackers (``log_with``),
    and ``on_epoch_finished(net, stopped)`` hooks run, ``stopped``
    saying whether ``EarlyStopping`` ends training (a Ctrl-C does not count).
    """
    distributed = net.accelerator.num_processes > 1
    scores: dict[str, Any] = {}
    if distributed:
        coordinator.barrier("history sync")
        on_main = share_predictions(net, **cb_kwargs)  # reads this rank's own batch records
        merge_epoch(net, coordinator.gather)
        scores = score_on_main(net, on_main, **cb_kwargs)
    stop = False
    interrupt: KeyboardInterrupt | None = None
    error: Exception | None = None
    try:
        with main_process_pickles(net.callbacks_, net.accelerator.is_main_process):
            yield scores
    except KeyboardInterrupt as exc:
        stop, interrupt = True, exc
    except Exception as exc:  # pylint: disable=broad-except
        if not distributed:
            raise
        error = exc
        if not isinstance(exc, DistributedError):
            coordinator.fail("on_epoch_end", exc)
    if distributed:
        if error is None or not agreed_failure(error):
            # carries this rank's failure to the others: here, or to a save
            # inside a callback (which then fails this section on them)
            try:
                coordinator.barrier("on_epoch_end")
            except DistributedError as exc:
                error = exc
        every = net.replica_check_every
        # before a training state is saved: never save a divergence. The
        # fingerprints ride on the row's collective; a rank that failed sends
        # none, and every rank raises its failure before they are compared
        checked = replica_parameters(objects) if every and len(net.history) % every == 0 else None
        mine = replica_fingerprints(checked) if checked is not None and error is None else None
        stop, failure, everyone = agree_on_row(net, coordinator.gather, stop, error, mine)
        if error is not None:
            raise error
        if failure is not None:
            raise DistributedError(failure)
        if checked is not None:
            prints = [theirs for theirs in everyone if theirs is not None]
            assert len(prints) == len(everyone), "a rank without fingerprints failed: raised above"
            names = [name for name, _ in checked]
            compare_replicas(prints, names, f"after epoch {len(net.history)}")
    # the row is final here, also in the epoch that EarlyStopping ends
    log_row(net.accelerator, net.history[-1])
    stopped = stop and stopped_early(net.callbacks_)
    for _, cb in net.callbacks_:
        finished = hook(cb, "on_epoch_finished")
        if finished is not None:
            # hooks written as on_epoch_finished(net) still work
            finished(net, **({"stopped": stopped} if _takes(finished, "stopped") else {}))
    if stop:
        # this rank's own, or another's (agreed on the row)
        raise interrupt or KeyboardInterrupt


def _takes(function: Callable[..., Any], name: str) -> bool:
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)
