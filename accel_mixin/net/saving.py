"""``save_params``, ``load_params``, ``save_state`` and ``load_state`` on every
process. ``save_params`` files hold the keys of the unwrapped modules, the main
process (with ``save_on_each_node``, of every machine) writes them; a training
state is one DCP folder that every rank writes its part of
(``checkpoint.state_saves``), or, with ``save_on_each_node`` on several
machines, that each machine's main process writes whole
(``checkpoint.machine_copies``). Every process returns once the files are
complete, or raises if any process failed.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from skorch.exceptions import DeviceWarning

from accel_mixin.checkpoint import storage
from accel_mixin.checkpoint.machine_copies import machine_copies
from accel_mixin.checkpoint.params import SafeParamsMixin
from accel_mixin.checkpoint.state_saves import save_state_folder
from accel_mixin.distributed.process_layout import (
    quiet_unless_main,
    saves_on_each_node,
    writes_files,
)
from accel_mixin.distributed.sharding import full_states, sharded
from accel_mixin.errors import Stalled
from accel_mixin.internals import check_f_arguments
from accel_mixin.net.local import NetLocal, net_local
from accel_mixin.resume.contents import (
    train_iterator_state,
    warn_if_inside_accumulation,
)
from accel_mixin.resume.load import read, restore_training, restore_weights
from accel_mixin.resume.state_folder import folder_state, rank_entries
from accel_mixin.training.net_objects import NetObjects
from accel_mixin.training.notifications import stopped_early
from accel_mixin.training.resumed_order import resumable_inside_epochs
from accel_mixin.training.streams import stream_position

if TYPE_CHECKING:
    from collections.abc import Callable

    from accel_mixin.checkpoint.state_saves import SaveInFlight
    from accel_mixin.distributed.control import Control


def _named_files(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The files (names or file objects) a save_params or load_params call
    names, each with its label for messages."""
    named = [(str(f), f) for f in args if f is not None and not isinstance(f, bool)]
    named += [
        (f"{key}={f}", f) for key, f in kwargs.items() if key.startswith("f_") and f is not None
    ]
    return named


def _files_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """The files a save_params or load_params call names, for messages."""
    return ", ".join(label for label, _ in _named_files(args, kwargs)) or None


class CheckpointingMixin(SafeParamsMixin):
    """Saving and loading on every process, for ``AccelerateMixin`` (whose
    ``_unwrapped()`` it uses)."""

    @property
    def _local(self) -> NetLocal:
        return net_local(self)

    @property
    def _objects(self) -> NetObjects:
        """The objects the net built, for the modules below it (a new view
        each time: skorch's initialize makes new registries)."""
        # pylint: disable=protected-access
        return NetObjects(
            self, self._local.prepared, self._modules, self._criteria, self._optimizers
        )

    @property
    def _coordinator(self) -> Control:
        return self._local.coordinator(self.accelerator)

    def save_params(self, *args: Any, **kwargs: Any) -> None:
        """Save the parameters of the net's modules, optimizers and history.

        Accepts the arguments of ``skorch.net.NeuralNet.save_params``; file
        names may be fsspec URLs (``s3://bucket/params.pt``). Keys
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
                writer=self._single_writer(args, kwargs),
            )

    def _single_writer(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
        """The main process, where it alone writes files given by name: they
        are replaced atomically, so the write need not wait for the others
        to arrive, as a file object's would."""
        if saves_on_each_node(self.accelerator):
            return None
        named = all(isinstance(f, (str, os.PathLike)) for _, f in _named_files(args, kwargs))
        return 0 if named else None

    def _gather_sharded(
        self, what: str, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> dict[str, dict[str, Any]]:
        """Under FSDP2, the full states of the sharded module and optimizers
        that a ``save_params`` call saves, gathered on every rank (empty
        elsewhere than where files are written)."""
        if not sharded(self.accelerator):
            return {}
        objects = self._objects
        named = objects.sharded_module()
        if named is None:
            return {}
        files = dict(zip(("f_params", "f_optimizer", "f_criterion", "f_history"), args))
        files.update((key, f) for key, f in kwargs.items() if key.startswith("f_"))
        attrs = list(check_f_arguments("save_params", **files)[0])
        name, module = named
        optimizers = {f"{n}_": optimizer for n, optimizer in objects.raw_optimizers().items()}
        # every rank arrives first: the gathering is a collective
        self._coordinator.barrier(what)
        accelerator = self.accelerator
        writers = accelerator.gather(
            torch.tensor([int(writes_files(accelerator))], device=accelerator.device)
        )
        # save_on_each_node on several machines: each one's writer needs them
        everywhere = int(writers.sum()) > 1
        return full_states(f"{name}_", module, optimizers, attrs, everywhere=everywhere)

    def load_params(self, *args: Any, **kwargs: Any) -> None:
        """Load the parameters of the net's modules, optimizers and history.

        Accepts the arguments of ``skorch.net.NeuralNet.load_params``; file
        names may be fsspec URLs. Every
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

    def _check_device(
        self, requested_device: str | torch.device | None, map_device: str | torch.device
    ) -> str | torch.device | None:
        if requested_device is None:
            # the accelerator places the objects: no DeviceWarning about it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeviceWarning)
                super()._check_device(requested_device, map_device)
            return None
        return super()._check_device(requested_device, map_device)

    def save_state(
        self,
        path: str | os.PathLike[str],
        asynchronous: bool = False,
        on_written: Callable[[], object] | None = None,
        stopped: bool | None = None,
    ) -> None:
        """Save the whole training state, to resume training exactly.

        ``path`` becomes one ``torch.distributed.checkpoint`` (DCP) folder,
        the same under one process, DDP and FSDP2: modules, criteria and
        optimizers (keyed by parameter names), the LR schedulers of
        ``LRScheduler`` callbacks, the gradient scaler, every rank's random
        number generators, the history, the position of training and the
        callbacks' state. Every rank must call it and writes its own part
        (under FSDP2 its own shards: nothing is gathered); the save goes into
        ``.<name>.partial-<token>`` beside ``path``, which the first process
        renames to ``path`` once complete, the one commit: a folder under the
        state's name is whole, and a state saved there before stays intact
        until then. Such a state loads on any number of processes, sharded or
        not. A save that fails raises the same ``CheckpointError`` on every
        rank, naming every rank's failure, and removes its partial folder.

        With ``ProjectConfiguration(save_on_each_node=True)`` on several
        machines (which share no filesystem), the main process of each machine
        writes a whole copy of the state, every rank's generators included,
        into ``path`` on its machine by itself, and commits it; the other ranks
        wait for it, and a failure on one machine raises on every rank (a
        ``DistributedError`` naming it elsewhere). Each rank loads its own
        machine's copy. A module that FSDP2 shards has no whole state on any
        machine: such a save raises ``CheckpointError``.

        Parameters
        ----------
        path : str or os.PathLike
          The folder to write, or an fsspec URL (``s3://bucket/state``),
          where a commit marker uploaded last stands for the rename
          (``docs/guide/object-storage.md``).

        asynchronous : bool (default=False)
          If True, copy the state to CPU memory and write it with
          ``torch.distributed.checkpoint.async_save`` while training goes on
          (in every layout). At most one save is in flight; a failed save
          raises on every rank at the next save, ``wait_for_saves`` or
          ``load_state``, each waiting at most ``io_timeout``.

        on_written : callable or None (default=None)
          Called without arguments on the first process (with
          ``save_on_each_node`` on several machines, on each machine's) once
          the folder is committed (``TrainingCheckpoint`` rotates its states there).

        stopped : bool or None (default=None)
          Whether training ends with this state, so that a run resumed from
          it trains no further. None: whether an ``EarlyStopping`` callback
          decided to stop.

        """
        path = storage.local(path)
        with (
            self._unwrapped(),
            quiet_unless_main(self.accelerator),
            self._coordinator.session("save_state"),
        ):
            # a failure here (a rank gone, the previous save's error) is this call's
            self._finish_saves("save_state")
            # every rank arrived in _finish_saves: machine_copies' gather is safe here
            shuffling, stopped, position, epoch_rng = self._where_training_is(stopped)
            stream = stream_position(self._local.fit.train_iterator_now(), position)
            ranks = machine_copies(
                self.accelerator, lambda: rank_entries(self, position, epoch_rng, stream), path
            )
            state = folder_state(
                self, self._objects, shuffling, stopped, position, epoch_rng, ranks, stream
            )
            warn_if_inside_accumulation(self.accelerator)
            alone = ranks is not None  # each machine's main process writes its copy
            saves = self._local.saves
            group = saves.save_group() if asynchronous and not alone else None

            def save() -> SaveInFlight | None:
                in_flight = save_state_folder(
                    state,
                    path,
                    asynchronous=asynchronous,
                    group=saves.own_group() if alone else group,
                    on_committed=on_written,
                    alone=alone,
                    stager=saves.kept_stager() if asynchronous else None,
                )
                if alone:  # where another machine's copy fails, this one's is still waited for
                    self._local.saves.in_flight = in_flight
                return in_flight

            try:
                self._local.saves.in_flight = self._coordinator.run(
                    save,
                    what="save_state",
                    files=str(path),
                    here=not alone or writes_files(self.accelerator),
                    io_timeout=self.io_timeout,
                )
            except Stalled:
                saves.let_go_of_the_copy()  # its staging goes on in the background
                raise

    def _where_training_is(
        self, stopped: bool | None
    ) -> tuple[dict[str, Any], bool, tuple[int, int] | None, dict[str, Any] | None]:
        """``(train iterator state, stopped, position, epoch_rng)`` of a state
        saved now (``state_folder.folder_state``'s arguments); ``stopped`` is
        ``save_state``'s."""
        fit = self._local.fit
        if fit.position is None:
            shuffling, epoch_rng = train_iterator_state(fit.train_iterator_now()), None
        else:  # inside an epoch: its order is replayed from its start
            resumable_inside_epochs(fit.running_train_iterator(), explain=True)
            assert fit.epoch_start is not None, "begin_epoch keeps it before any batch"
            shuffling, epoch_rng = fit.epoch_start.shuffling, fit.epoch_start.rng
        if stopped is None:
            stopped = fit.position is None and stopped_early(self.callbacks_)
        return shuffling, stopped, fit.position, epoch_rng

    def wait_for_saves(self) -> None:
        """Wait for an asynchronous ``save_state`` to finish, on every rank.

        Raises on every rank if the write failed.
        """
        self._finish_saves("asynchronous save_state")

    def _finish_saves(self, what: str) -> None:
        """``wait_for_saves`` within the call ``what``, which its errors name."""
        self._coordinator.run(self._wait_for_my_saves, what=what)

    def _wait_for_my_saves(self) -> None:
        """On this rank: wait for this net's asynchronous save in flight, at
        most ``io_timeout``; raise what it raised."""
        self._local.saves.wait(self.io_timeout)

    def _wait_for_writes_in_flight(self, what: str) -> None:
        """Before a load, on every rank: wait for this net's asynchronous
        save; a failed save raises. Another net's saves are that net's to
        wait for (``wait_for_saves``), as DCP's ``async_save`` future is its
        caller's."""
        # a failure there (a rank gone) is the load's own unless a save is in flight
        waits = self._local.saves.in_flight is not None
        label = f"{what}: asynchronous saves in flight" if waits else what
        self._coordinator.run(self._wait_for_my_saves, what=label)

    def load_state(self, path: str | os.PathLike[str]) -> None:
        """Restore a training state that ``save_state`` wrote.

        Every rank reads the folder (under FSDP2 the pieces of its own
        shards, whatever number of processes saved it) and restores weights, optimizers,
        schedulers, scaler, history, loop and callbacks; the random number
        generators and the shuffling are restored when the next epoch begins,
        and the next ``fit`` or ``partial_fit`` trains only the epochs that
        remain up to ``max_epochs``.

        Parameters
        ----------
        path : str or os.PathLike
          A folder or fsspec URL that ``save_state`` wrote (or a file that an earlier
          release's ``save_state`` wrote).

        Raises
        ------
        CheckpointError
          If the path is not a training state, or does not fit the net; on
          every rank.

        """
        with quiet_unless_main(self.accelerator), self._coordinator.session("load_state"):
            self._coordinator.barrier("load_state")  # before initialize(), as in fit
            self._wait_for_writes_in_flight("load_state")
            if not self.initialized_:
                self.initialize()
            self._resume(os.fspath(storage.local(path)))

    def _resume(self, path: str) -> None:
        """``load_state`` once the net is initialized: ``resume.load``'s steps,
        the net unwrapped and prepared between them."""
        local, coordinator, objects = self._local, self._coordinator, self._objects
        local.loaded = None  # a load that fails halfway leaves no earlier load to go on from
        state = coordinator.run(
            lambda: read(self, path), what="load_state", files=path, io_timeout=self.io_timeout
        )
        # a net never prepared ends prepared, as initialize() leaves it
        was_wrapped = local.prepared.wrapped or not len(local.prepared)
        self._unwrap_accelerator()
        coordinator.run(functools.partial(restore_weights, objects, state, path), what="load_state")
        # prepare what is new (a scheduler a callback before ResumeTraining
        # built, before its state goes into the raw scheduler) and rewrap; at
        # train begin the callbacks set up on the unwrapped objects
        self._initialize_accelerator()
        if not was_wrapped:
            self._unwrap_accelerator()
        plan = coordinator.run(
            functools.partial(restore_training, self, objects, state, path), what="load_state"
        )
        del state  # before the wait: the largest object of the load
        local.loaded = plan  # the next fit goes on from it (fit_loop)
        coordinator.barrier("load_state")

    def wait_for_everyone(self, what: str = "wait_for_everyone") -> None:
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
