"""``save_params``, ``load_params``, ``save_state`` and ``load_state`` on every
process: files hold the keys of the unwrapped modules, the main process (with
``save_on_each_node``, of every machine) writes, and every process returns once
the files are complete, or raises if any process failed.
"""

import os
import warnings

import torch
from skorch.exceptions import DeviceWarning

from accel_mixin.checkpoint.background import in_flight, join_all
from accel_mixin.checkpoint.files import write_state
from accel_mixin.checkpoint.params import SafeParamsMixin
from accel_mixin.checkpoint.sharded_state import (
    agree_on_the_save,
    remove_shards,
    remove_stale_shards,
)
from accel_mixin.checkpoint.state_saves import save_group, save_state_folder
from accel_mixin.checkpoint.state_values import cpu_snapshot
from accel_mixin.distributed.process_layout import quiet_unless_main, writes_files
from accel_mixin.distributed.sharding import full_states, sharded
from accel_mixin.errors import DistributedError, Stalled
from accel_mixin.internals import batch_sampler_owner, check_f_arguments
from accel_mixin.resume.resuming import resume
from accel_mixin.resume.state_folder import folder_state
from accel_mixin.resume.training_state import (
    collect_state,
    save_sharded_entries,
    train_iterator_state,
    warn_if_inside_accumulation,
)
from accel_mixin.training.net_objects import raw, sharded_module
from accel_mixin.training.notifications import stopped_early
from accel_mixin.training.process_state import process_state


def _files_of(args, kwargs):
    """The files a save_params or load_params call names, for messages."""
    names = [str(f) for f in args if f is not None]
    names += [f"{key}={f}" for key, f in kwargs.items() if key.startswith("f_") and f is not None]
    return ", ".join(names) or None


class CheckpointingMixin(SafeParamsMixin):
    """Saving and loading on every process, for ``AccelerateMixin`` (whose
    ``_unwrapped()`` it uses)."""

    @property
    def _process(self):
        return process_state(self)

    @property
    def _coordinator(self):
        return self._process.coordinator_for(self.accelerator)

    def save_params(self, *args, **kwargs):
        """Save the parameters of the net's modules, optimizers and history.

        Accepts the arguments of ``skorch.net.NeuralNet.save_params``. Keys
        carry no DDP prefix, so the files load into accelerated and plain
        skorch nets alike. Only the main process writes; every process returns
        once the files are complete, and raises if the write failed.

        """
        save = lambda: super(CheckpointingMixin, self).save_params(*args, **kwargs)  # noqa: E731
        with (
            self._unwrapped(),
            quiet_unless_main(self.accelerator),
            self._saving_gathered(self._gather_sharded("save_params", args, kwargs)),
        ):
            if self._coordinator.alone is not None:
                # a logger on the main process (WandbLogger's save_model,
                # MlflowLogger's artifacts): the main process writes anyway
                save()
                return
            self._coordinator.run(
                save,
                what="save_params",
                files=_files_of(args, kwargs),
                here=writes_files(self.accelerator),
                io_timeout=self.io_timeout,
            )

    def _gather_sharded(self, what, args, kwargs):
        """Under FSDP2, the full states of the sharded module and optimizers
        that a ``save_params`` call saves, gathered on every rank (empty
        elsewhere than where files are written)."""
        if not sharded(self.accelerator):
            return {}
        named = sharded_module(self)
        if named is None:
            return {}
        files = dict(zip(("f_params", "f_optimizer", "f_criterion", "f_history"), args))
        files.update((key, f) for key, f in kwargs.items() if key.startswith("f_"))
        attrs = list(check_f_arguments("save_params", **files)[0])
        name, module = named
        optimizers = {f"{n}_": raw(self, n) for n in self._optimizers}
        # every rank arrives first: the gathering is a collective
        self._coordinator.barrier(what)
        accelerator = self.accelerator
        writers = accelerator.gather(
            torch.tensor([int(writes_files(accelerator))], device=accelerator.device)
        )
        # save_on_each_node on several machines: each one's writer needs them
        everywhere = int(writers.sum()) > 1
        return full_states(f"{name}_", module, optimizers, attrs, everywhere=everywhere)

    def load_params(self, *args, **kwargs):
        """Load the parameters of the net's modules, optimizers and history.

        Accepts the arguments of ``skorch.net.NeuralNet.load_params``. Every
        process loads into the unwrapped objects; with ``device=None`` files
        are mapped to the CPU and the accelerator places the objects. If
        loading fails on any process, every process raises.

        """
        if kwargs.get("checkpoint") is not None and not self.initialized_:
            self.initialize()
        load = lambda: super(CheckpointingMixin, self).load_params(*args, **kwargs)  # noqa: E731
        with self._unwrapped(), quiet_unless_main(self.accelerator):
            with self._coordinator.session("load_params"):
                self._wait_for_writes_in_flight("load_params")
                self._coordinator.run(
                    load,
                    what="load_params",
                    files=_files_of(args, kwargs),
                    io_timeout=self.io_timeout,
                )

    def _check_device(self, requested_device, map_device):
        if requested_device is None:
            # the accelerator places the objects: no DeviceWarning about it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeviceWarning)
                super()._check_device(requested_device, map_device)
            return None
        return super()._check_device(requested_device, map_device)

    def save_state(self, path, asynchronous=False, on_written=None, stopped=None):
        """Save the whole training state, to resume training exactly.

        The file holds modules, criteria, optimizers, the LR schedulers of
        ``LRScheduler`` callbacks, the gradient scaler, every rank's random
        number generators, the history, the position of training and the
        callbacks' state, as tensors and plain values only. Every rank must
        call it; the main process writes.

        Under FSDP2 the sharded module's tensors, its optimizers' state and
        ``EarlyStopping``'s best weights go to a folder beside the file,
        ``<path>.shards-<token>``, in which every rank writes its own shards
        with ``torch.distributed.checkpoint`` (nothing is gathered); the
        file, written last, names it. Such a state loads on any number of
        processes, sharded or not. The shards are written before
        ``save_state`` returns, also with ``asynchronous=True``, which then
        writes the file in the background. A save that fails raises the
        same ``CheckpointError`` on every rank, naming every rank's
        failure, and removes its folder; the previous state stays intact.

        Parameters
        ----------
        path : str or os.PathLike
          The file to write.

        asynchronous : bool (default=False)
          If True, copy the state to CPU memory and write it in a background
          thread while training goes on. At most one write is in flight; a
          failed write raises on every rank at the next save or
          ``wait_for_saves``.

        on_written : callable or None (default=None)
          Called without arguments on the writing process once the file is
          complete (``TrainingCheckpoint`` rotates its files there).

        stopped : bool or None (default=None)
          Whether training ends with this state, so that a run resumed from
          it trains no further. None: whether an ``EarlyStopping`` callback
          decided to stop.

        """

        folder = None

        def write(state, caught=()):
            """Write the file, then tidy; returns the write's error of the
            kinds ``caught``, with this save's shards removed."""
            try:
                write_state(state, path)
            except BaseException as exc:
                if folder is not None:  # no file names it: retries on a full disk pile none up
                    remove_shards(path, folder)
                if isinstance(exc, caught) and not isinstance(exc, (DistributedError, Stalled)):
                    return exc
                raise
            if folder is not None:
                remove_stale_shards(path, keep=folder)
            if on_written is not None:
                on_written()
            return None

        with (
            self._unwrapped(),
            quiet_unless_main(self.accelerator),
            self._coordinator.session("save_state"),
        ):
            # a failure here (a rank gone, the previous write's error) is this call's
            self._finish_saves("save_state")
            state = collect_state(self, *self._where_training_is(stopped))
            named = sharded_module(self) if sharded(self.accelerator) else None
            if named is not None:
                optimizers = {name: raw(self, name) for name in self._optimizers}
                folder = self._coordinator.run(
                    lambda: save_sharded_entries(
                        state, path, *named, optimizers, self.accelerator.num_processes
                    ),
                    what="save_state",
                    files=f"the shards of {path}",
                    io_timeout=self.io_timeout,
                )
            # after collect_state's collective: an error reaches every rank
            warn_if_inside_accumulation(self.accelerator)
            writes = writes_files(self.accelerator)
            if not asynchronous and folder is not None:
                self._write_sharded(
                    path, lambda: write(state, caught=(OSError, RuntimeError)), folder
                )
            elif not asynchronous:
                self._coordinator.run(
                    lambda: write(state),
                    what="save_state",
                    files=str(path),
                    here=writes,
                    io_timeout=self.io_timeout,
                )
            elif writes:
                # the previous write is done: its snapshot's memory is free
                copy = self._process.snapshot = cpu_snapshot(state, reuse=self._process.snapshot)
                self._process.background_writer().submit(lambda: write(copy))

    def _where_training_is(self, stopped):
        """``(train iterator state, stopped, position)`` of a state saved now
        (``collect_state``'s arguments); ``stopped`` is ``save_state``'s."""
        fit = self._process.fit
        if fit.position is None:
            shuffling = train_iterator_state(fit.running_train_iterator())
        else:  # inside an epoch: its order is replayed from its start
            batch_sampler_owner(fit.running_train_iterator())
            shuffling = fit.epoch_start_iterator
        if stopped is None:
            stopped = fit.position is None and stopped_early(self.callbacks_)
        return shuffling, stopped, fit.position

    def _save_state_folder(self, path, asynchronous=False, on_written=None, stopped=None):
        """``save_state`` as one DCP folder ``path`` in every layout
        (``resume.state_folder``), every rank writing its own part; with
        ``asynchronous``, through ``dcp.async_save`` on a gloo group.

        WIP (issue 47, point 2): ``save_state`` calls it once ``load_state``
        and ``ResumeTraining`` read such folders.
        """
        with (
            self._unwrapped(),
            quiet_unless_main(self.accelerator),
            self._coordinator.session("save_state"),
        ):
            # a failure here (a rank gone, the previous save's error) is this call's
            self._finish_saves("save_state")
            state = folder_state(self, *self._where_training_is(stopped))
            warn_if_inside_accumulation(self.accelerator)
            group = None
            if asynchronous:
                group = self._process.save_group = save_group(self._process.save_group)
            self._process.save_in_flight = self._coordinator.run(
                lambda: save_state_folder(
                    state, path, asynchronous=asynchronous, group=group, on_committed=on_written
                ),
                what="save_state",
                files=str(path),
                io_timeout=self.io_timeout,
            )

    def _write_sharded(self, path, write, folder):
        """Write the file of a state whose shards are in ``folder`` (``write()``
        returns its error); where it fails, every rank raises the same
        ``CheckpointError``."""
        failed = self._coordinator.run(
            write,
            what="save_state",
            files=str(path),
            here=writes_files(self.accelerator),
            io_timeout=self.io_timeout,
        )
        target = os.path.join(os.path.dirname(os.path.abspath(path)), folder)
        agree_on_the_save(path, failed, self.accelerator.num_processes, target, f"writing {path}")

    def wait_for_saves(self):
        """Wait for an asynchronous ``save_state`` to finish, on every rank.

        Raises on every rank if the write failed.
        """
        self._finish_saves("asynchronous save_state")

    def _finish_saves(self, what):
        """``wait_for_saves`` within the call ``what``, which its errors name."""
        self._coordinator.run(self._wait_for_my_saves, what=what)

    def _wait_for_my_saves(self):
        """On this rank: wait for this net's asynchronous save in flight, at
        most ``io_timeout``; raise what it raised."""
        self._process.background_writer().wait()
        in_flight, self._process.save_in_flight = self._process.save_in_flight, None
        if in_flight is not None:
            in_flight.wait(self.io_timeout)

    def _wait_for_writes_in_flight(self, what):
        """Before a load, on every rank: wait for this process's asynchronous
        writes (of any net); a failed write of this net raises."""

        def finish():
            join_all()
            self._wait_for_my_saves()

        # a failure there (a rank gone) is the load's own unless a save is in flight
        waits = in_flight() or self._process.save_in_flight is not None
        label = f"{what}: asynchronous saves in flight" if waits else what
        self._coordinator.run(finish, what=label)

    def load_state(self, path):
        """Restore a training state that ``save_state`` wrote.

        Every rank reads the file once (under FSDP2, and for a state saved
        under FSDP2, the pieces of its own shards in the folder beside it, on
        any number of processes) and restores weights, optimizers,
        schedulers, scaler, history, loop and callbacks; the random number
        generators and the shuffling are restored when the next epoch begins,
        and the next ``fit`` or ``partial_fit`` trains only the epochs that
        remain up to ``max_epochs``.

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
        with quiet_unless_main(self.accelerator), self._coordinator.session("load_state"):
            self._coordinator.barrier("load_state")  # before initialize(), as in fit
            self._wait_for_writes_in_flight("load_state")
            if not self.initialized_:
                self.initialize()
            resume(self, path)

    def wait_for_everyone(self, what="wait_for_everyone"):
        """Wait for every process, failing fast.

        As ``accelerator.wait_for_everyone()``, except that if a process
        failed in the call this one is part of (a callback of the same
        ``fit``, say), every process raises a ``DistributedError`` that names
        it instead of waiting for the timeout.

        Parameters
        ----------
        what : str (default='wait_for_everyone')
          What the processes wait for, as errors name it.

        """
        self._coordinator.barrier(what)
