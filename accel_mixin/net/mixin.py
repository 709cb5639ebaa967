"""AccelerateMixin: skorch's lifecycle with HuggingFace accelerate.

One short method per step of skorch's lifecycle: each calls skorch's own step
and leaves what accelerate adds to a module of its own (docs/guide/architecture.md
maps them).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from accel_mixin.callbacks import TrainingCheckpoint
from accel_mixin.distributed.epoch_scores import notify_scored
from accel_mixin.distributed.fork_guard import guard_forks
from accel_mixin.distributed.history_sync import adopt_history
from accel_mixin.distributed.process_layout import (
    check_process_layout,
    check_supported,
    quiet_unless_main,
    sink_for,
)
from accel_mixin.distributed.replicas import check_same_data
from accel_mixin.distributed.sharding import sharded
from accel_mixin.internals import cache_lomo_check
from accel_mixin.net.local import ATTRIBUTE as LOCAL
from accel_mixin.net.saving import CheckpointingMixin
from accel_mixin.net.steps import StepMixin
from accel_mixin.resume.plan import begin_epoch, continue_epoch
from accel_mixin.training.epochs import EpochBatches, epoch_end
from accel_mixin.training.fit import Fit
from accel_mixin.training.net_objects import (
    bare_modules,
    check_device,
    check_net_replicas,
    check_optimizers,
    check_params,
    check_sharding,
    prepare_retrainable_modules,
    retrainable_modules,
    shards_in_place,
)
from accel_mixin.training.notifications import (
    Notification,
    batch_failed,
    callbacks_during_fit,
    callbacks_of_this_rank,
    main_process_pickles,
    per_batch,
    progress_of_this_rank,
    runs_everywhere,
)
from accel_mixin.training.portable import PortableAccelerator, settle_unpickled
from accel_mixin.training.rows import tensor_rows
from accel_mixin.training.stepping import Stepper, check_overrides, clear_gradients
from accel_mixin.training.trackers import start_trackers
from accel_mixin.training.wrapping import prepare_dataloader

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from skorch import NeuralNet
    from torch.utils.data import DataLoader, Dataset
    from typing_extensions import Self

__all__ = ["AccelerateMixin"]


class AccelerateMixin(StepMixin, CheckpointingMixin):
    """Mixin class that trains a skorch net with HuggingFace accelerate.

    Put it before a skorch net class and pass an ``accelerate.Accelerator``.
    The net then trains with distributed data parallel across the processes
    that ``accelerate launch`` or ``torchrun`` start, with mixed precision and
    gradient accumulation as the accelerator is configured, and keeps
    skorch's API: ``fit``, ``predict``, callbacks, ``GridSearchCV``,
    ``save_params`` and ``load_params``, pickle.

    It is a drop-in replacement for ``skorch.hf.AccelerateMixin`` with the
    same constructor arguments.

    Run the same script on every process. ``predict`` and ``predict_proba``
    return all ``len(X)`` rows on every process, ``save_params`` writes on
    the main process only and returns once the files are complete, and
    ``load_params`` loads on every process.

    Parameters
    ----------
    *args
      The positional parameters of the skorch net class it is mixed into
      (``module`` first).

    accelerator : accelerate.Accelerator
      In addition to the usual parameters, pass an instance of
      ``accelerate.Accelerator`` with the desired settings. It decides the
      device, the mixed precision and the number of gradient accumulation
      steps. With ``N`` processes, every process draws ``batch_size`` samples
      per step, so a step sees ``N * batch_size`` samples.

    device : None (default=None)
      Leave device placement to the accelerator. Any other value raises an
      error unless the accelerator was created with
      ``device_placement=False``.

    unwrap_after_train : bool (default=True)
      Whether the modules, criteria, optimizers and LR schedulers are
      unwrapped after training, i.e. the objects the net built are put back
      in place of what accelerate made of them (DDP wrappers etc.). An
      unwrapped net pickles cleanly. Unwrapping and rewrapping are cheap
      reference swaps; ``partial_fit`` and ``fit`` with ``warm_start=True``
      rewrap before they train, and mixed precision applies to inference
      either way.

    callbacks__print_log__sink : 'auto' or callable (default='auto')
      If 'auto', the epoch table is printed by the main process only, and
      ``verbose=0`` silences it as in skorch.

    replica_check_every : int (default=1)
      With several processes, compare a fingerprint of every parameter
      across the ranks after every ``replica_check_every``-th epoch, and
      raise a ``DistributedError`` on every rank, naming the first parameter
      that differs, if the ranks no longer hold the same model. 0 turns the
      check off. It costs one small collective and a pass over the
      parameters.

    io_timeout : float or None (default=None)
      With several processes, the seconds a save or a load that every
      process waits for (``save_params``, ``load_params``, ``save_state``,
      ``load_state``) may go without reading or writing anything before it
      fails on every process, naming the files. None: the process group's
      timeout (set with accelerate's ``InitProcessGroupKwargs``). A slow
      save that keeps writing is never cut short.

    **kwargs
      The other parameters of the skorch net class it is mixed into
      (``max_epochs``, ``callbacks`` ...).

    Examples
    --------
    >>> from accelerate import Accelerator
    >>> from skorch import NeuralNetClassifier
    >>> from accel_mixin import AccelerateMixin
    >>>
    >>> class AcceleratedNet(AccelerateMixin, NeuralNetClassifier):
    ...     '''NeuralNetClassifier with accelerate support'''
    >>>
    >>> net = AcceleratedNet(MyModule, accelerator=Accelerator())
    >>> net.fit(X, y)

    """

    # skorch sets it from the keyword argument, as its other parameters
    callbacks__print_log__sink: str | Callable[..., Any]

    def __init__(
        self,
        *args: Any,
        accelerator: Accelerator,
        device: str | torch.device | None = None,
        unwrap_after_train: bool = True,
        callbacks__print_log__sink: str | Callable[..., Any] = "auto",
        replica_check_every: int = 1,
        io_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            *args, device=device, callbacks__print_log__sink=callbacks__print_log__sink, **kwargs
        )
        self.accelerator = accelerator
        self.unwrap_after_train = unwrap_after_train
        self.replica_check_every = replica_check_every
        self.io_timeout = io_timeout

    # --- initialization -----------------------------------------------------

    def _validate_params(self) -> None:
        super()._validate_params()
        check_params(self)

    def initialize(self) -> Self:
        """Initializes all of its components as skorch does, then prepares
        them for the accelerator; returns self."""
        if self._local.going_on:
            return self  # fit after load_state: skorch's fit goes on from it
        self._local.loaded = None  # a fresh start
        check_device(self)  # skorch's initialize moves the module first
        with quiet_unless_main(self.accelerator):
            super().initialize()
            try:
                self._initialize_accelerator()
            except BaseException:
                self.initialized_ = False
                raise
        return self

    def _initialize_callbacks(self) -> Self:
        if self.callbacks__print_log__sink != "auto":
            return super()._initialize_callbacks()
        # the parameter stays 'auto' for clone and get_params
        self.callbacks__print_log__sink = sink_for(self.accelerator)
        try:
            return super()._initialize_callbacks()
        finally:
            self.callbacks__print_log__sink = "auto"

    # --- what accelerate prepares -------------------------------------------

    def _initialize_accelerator(self) -> Self:
        """Prepare what is new for accelerate and wrap everything; what was
        prepared before is put back, not prepared again."""
        check_process_layout(self.accelerator)
        check_supported(self.accelerator)
        objects = self._objects
        check_optimizers(objects)
        check_sharding(objects)
        check_overrides(self, AccelerateMixin)
        guard_forks()
        cache_lomo_check()
        objects.prepared.prepare(self.accelerator, objects.slots())
        return self

    def _unwrap_accelerator(self) -> Self:
        """Put back the objects the net built in place of the prepared ones."""
        self._local.prepared.unwrap()
        return self

    @contextmanager
    def _unwrapped(self) -> Iterator[Self]:
        was_wrapped = self._local.prepared.wrapped
        self._unwrap_accelerator()
        try:
            yield self
        finally:
            if was_wrapped:
                self._local.prepared.wrap(self.accelerator)

    def get_all_learnable_params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        # skorch's (or an override's) on the raw modules: no DDP prefix in the
        # names; taken whole, as the swap must not outlast the call
        with bare_modules(self._objects):
            params = list(super().get_all_learnable_params())
        yield from params

    # --- training -----------------------------------------------------------

    def fit(self, X: Any, y: Any = None, **fit_params: Any) -> Self:
        """Initialize and fit the module, as skorch does.

        After ``load_state``, ``fit`` goes on from the loaded state instead
        of initializing anew, and trains only the epochs that remain up to
        ``max_epochs``.

        """
        with (
            self._coordinator.session("fit"),
            quiet_unless_main(self.accelerator),
            self._local.saves.finished_on_error(self.io_timeout),
        ):
            # before initialize(), whose preparation runs DDP's collectives:
            # a rank in another call learns it here, naming both calls
            self._coordinator.barrier("fit")
            # a plan there never began: a fit moves it out (fit_loop)
            self._local.going_on = bool(self.initialized_ and self._local.loaded)
            try:
                return super().fit(X, y, **fit_params)
            finally:
                self._local.going_on = False

    def partial_fit(self, X: Any, y: Any = None, classes: Any = None, **fit_params: Any) -> Self:
        if not self.initialized_:  # as skorch does first, for the callbacks' contexts
            self.initialize()
        adopt_history(self)  # a DistributedHistory assigned after initialize
        # skorch's notifications pass no fit parameters; the run identity needs them
        fit = self._local.fit = Fit({k: v for k, v in fit_params.items() if k[:1] != "_"})
        with (
            self._coordinator.session("partial_fit"),
            quiet_unless_main(self.accelerator),
            self._local.saves.finished_on_error(self.io_timeout),
            callbacks_during_fit(self, fit),
        ):
            return super().partial_fit(X, y, classes=classes, **fit_params)

    def fit_loop(self, X: Any, y: Any = None, epochs: int | None = None, **fit_params: Any) -> Self:
        # the loaded plan is this fit's now: the next fit starts over
        local = self._local
        plan = local.fit.plan = local.loaded
        local.loaded = None
        if plan is not None:
            epochs = plan.epochs_to_train(self, epochs)
        return super().fit_loop(X, y, epochs=epochs, **fit_params)

    _NOTIFIED: ClassVar[dict[str, str]] = {
        "on_train_begin": "_train_begins",
        "on_epoch_begin": "_epoch_begins",
        "on_epoch_end": "_end_epoch",
        "on_train_end": "_train_ends",
    }

    def notify(self, method_name: str, **cb_kwargs: Any) -> None:
        if per_batch(method_name):
            self._notify_batch(method_name, **cb_kwargs)
            return
        # every other notification is a section (notifications.py)
        self._local.fit.everywhere = None  # callbacks may change between sections
        step = self._NOTIFIED.get(method_name)
        with Notification(self._coordinator, method_name) as notification:
            if step:
                getattr(self, step)(**cb_kwargs)
            else:
                self._notify_callbacks(method_name, **cb_kwargs)
            if method_name == "on_epoch_begin":
                # after Freezer, Unfreezer and the like; whether any rank's
                # changed rides on the notification's barrier
                notification.flag = bool(retrainable_modules(self._objects))
        if method_name == "on_train_begin":
            with self._coordinator.section("on_train_begin"):
                self._begin_training(cb_kwargs.get("X"), cb_kwargs.get("y"))
        elif method_name == "on_epoch_begin" and notification.flag:
            prepare_retrainable_modules(self._objects)

    def _notify_batch(self, method_name: str, **cb_kwargs: Any) -> None:
        # kept lean: it runs three times per batch
        if method_name == "on_grad_computed":
            stepper = self._stepper
            if not stepper.sync_gradients:
                return  # partial sums of an accumulation window (stepping.py)
            stepper.unscale(self._optimizers_now())
        fit = self._local.fit
        if fit.everywhere is None:  # once between sections, not three times a batch
            fit.everywhere = runs_everywhere(self.callbacks_)
        try:
            self._notify_callbacks(method_name, fit.everywhere, **cb_kwargs)
        except BaseException as exc:
            batch_failed(self._coordinator, method_name, exc)
            raise

    def _notify_callbacks(
        self, method_name: str, everywhere: bool | None = None, **cb_kwargs: Any
    ) -> None:
        if everywhere is None:
            everywhere = runs_everywhere(self.callbacks_)
        if everywhere:
            super().notify(method_name, **cb_kwargs)
            return
        with callbacks_of_this_rank(self, self._coordinator):
            super().notify(method_name, **cb_kwargs)

    def _train_begins(self, **cb_kwargs: Any) -> None:
        # callbacks build on the raw objects (an LR scheduler on the raw
        # optimizer); _begin_training prepares what they built
        self._unwrap_accelerator()
        shards_in_place(self._objects)
        self._notify_callbacks("on_train_begin", **cb_kwargs)

    def _begin_training(self, X: Any, y: Any) -> None:
        """After the callbacks' on_train_begin: check the data, restore what a
        resumed run has for the callbacks, prepare what they built."""
        self.check_training_readiness()  # a net trimmed for prediction has no optimizer
        distributed = self.accelerator.num_processes > 1
        if distributed:
            check_same_data(X, y, self._coordinator.gather)
        plan, objects = self._local.loaded, self._objects
        if plan is not None:
            plan.at_train_begin(self, objects)
        self._initialize_accelerator()
        prepare_retrainable_modules(objects)
        if plan is not None:
            plan.once_prepared(self)
        if distributed and self.replica_check_every:
            # a load that worked on some ranks only (LoadInitState ignores errors)
            check_net_replicas(objects, "when training begins", self._coordinator.gather)
        self._local.fit.stepper = Stepper(self.accelerator)
        start_trackers(self.accelerator, type(self).__name__)

    def on_train_begin(self, net: NeuralNet, X: Any = None, y: Any = None, **kwargs: Any) -> None:
        super().on_train_begin(net, X=X, y=y, **kwargs)
        # an interrupted fit may have left half-accumulated gradients
        self.accelerator.step = 0
        objects = self._objects
        clear_gradients(
            [module for _, module in objects.named_modules()],
            list(objects.raw_optimizers().values()),
        )

    def _epoch_begins(self, **cb_kwargs: Any) -> None:
        partial = begin_epoch(self._local.fit)
        shards_in_place(self._objects)  # for callbacks that change parameters (Freezer)
        self._notify_callbacks("on_epoch_begin", **cb_kwargs)
        if partial is not None:
            continue_epoch(self, partial)
        if self.accelerator.num_processes > 1:
            progress_of_this_rank(
                self, cb_kwargs.get("dataset_train"), cb_kwargs.get("dataset_valid")
            )

    def run_single_epoch(
        self,
        iterator: Iterable[Any] | None,
        training: bool,
        prefix: str,
        step_fn: Callable[..., Any],
        **fit_params: Any,
    ) -> None:
        """skorch's loop over the real samples of each batch; the padding of
        even batches trains but is not counted (``epochs``)."""
        if iterator is None:
            return super().run_single_epoch(iterator, training, prefix, step_fn, **fit_params)
        batches = EpochBatches(self, iterator, training, self._local.fit, self._coordinator.gather)
        super().run_single_epoch(batches, training, prefix, batches.step(step_fn), **fit_params)
        self.history.record(prefix + "_batch_count", batches.batch_count)
        return None

    def _end_epoch(self, **cb_kwargs: Any) -> None:
        with epoch_end(self, self._coordinator, self._objects, **cb_kwargs) as scores:
            if not scores:
                self._notify_callbacks("on_epoch_end", **cb_kwargs)
            else:  # callbacks record the main process's scores (epoch_scores.py)
                with callbacks_of_this_rank(self, self._coordinator):
                    notify_scored(self, scores, **cb_kwargs)

    def _train_ends(self, **cb_kwargs: Any) -> None:
        with main_process_pickles(self.callbacks_, self.accelerator.is_main_process):
            self._notify_callbacks("on_train_end", **cb_kwargs)
        self._coordinator.barrier("on_train_end")
        # after the callbacks: EarlyStopping(load_best=True) restores weights
        # it took from the wrapped module
        if self.unwrap_after_train:
            self._unwrap_accelerator()

    def get_dataset(self, X: Any, y: Any = None) -> Dataset:
        dataset = super().get_dataset(X, y)
        if dataset is X or dataset is self.dataset:
            return dataset  # the user's own
        return tensor_rows(dataset)

    def get_iterator(self, dataset: Dataset, training: bool = False) -> DataLoader:
        # a stream records where it stops where states are saved inside epochs
        inside_epochs = training and any(
            isinstance(cb, TrainingCheckpoint) and cb.every_n_batches for _, cb in self.callbacks_
        )
        iterator = prepare_dataloader(
            self.accelerator,
            super().get_iterator(dataset, training=training),
            training,
            self._coordinator,
            inside_epochs,
        )
        if training:
            self._local.fit.train_iterator = weakref.ref(iterator)  # for save_state
        return iterator

    # --- copies -------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        initialized = self.initialized_ and sharded(self.accelerator)
        shards = self._objects.sharded_module() if initialized else None
        if shards is not None:
            raise TypeError(
                f"A net whose {shards[0]}_ is sharded by FSDP2 cannot be "
                "pickled: each process holds only its shard of the parameters. Save them "
                "with save_params(f_params=...), which writes the full tensors, and load "
                "the file into a new net with load_params."
            )
        with self._unwrapped():
            state = super().__getstate__()
        state.pop(LOCAL, None)
        state["accelerator"] = PortableAccelerator(self.accelerator)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:

        super().__setstate__(state)
        settle_unpickled(self, self._objects)
