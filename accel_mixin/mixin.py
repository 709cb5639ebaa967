"""AccelerateMixin: skorch's lifecycle with HuggingFace accelerate."""
import inspect
import warnings
import weakref
from contextlib import contextmanager

import torch
from accelerate.utils import DistributedType, convert_to_fp32
from skorch.callbacks import LRScheduler, PrintLog
from skorch.net import NeuralNet
from skorch.dataset import get_len, unpack_data
from skorch.history import DistributedHistory
from skorch.utils import TeeGenerator

from accel_mixin.adapters import main_process_only, main_process_pickles, progress_of_this_rank
from accel_mixin.background import BackgroundWriter
from accel_mixin.checkpoint import (
    apply_epoch_states, apply_prepared_states, apply_train_begin_states, collect_state,
    net_modules, stopped_early, train_iterator_state)
from accel_mixin.coordination import DistributedError, coordinator_for
from accel_mixin.distributed import (
    check_process_layout, check_supported, collect_garbage_at_exit, quiet_unless_main, sink_for,
    writes_files)
from accel_mixin.files import replacing_after, write_state
from accel_mixin.history_sync import agree_on_row, first, merge_epoch, real_samples
from accel_mixin.internals import check_dataloader
from accel_mixin.native_output import native_warnings_dropped
from accel_mixin.params import SafeParamsMixin
from accel_mixin.portable import PortableAccelerator
from accel_mixin.process_state import ATTRIBUTE as PROCESS_STATE, process_state
from accel_mixin.replicas import (
    check_replicas, check_same_data, check_same_steps, named_parameters)
from accel_mixin.resuming import resume
from accel_mixin.stepping import Stepper, takes_closures
from accel_mixin.training_state import snapshot
from accel_mixin.wrapping import Slot, requires_closure

__all__ = ['AccelerateMixin']

# skorch >= 1.4 tells partial_fit that fit called it, for metadata routing
_FIT_ROUTING = ({'_routing_method': 'fit'}
                if '_routing_method' in inspect.signature(NeuralNet.fit_loop).parameters else {})
# Notifications after which ranks go into collectives (DDP's broadcasts and
# all-reduces) that a failed rank would never join: a barrier ends them, so
# that an error in a callback there reaches every rank. on_epoch_end has its
# own; per-batch notifications get none, which would cost a barrier a batch.
_BARRIER_AFTER = frozenset(['on_train_begin', 'on_epoch_begin'])
# Ranks may see different numbers of batches (even_batches=False, iterable
# data): per-batch notifications must not number sections, or the ranks'
# keys drift apart. An error there is reported to the enclosing section.
_PER_BATCH = frozenset(['on_batch_begin', 'on_batch_end', 'on_grad_computed'])


class AccelerateMixin(SafeParamsMixin):
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

    Parameters
    ----------
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
      parameters (see the benchmarks).

    """
    def __init__(
            self,
            *args,
            accelerator,
            device=None,
            unwrap_after_train=True,
            callbacks__print_log__sink='auto',
            replica_check_every=1,
            **kwargs
    ):
        super().__init__(
            *args,
            device=device,
            callbacks__print_log__sink=callbacks__print_log__sink,
            **kwargs
        )
        self.accelerator = accelerator
        self.unwrap_after_train = unwrap_after_train
        self.replica_check_every = replica_check_every

    # --- what accelerate prepares -------------------------------------------

    @property
    def _process(self):
        return process_state(self)

    @property
    def _prepared(self):
        return self._process.prepared

    @property
    def _coordinator(self):
        process = self._process
        if process.coordinator is None or process.coordinator[0] is not self.accelerator:
            process.coordinator = (self.accelerator, coordinator_for(self.accelerator))
        return process.coordinator[1]

    @property
    def _stepper(self):
        process = self._process
        if process.stepper is None or process.stepper.accelerator is not self.accelerator:
            process.stepper = Stepper(self.accelerator)
        return process.stepper

    def _accelerate_slots(self):
        """Every object accelerate prepares, in the order it must be prepared."""
        for kind, names in (
                ('module', self._modules),
                ('criterion', self._criteria),
                ('optimizer', self._optimizers),
        ):
            for name in names:
                yield Slot(name + '_', self, name + '_', kind)
        for cb_name, cb in getattr(self, 'callbacks_', []):
            if isinstance(cb, LRScheduler):
                yield Slot(
                    f'callbacks__{cb_name}__lr_scheduler_', cb, 'lr_scheduler_',
                    'scheduler', step_once=cb.step_every != 'batch',
                )

    def _validate_params(self):
        super()._validate_params()
        if self.accelerator.device_placement and (self.device is not None):
            raise ValueError(
                "When device placement is performed by the accelerator, set device=None"
            )
        if isinstance(self.history_, DistributedHistory):
            raise ValueError(
                "AccelerateMixin shares the history between the processes itself: remove "
                "history=DistributedHistory(...) (and the TCPStore made for it), or every "
                "batch would be recorded twice. See 'Migrating from skorch.hf' in the README.")
        every = self.replica_check_every
        if every is not None and (not isinstance(every, int) or every < 0):
            raise ValueError(
                f"replica_check_every must be a whole number of epochs (0 turns the check "
                f"off), got {every!r}")

    def _raw(self, name):
        """The object the net built for ``name``, whether wrapped or not."""
        return self._prepared.raw_or_current(name + '_', self, name + '_')

    def _check_optimizers(self):
        if takes_closures(self.accelerator):
            return
        for name in self._optimizers:
            optimizer = self._raw(name)
            if optimizer is not None and requires_closure(optimizer):
                raise ValueError(
                    f"The optimizer {name}_ ({type(optimizer).__name__}) needs a "
                    "closure to step, which accelerate's gradient scaling and "
                    "accumulation do not support; with mixed precision fp16 or "
                    "gradient_accumulation_steps > 1, choose an optimizer whose step() "
                    "works without arguments (e.g. torch.optim.Adam)."
                )

    def _initialize_accelerator(self):
        """Prepare what is new for accelerate and wrap everything.

        Idempotent: objects prepared before are put back, never prepared
        again, so no new DDP wrapper is built and nothing is broadcast (see
        ``_prepare_retrainable_modules`` for the one exception).

        """
        check_process_layout(self.accelerator)
        check_supported(self.accelerator)
        if self.accelerator.distributed_type != DistributedType.NO:
            collect_garbage_at_exit()
        self._check_optimizers()
        self._prepared.prepare(self.accelerator, self._accelerate_slots())
        return self

    def _prepare_retrainable_modules(self):
        """Prepare again the modules whose trainable parameters changed.

        DDP syncs the gradients of the parameters that were trainable when it
        was built; after ``Freezer``, ``Unfreezer`` or a user's
        ``requires_grad_`` a module therefore gets a new DDP wrapper, on
        every rank if its trainable set changed on any (one small
        all-reduce). Runs when training and every epoch begin, after the
        callbacks.

        """
        if self.accelerator.distributed_type == DistributedType.NO:
            return  # no DDP, so nothing to rebuild
        keys = self._prepared.module_keys()
        if not keys:
            return
        changed = self._prepared.trainability_changed()
        flags = torch.tensor([key in changed for key in keys], dtype=torch.int64,
                             device=self.accelerator.device)
        flags = self.accelerator.reduce(flags, reduction='sum')
        refresh = {key for key, flag in zip(keys, flags.tolist()) if flag}
        if refresh:
            self._prepared.prepare(self.accelerator, self._accelerate_slots(), refresh=refresh)

    def _unwrap_accelerator(self):
        """Put back the objects the net built in place of the prepared ones."""
        self._prepared.unwrap()
        return self

    @contextmanager
    def _unwrapped(self):
        was_wrapped = self._prepared.wrapped
        self._unwrap_accelerator()
        try:
            yield self
        finally:
            if was_wrapped:
                self._prepared.wrap(self.accelerator)

    def initialize(self):
        """Initializes all of its components as skorch does, then prepares
        them for the accelerator; returns self."""
        self._process.forget_loaded_state()  # a fresh start
        with quiet_unless_main(self.accelerator):
            super().initialize()
            try:
                self._initialize_accelerator()
            except BaseException:
                self.initialized_ = False
                raise
        return self

    def fit(self, X, y=None, **fit_params):
        """Initialize and fit the module, as skorch does.

        After ``load_state``, ``fit`` goes on from the loaded state instead
        of initializing anew, and trains only the epochs that remain up to
        ``max_epochs``.

        """
        with self._coordinator.session('fit'), quiet_unless_main(self.accelerator), \
                self._finishing_writes():
            # before initialize(), whose preparation runs DDP's collectives:
            # a rank in another call learns it here, naming both calls
            self._coordinator.barrier('fit')
            if not (self.initialized_ and self._process.resumed):
                return super().fit(X, y, **fit_params)
            # skorch's fit, without its initialize()
            self.partial_fit(X, y, **_FIT_ROUTING, **fit_params)
            return self

    def partial_fit(self, X, y=None, classes=None, **fit_params):
        others = self.accelerator.num_processes > 1 and not self.accelerator.is_main_process
        with self._coordinator.session('partial_fit'), quiet_unless_main(self.accelerator), \
                native_warnings_dropped(active=others), self._finishing_writes():
            return super().partial_fit(X, y, classes=classes, **fit_params)

    @contextmanager
    def _finishing_writes(self):
        """Where training ends with an exception, finish an asynchronous write
        still in flight, and say if it failed too, without hiding the error."""
        try:
            yield
        except BaseException:
            writer = self._process.writer
            if writer is not None:
                try:
                    writer.wait()
                except Exception as exc:  # pylint: disable=broad-except
                    warnings.warn(f"An asynchronous save_state failed too: "
                                  f"{type(exc).__name__}: {exc}", RuntimeWarning)
            raise

    def fit_loop(self, X, y=None, epochs=None, **fit_params):
        # A resumed run trains only the epochs that remain up to max_epochs,
        # none if the run it resumes was stopped early.
        resumed, self._process.resumed = self._process.resumed, None
        if resumed is not None and epochs is None:
            epochs = max(self.max_epochs - len(self.history), 0)
            if resumed['stopped']:
                epochs = 0
                warnings.warn(
                    f"The training state resumed from ends where EarlyStopping stopped "
                    f"training, after epoch {len(self.history)}: no epochs are trained. "
                    "To train on regardless, call partial_fit(X, y, epochs=n).",
                    RuntimeWarning)
        return super().fit_loop(X, y, epochs=epochs, **fit_params)

    def _initialize_callbacks(self):
        if self.callbacks__print_log__sink != 'auto':
            return super()._initialize_callbacks()
        # resolve 'auto' for the callbacks only: the parameter stays 'auto'
        # so that clone and get_params see what the user passed
        self.callbacks__print_log__sink = sink_for(self.accelerator)
        try:
            return super()._initialize_callbacks()
        finally:
            self.callbacks__print_log__sink = 'auto'

    def _named_parameters(self):
        """Every parameter of the raw modules and criteria, named after its slot."""
        return named_parameters((name + '_', module) for name, module in net_modules(self))

    def get_all_learnable_params(self):
        # As in skorch, but from the raw modules, so that the names carry no
        # DDP prefix, and without swapping: callers may consume this lazily.
        seen = set()
        for name in self._modules + self._criteria:
            module = self._raw(name)
            named_parameters = getattr(module, 'named_parameters', None)
            if not named_parameters:
                continue
            for param_name, param in named_parameters():
                if param not in seen:
                    seen.add(param)
                    yield param_name, param

    # --- training -----------------------------------------------------------

    def notify(self, method_name, **cb_kwargs):
        # Every notification is a section: an error on one rank reaches the
        # others at their next barrier rather than leaving them waiting.
        coordinator = self._coordinator
        if not coordinator.distributed:
            self._notify(method_name, **cb_kwargs)
        elif method_name in _PER_BATCH:
            try:
                self._notify(method_name, **cb_kwargs)
            except Exception as exc:
                if not isinstance(exc, DistributedError):
                    coordinator.fail(method_name, exc)
                raise
        else:
            with coordinator.section(method_name):
                self._notify(method_name, **cb_kwargs)
                if method_name in _BARRIER_AFTER:
                    coordinator.barrier(method_name)
        # collectives, reached only once every rank's callbacks succeeded
        if method_name == 'on_train_begin':
            with coordinator.section('on_train_begin'):
                self._begin_training(cb_kwargs.get('X'), cb_kwargs.get('y'))
        elif method_name == 'on_epoch_begin':
            # after Freezer, Unfreezer and the like
            self._prepare_retrainable_modules()

    def _notify(self, method_name, **cb_kwargs):
        if method_name == 'on_train_begin':
            # Callbacks set up on the net's own objects (an LR scheduler
            # is built on the raw optimizer); what they build is prepared
            # next, after a resumed run's scheduler states are back.
            self._unwrap_accelerator()
            self._process.in_train_begin = True
            try:
                self._notify_callbacks(method_name, **cb_kwargs)
            finally:
                self._process.in_train_begin = False
        elif method_name == 'on_epoch_begin':
            if self._pending:
                # a resumed run continues from the random state it saved
                apply_epoch_states(self._pending, self._train_iterator())
                self._pending.clear()
            self._notify_callbacks(method_name, **cb_kwargs)
            if self.accelerator.num_processes > 1:
                progress_of_this_rank(self, cb_kwargs.get('dataset_train'),
                                      cb_kwargs.get('dataset_valid'))
        elif method_name == 'on_epoch_end':
            self._end_epoch(**cb_kwargs)
        elif method_name == 'on_train_end':
            with main_process_pickles(self.callbacks_, self.accelerator.is_main_process):
                self._notify_callbacks(method_name, **cb_kwargs)
            self._coordinator.barrier('on_train_end')
            # Unwrap only after the callbacks: EarlyStopping(load_best=True)
            # restores weights it took from the wrapped module.
            if self.unwrap_after_train:
                self._unwrap_accelerator()
            # the CPU copy that asynchronous saves reuse is for one fit: a write
            # still in flight holds its own reference
            self._process.snapshot = None
        else:
            self._notify_callbacks(method_name, **cb_kwargs)

    def _begin_training(self, X, y):
        """After the callbacks' on_train_begin: check the data, restore what
        a resumed run has for the callbacks, prepare what they built."""
        # before preparing: a net trimmed for prediction has no optimizer
        self.check_training_readiness()
        if self.accelerator.num_processes > 1:
            check_same_data(self.accelerator, X, y)
        apply_train_begin_states(self, self._pending)
        self._initialize_accelerator()
        self._prepare_retrainable_modules()
        apply_prepared_states(self, self._pending)
        if self.accelerator.num_processes > 1 and self.replica_check_every:
            # after the callbacks' on_train_begin: a load that worked on
            # some ranks only (LoadInitState ignores errors) shows here
            check_replicas(self.accelerator, list(self._named_parameters()),
                           'when training begins')
        self._process.stepper = Stepper(self.accelerator)

    def _notify_callbacks(self, method_name, **cb_kwargs):
        """skorch's ``notify``; under several processes, the loggers
        (``main_process_only``) run on the main process only, and record
        once. A collective call that one of them makes raises at once
        (``save_params`` excepted, which the main process alone writes)."""
        if self.accelerator.num_processes == 1:
            super().notify(method_name, **cb_kwargs)
            return
        # skorch's loop, which has no way to leave a callback out
        getattr(self, method_name)(self, **cb_kwargs)
        main = self.accelerator.is_main_process
        for name, cb in self.callbacks_:
            if not main_process_only(cb):
                getattr(cb, method_name)(self, **cb_kwargs)
            elif main:
                with self._coordinator.running_alone(f'the callback {name!r}'):
                    getattr(cb, method_name)(self, **cb_kwargs)

    def _end_epoch(self, **cb_kwargs):
        """Sync the epoch, run the callbacks, and agree on the row and on stopping.

        Callbacks decide on scores of the whole data, the same on every
        rank. EarlyStopping stops training by raising KeyboardInterrupt; if
        any rank stops, all do. An error in a callback on any rank makes
        every rank raise: the rank that failed still joins the final
        exchange, which carries its error to the others.

        """
        distributed = self.accelerator.num_processes > 1
        if distributed:
            self._coordinator.barrier('history sync')
            merge_epoch(self)
        stop, error = False, None
        try:
            with main_process_pickles(self.callbacks_, self.accelerator.is_main_process):
                self._notify_callbacks('on_epoch_end', **cb_kwargs)
        except KeyboardInterrupt:
            stop = True
        except Exception as exc:  # pylint: disable=broad-except
            if not distributed:
                raise
            error = exc
            if not isinstance(exc, DistributedError):
                # ranks waiting in a save inside a callback learn of it now
                self._coordinator.fail('on_epoch_end', exc)
        if distributed:
            stop, failure = agree_on_row(self, stop, error)
            if error is not None:
                raise error
            if failure is not None:
                raise DistributedError(failure)
            every = self.replica_check_every
            if every and len(self.history) % every == 0:
                # before a training state is saved: never save a divergence
                check_replicas(self.accelerator, list(self._named_parameters()),
                               f'after epoch {len(self.history)}')
        # after every other callback: the state of the finished epoch, and
        # whether EarlyStopping ends training there, so that a rerun does not
        # go on (a Ctrl-C or another callback's stop does not count)
        self._process.stopping = stop and stopped_early(self.callbacks_)
        try:
            for _, cb in self.callbacks_:
                finished = getattr(cb, 'on_epoch_finished', None)
                if finished is not None:
                    finished(self)
        finally:
            self._process.stopping = False
        if stop:
            raise KeyboardInterrupt

    def run_single_epoch(self, iterator, training, prefix, step_fn, **fit_params):
        """Run one epoch of training or validation, as skorch does.

        With several processes, the padding that even batches add trains (it
        keeps the ranks in step) but is not counted: the history records the
        loss and size of the real samples of each batch, and callbacks see
        only those, or, for a batch with none, the whole batch recorded with
        size 0.

        """
        if iterator is None:
            return
        if training and self.accelerator.num_processes > 1:
            check_same_steps(self.accelerator, iterator)
        gradient_state = self.accelerator.gradient_state
        processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        # without even batches nothing is padded: every sample is real
        padded = processes > 1 and self.accelerator.even_batches
        batch_count = 0
        for batch in iterator:
            size = get_len(batch[0]) if isinstance(batch, (tuple, list)) else get_len(batch)
            real = real_samples(gradient_state, processes, rank, size) if padded else size
            view = batch if real in (0, size) else first(batch, real)
            self.notify('on_batch_begin', batch=view, training=training)
            step = step_fn(batch, **fit_params)
            if view is not batch:
                step = self._real_step(step, view, real, training)
            self.history.record_batch(prefix + '_loss', step['loss'].item() if real else 0.0)
            self.history.record_batch(prefix + '_batch_size', real)
            self.notify('on_batch_end', batch=view, training=training, **step)
            batch_count += bool(real)  # padding alone is no batch of the data
        self.history.record(prefix + '_batch_count', batch_count)

    def _real_step(self, step, view, real, training):
        """The step's loss and prediction for the real samples of its batch."""
        y_pred = first(step['y_pred'], real)
        Xi, yi = unpack_data(view)
        with torch.no_grad(), self._stepper.autocast():
            loss = self.get_loss(y_pred, yi, X=Xi, training=training)
        return dict(step, loss=loss, y_pred=y_pred)

    def on_train_begin(self, net, X=None, y=None, **kwargs):
        super().on_train_begin(net, X=X, y=y, **kwargs)
        # an interrupted fit may have left half-accumulated gradients; they
        # are cleared on the parameters, so that the optimizers see the
        # calls a skorch net makes, no more
        self.accelerator.step = 0
        for module in self._accumulation_modules():
            for param in module.parameters():
                param.grad = None
        for optimizer in map(self._raw, self._optimizers):
            if isinstance(optimizer, torch.optim.Optimizer):  # tensors outside modules too
                for group in optimizer.param_groups:
                    for param in group['params']:
                        param.grad = None

    def _accumulation_modules(self):
        return [
            getattr(self, name + '_') for name in self._modules + self._criteria
            if isinstance(getattr(self, name + '_', None), torch.nn.Module)
        ]

    def train_step_single(self, batch, **fit_params):
        self._set_training(True)
        Xi, yi = unpack_data(batch)
        with self._stepper.autocast():
            y_pred = self.infer(Xi, **fit_params)
            loss = self.get_loss(y_pred, yi, X=Xi, training=True)
        self._stepper.backward(loss)
        return {
            'loss': loss,
            'y_pred': y_pred,
        }

    def train_step(self, batch, **fit_params):
        """Forward, backward, optimizer step and zeroing of the gradients.

        Runs within ``accelerator.accumulate`` for all modules, so that with
        gradient accumulation the optimizers step, and DDP syncs gradients,
        only every ``gradient_accumulation_steps`` batches. The gradients are
        zeroed after the step rather than before the forward pass, which
        would discard the accumulated ones.

        ``on_grad_computed`` is notified on the batches where the optimizers
        step, with the gradients they step with: accumulated over the
        micro-batches, synced across the processes and unscaled by the
        gradient scaler, so that ``GradientNormClipping`` clips what it
        would clip in plain skorch. On the micro-batches in between it is
        not notified: their gradients are partial sums that nothing should
        clip or inspect. Without accumulation, it is notified on every batch.

        Optimizers that act on the loss their closure returns (LBFGS, or one
        whose ``step`` is not torch's own) step as in skorch, without a
        gradient scaler and without accumulation:
        ``optimizer.step(closure)``, where the closure zeroes the gradients,
        runs forward and backward and returns the loss. Otherwise the
        gradients are computed once and every optimizer steps on them, with
        or without a scaler alike (a GradScaler cannot step with a closure,
        and a closure that zeroes the gradients would discard the
        accumulated ones).

        """
        step_accumulator = self.get_train_step_accumulator()
        closures = self._stepper.closures_for(self._optimizer_objects())

        def step_fn():
            if closures:
                self._zero_grad_optimizer()
            step = self.train_step_single(batch, **fit_params)
            step_accumulator.store_step(step)
            if self._stepper.sync_gradients:
                # what the optimizers will step with: accumulated, synced
                # across ranks and unscaled, as accelerate clips gradients
                self._stepper.unscale(self._optimizer_objects())
                self.notify(
                    'on_grad_computed',
                    named_parameters=TeeGenerator(self.get_all_learnable_params()),
                    batch=batch,
                    training=True,
                )
            return step['loss']

        with self._stepper.accumulate(self._accumulation_modules):
            self._step_optimizer(step_fn, closures=closures)
            if not closures:
                # after the step rather than before the forward pass, which
                # would discard the accumulated gradients
                self._zero_grad_optimizer()
        return step_accumulator.get_step()

    def _optimizer_objects(self):
        return [getattr(self, name + '_') for name in self._optimizers]

    def _step_optimizer(self, step_fn, closures=None):
        if closures is None:
            closures = self._stepper.closures_for(self._optimizer_objects())
        if closures:
            for optimizer in self._optimizer_objects():
                self._stepper.step(optimizer, step_fn)
        else:
            step_fn()
            self._stepper.step_all(self._optimizer_objects())

    def _zero_grad_optimizer(self, set_to_none=None):
        for optimizer in self._optimizer_objects():
            self._stepper.zero_grad(optimizer, set_to_none=set_to_none)

    def validation_step(self, batch, **fit_params):
        with self._stepper.autocast():
            return super().validation_step(batch, **fit_params)

    def forward_iter(self, X, training=False, device='cpu'):
        """skorch's ``forward_iter``, after every rank arrived.

        Inference gathers every batch from every rank: a rank that calls
        ``predict`` alone would wait in a collective that the others never
        join, or abort in one of theirs. The barrier instead raises a
        ``DistributedError`` on every rank that names both calls, or, if the
        others make no collective call, one after the timeout.
        """
        if self.accelerator.num_processes > 1:
            self._coordinator.barrier('inference (predict, predict_proba, forward, score)')
        yield from super().forward_iter(X, training=training, device=device)

    def evaluation_step(self, batch, training=False):
        # Autocast here rather than only in the prepared module's forward, so
        # that unwrapped nets predict with the same precision.
        with self._stepper.autocast():
            y_infer = super().evaluation_step(batch, training=training)
        return self.accelerator.gather_for_metrics(convert_to_fp32(y_infer))

    def get_iterator(self, dataset, training=False):
        iterator = self.accelerator.prepare_data_loader(
            super().get_iterator(dataset, training=training))
        # Dataloaders are built anew for every fit and predict; registered,
        # they would pile up in the accelerator and in every pickle of it.
        dataloaders = self.accelerator._dataloaders  # pylint: disable=protected-access
        dataloaders[:] = [dl for dl in dataloaders if dl is not iterator]
        if training:
            # its shuffling is part of a training state
            check_dataloader(iterator)
            self._process.train_iterator = weakref.ref(iterator)
        return iterator

    def _train_iterator(self):
        ref = self._process.train_iterator
        return ref() if ref is not None else None

    @property
    def _pending(self):
        return self._process.pending

    # --- saving and loading -------------------------------------------------

    def save_params(self, *args, **kwargs):
        """Save the parameters of the net's modules, optimizers and history.

        Accepts the arguments of ``skorch.net.NeuralNet.save_params``. The
        state is taken from the unwrapped objects, so the keys carry no DDP
        prefix and the files load into accelerated and plain skorch nets
        alike. Only the main process writes; every process returns once the
        files are complete, and raises if the write failed.

        """
        save = super().save_params
        with self._unwrapped(), quiet_unless_main(self.accelerator):
            if self._coordinator.alone is not None:
                # a logger on the main process (WandbLogger's save_model,
                # MlflowLogger's artifacts): the main process writes anyway
                save(*args, **kwargs)
                return
            self._coordinator.run(lambda: save(*args, **kwargs), what='save_params',
                                  here=writes_files(self.accelerator), gate=replacing_after)

    def load_params(self, *args, **kwargs):
        """Load the parameters of the net's modules, optimizers and history.

        Accepts the arguments of ``skorch.net.NeuralNet.load_params``. Every
        process loads into the unwrapped objects, so that DDP keeps its
        wrapper around the loaded weights. With ``device=None`` the files are
        mapped to the CPU, and the accelerator's device placement stays in
        charge. If loading fails on any process, every process raises.

        """
        if kwargs.get('checkpoint') is not None and not self.initialized_:
            self.initialize()
        load = super().load_params
        with self._unwrapped(), quiet_unless_main(self.accelerator):
            self._coordinator.run(lambda: load(*args, **kwargs), what='load_params')

    def save_state(self, path, asynchronous=False, on_written=None):
        """Save the whole training state, to resume training exactly.

        The file holds the weights of every module and criterion, every
        optimizer, the LR schedulers of ``LRScheduler`` callbacks, the
        gradient scaler, the random number generators of every rank, the
        history, the position of training and the state of the callbacks,
        as tensors and plain values only. Every rank must call it; the main
        process writes, atomically.

        Parameters
        ----------
        path : str or os.PathLike
          The file to write.

        asynchronous : bool (default=False)
          If True, copy the state to CPU memory and write it in a background
          thread while training goes on. At most one write is in flight: the
          next save waits for the previous one, and ``wait_for_saves`` waits
          for the last. A failed write raises on every rank at the next of
          these.

        on_written : callable or None (default=None)
          Called without arguments on the writing process once the file is
          complete (``TrainingCheckpoint`` rotates its files there).

        """
        writes = writes_files(self.accelerator)

        def write(state):
            write_state(state, path)
            if on_written is not None:
                on_written()

        with self._unwrapped(), quiet_unless_main(self.accelerator), \
                self._coordinator.session('save_state'):
            self.wait_for_saves()
            state = collect_state(self, train_iterator_state(self._train_iterator()),
                                  stopped=self._process.stopping)
            if not asynchronous:
                self._coordinator.run(lambda: write(state), what='save_state', here=writes,
                                      gate=replacing_after)
            elif writes:
                # the previous write is done: its snapshot's memory is free
                copy = snapshot(state, reuse=self._process.snapshot)
                self._process.snapshot = copy
                self._writer.submit(lambda: write(copy))

    def wait_for_everyone(self, what='wait_for_everyone'):
        """Wait for every process, failing fast.

        As ``accelerator.wait_for_everyone()``, except that if a process
        failed in the call this one is part of (a callback of the same
        ``fit``, say), every process raises a ``DistributedError`` that names
        it instead of waiting for the timeout. For callbacks that go into
        collectives of their own (``ResumeTraining`` compares the ranks'
        files).

        Parameters
        ----------
        what : str (default='wait_for_everyone')
          What the processes wait for, as errors name it.

        """
        self._coordinator.barrier(what)

    def wait_for_saves(self):
        """Wait for an asynchronous ``save_state`` to finish, on every rank.

        Raises on every rank if the write failed.
        """
        self._coordinator.run(self._writer.wait, what='asynchronous save_state')

    @property
    def _writer(self):
        process = self._process
        if process.writer is None:
            process.writer = BackgroundWriter()
        return process.writer

    def load_state(self, path):
        """Restore a training state that ``save_state`` wrote.

        Restores in steps: read the file once; load the weights into the
        unwrapped modules; prepare; restore optimizers, schedulers, scaler,
        history, loop and callbacks; free the state and wait for everyone.
        The random number generators and the shuffling of the training data
        are restored when the next epoch begins, and the next ``fit`` or
        ``partial_fit`` trains only the epochs that remain up to
        ``max_epochs``.

        Parameters
        ----------
        path : str or os.PathLike
          A file that ``save_state`` wrote.

        Raises
        ------
        CheckpointError
          If the file is not a training state, or does not fit the net; on
          every rank.

        """
        with quiet_unless_main(self.accelerator), self._coordinator.session('load_state'):
            self._coordinator.barrier('load_state')  # before initialize(), as in fit
            if not self.initialized_:
                self.initialize()
            resume(self, path)

    def _check_device(self, requested_device, map_device):
        if requested_device is None:
            # The accelerator places the objects: map files to the CPU, keep
            # device=None and say nothing.
            return None
        return super()._check_device(requested_device, map_device)

    # --- copies -------------------------------------------------------------

    def __getstate__(self):
        with self._unwrapped():
            state = super().__getstate__()
        state.pop(PROCESS_STATE, None)
        state['accelerator'] = PortableAccelerator(self.accelerator)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        accelerator = self.accelerator
        if self.callbacks__print_log__sink == 'auto':
            # the sink resolved by the rank that pickled (silent elsewhere than
            # on its main process) is this process's to choose
            for _, cb in getattr(self, 'callbacks_', []):
                if isinstance(cb, PrintLog):
                    cb.sink = sink_for(accelerator)
        if accelerator.device_placement:
            for name in self._modules + self._criteria:
                module = getattr(self, name + '_', None)
                if isinstance(module, torch.nn.Module):
                    module.to(accelerator.device)
