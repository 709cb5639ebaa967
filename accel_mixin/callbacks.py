"""Callbacks for resumable training: TrainingCheckpoint and ResumeTraining.

Use them together; running the same script again after a crash resumes by
itself::

    net = AcceleratedNet(
        MyModule, accelerator=Accelerator(), max_epochs=20,
        callbacks=[TrainingCheckpoint('ckpt'), ResumeTraining('ckpt')],
    )
    net.fit(X, y)  # after a crash: trains only the epochs that remain

"""

from __future__ import annotations

import os
import signal
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from accelerate.utils import gather_object
from skorch.callbacks import Callback

from accel_mixin.checkpoint import storage
from accel_mixin.checkpoint.atomic_files import remove_temporaries
from accel_mixin.checkpoint.dcp_folder import remove_partial_folders
from accel_mixin.checkpoint.folder_claim import claim, release
from accel_mixin.checkpoint.positions import (
    agreed_checkpoint,
    checkpoint_files,
    checkpoint_name,
    checkpoint_positions,
    describe_position,
    position_of,
)
from accel_mixin.checkpoint.v1_shards import remove_training_state
from accel_mixin.distributed.preemption import NoticeBoard, can_handle, handling_signals
from accel_mixin.distributed.process_layout import writes_files
from accel_mixin.errors import CheckpointError, Preempted
from accel_mixin.resume.runs import (
    check_run_name,
    differs_from_newest,
    find_run,
    fit_identity,
    read_manifest,
    run_folders,
    write_manifest,
)
from accel_mixin.training.notifications import stopped_early
from accel_mixin.training.resumed_order import resumable_inside_epochs

if TYPE_CHECKING:
    from skorch import NeuralNet
    from typing_extensions import Self

    from accel_mixin.net import AccelerateMixin
    from accel_mixin.resume.runs import RunIdentity
    from accel_mixin.training.fit import Fit

__all__ = ["ResumeTraining", "TrainingCheckpoint"]


class _RunCallback(Callback):
    """What the two callbacks share: they record the run, they do not
    change it (``runs``), and a training state keeps nothing of theirs."""

    in_run_identity = False
    _fit: Fit | None = None  # the running fit, within during_fit

    def state_dict(self) -> dict[str, Any]:
        return {}

    @contextmanager
    def during_fit(self, net: AccelerateMixin, fit: Fit) -> Iterator[None]:
        """``AccelerateMixin`` enters it around every ``fit`` and ``partial_fit``."""
        self._fit = fit
        try:
            yield
        finally:
            self._fit = None

    @property
    def _running(self) -> Fit:
        if self._fit is None:
            raise RuntimeError(
                f"{type(self).__name__} runs within a fit of a net with AccelerateMixin, "
                "which gives it the fit: call fit or partial_fit, not its methods."
            )
        return self._fit

    def __getstate__(self) -> dict[str, Any]:
        # a net pickled inside a fit (Checkpoint's f_pickle): the fit is this process's
        state = dict(self.__dict__)
        state.pop("_fit", None)
        return state

    def _check_net(self, net: NeuralNet) -> None:
        if not all(hasattr(net, n) for n in ("save_state", "load_state", "wait_for_everyone")):
            raise TypeError(
                f"{type(self).__name__} saves and loads training states with "
                f"AccelerateMixin.save_state and load_state, which {type(net).__name__} does "
                "not have: use it on a net with AccelerateMixin in front (in one process, "
                "Accelerator(cpu=True) will do), or use skorch's Checkpoint and LoadInitState."
            )


def _fit_identity(net: AccelerateMixin, X: Any, y: Any, fit: Fit) -> RunIdentity:
    names = {
        cb.run_name
        for _, cb in net.callbacks_
        if isinstance(cb, TrainingCheckpoint) and cb.run_name is not None
    }
    if len(names) > 1:
        raise ValueError(f"The net's TrainingCheckpoints name the run differently: {sorted(names)}")
    return fit_identity(net, X, y, fit, name=next(iter(names), None))


class TrainingCheckpoint(_RunCallback):
    """Save the whole training state at the end of epochs, for resuming.

    It runs after every other callback at an epoch's end, so the state is
    that of the finished epoch. Every fit is a run with an identity by
    content (hyperparameters that differ from their defaults, a hash of all
    of the data; ``accel_mixin.resume.runs``), and its files go to
    ``dirname/run-<id>/`` (``run-<run_name>-<id>/``) with a ``manifest.json``
    of the identity, the epochs saved and the run's status. The folder is
    created when the first epoch begins, once every callback's
    ``on_train_begin`` succeeded: a fit that fails before leaves none. Each
    state is one ``torch.distributed.checkpoint`` folder that every rank
    writes its part of (``save_state``), named after its epoch
    (``training-state-000012``) and renamed into place when complete, so
    ``ResumeTraining`` never picks a half-written one; the partial folders of
    killed saves are removed at the next save. Every rank must see the run
    folder: on several machines, a filesystem they share, or an object store.

    One job at a time writes a run folder: while its fit runs, the main
    process holds a lock on ``.accel_mixin-writer`` in it (the kernel drops
    it when the process ends), and a second job of the same run (a requeued
    job while the first still runs) raises a ``CheckpointError`` on every
    rank when its first epoch begins, naming the first job
    (``accel_mixin.checkpoint.folder_claim``).

    On a preemption notice (one of ``signals``, on any rank), every rank
    stops at the same batch (at the next optimizer step under gradient
    accumulation; at the epoch's end for a notice during its last batches or
    with an ``IterableDataset``), saves a training state there and raises
    ``accel_mixin.Preempted``, so that the script exits non-zero and the
    scheduler requeues it. The ranks poll about every half second and at
    least every 64 batches (``accel_mixin.distributed.preemption``).

    Parameters
    ----------
    dirname : str
      Folder of the run folders; created if needed. An fsspec URL
      (``s3://bucket/runs``) puts them on an object store, which machines
      without a shared filesystem all reach; there no lock keeps a second
      job out of a run folder (``docs/guide/object-storage.md``).

    every_n_epochs : int (default=1)
      Save after every ``every_n_epochs``-th epoch.

    every_n_batches : int or None (default=None)
      Also save after every ``every_n_batches``-th training batch of an
      epoch but its last (under gradient accumulation, at the next optimizer
      step), as ``training-state-<epoch>-batch-<batch>-ranks-<n>``, which
      resumes exactly there on as many processes. Needs map-style training
      data (an ``IterableDataset`` raises a ``ValueError``). None: epoch ends
      only.

    keep_last : int or None (default=2)
      How many of the run's states to keep, besides its newest state of an
      epoch's end; older ones are deleted once a new one is complete. None
      keeps all. Other runs' states are never deleted.

    asynchronous : bool (default=False)
      Save with ``torch.distributed.checkpoint.async_save`` (in every
      layout, FSDP2 included): training stops only while the state is copied
      to CPU memory and goes on while every rank writes its part, one save
      at a time: the next save and the end of training wait for it (at most
      ``io_timeout``), and a failed save raises on every rank there. A state
      saved on a notice is written synchronously.

    signals : tuple of int (default=(signal.SIGTERM,))
      The preemption notices handled while ``fit`` runs, e.g.
      ``(signal.SIGTERM, signal.SIGUSR1)`` for SLURM's ``--signal``; ``()``
      handles none. The previous handlers are back once ``fit`` returns or
      raises, and a notice after the last epoch goes to them then.

    run_name : str or None (default=None)
      A name for the run (letters, digits, ``.``, ``_``, ``-``), part of its
      identity and folder, which ``ResumeTraining(run=...)`` accepts. It
      stands for what the identity cannot describe by content: a named fit
      with such a value resumes, an unnamed one starts afresh every time.
      Fits that differ otherwise (other data) are runs of their own under
      the same name, each in its own folder.

    Attributes
    ----------
    run_ : accel_mixin.resume.runs.RunIdentity
      The identity of the run being trained.

    run_folder_ : str
      Where its files go.

    """

    def __init__(
        self,
        dirname: str | os.PathLike[str],
        every_n_epochs: int = 1,
        every_n_batches: int | None = None,
        keep_last: int | None = 2,
        asynchronous: bool = False,
        signals: Sequence[int] = (signal.SIGTERM,),
        run_name: str | None = None,
    ) -> None:
        self.dirname = dirname
        self.run_name = run_name
        self.every_n_epochs = every_n_epochs
        self.every_n_batches = every_n_batches
        self.keep_last = keep_last
        self.asynchronous = asynchronous
        self.signals = signals

    def initialize(self) -> Self:
        check_run_name(self.run_name)
        if self.every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be at least 1, got {self.every_n_epochs}")
        if self.every_n_batches is not None and self.every_n_batches < 1:
            raise ValueError(
                f"every_n_batches must be at least 1 or None, got {self.every_n_batches}"
            )
        self.signals = tuple(signal.Signals(signum) for signum in self.signals)
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 or None, got {self.keep_last}")
        # process-local, never part of a training state (no trailing _)
        self._notices: NoticeBoard | None = None
        # where to stop on a notice: False, "step", "now" or "epoch end"
        self._stop: bool | str = False
        self._folder_due = False  # the run folder is to be made at the next epoch's begin
        self._claimed: str | None = None  # the run folder this process holds (folder_claim)
        self._claiming = False  # this fit claimed it, on every rank
        self.run_: RunIdentity | None = None
        self.run_folder_: str | None = None
        return self

    def on_train_begin(
        self, net: AccelerateMixin, X: Any = None, y: Any = None, **kwargs: Any
    ) -> None:
        self._check_net(net)
        self.run_ = _fit_identity(net, X, y, self._running)
        dirname = storage.local(self.dirname)
        run_folders(dirname)  # a clear error where dirname is a file
        self.run_folder_ = storage.join(dirname, self.run_.folder)
        self._folder_due = True

    def on_epoch_begin(self, net: AccelerateMixin, **kwargs: Any) -> None:
        # not at train begin: a callback after this one may still fail
        # there, and an empty run folder left by a failed fit would be one
        # more run of its name. Once per fit: a folder removed later is an
        # error at the next save, not a new folder
        if not self._folder_due:
            return
        self._folder_due = False
        try:
            storage.makedirs(self._folder)
        except OSError as exc:
            raise CheckpointError(
                f"Cannot create the run folder {self.run_folder_} ({type(exc).__name__}: {exc}); "
                "give TrainingCheckpoint a dirname this process can write to."
            ) from exc
        self._claim(net)

    @property
    def _folder(self) -> str:
        """``run_folder_``, which ``on_train_begin`` sets before any use."""
        assert self.run_folder_ is not None, "on_train_begin sets the run folder"
        return self.run_folder_

    def _claim(self, net: AccelerateMixin) -> None:
        """Hold the run folder while this fit writes there; every rank raises
        where another live job writes there (its main process holds it)."""
        holder, self._claiming = None, True
        if net.accelerator.is_main_process:
            holder = claim(self._folder)
            if holder is None:
                self._claimed = self._folder
        if net.accelerator.num_processes > 1:
            net.wait_for_everyone("TrainingCheckpoint")  # each arrived: the gather is safe
            holder = next(filter(None, gather_object([holder])), None)
        if holder is not None:
            raise CheckpointError(
                f"TrainingCheckpoint: another job writes training states into "
                f"{self.run_folder_}: {holder}. Two jobs writing one run folder delete each "
                "other's states. Wait until that job ends, or stop it, then run this one "
                "again: ResumeTraining resumes from its newest state."
            )

    def _release(self) -> None:
        if self._claimed is not None:
            release(self._claimed)
            self._claimed = None

    @contextmanager
    def during_fit(self, net: AccelerateMixin, fit: Fit) -> Iterator[None]:
        """``AccelerateMixin`` enters it around every ``fit`` and
        ``partial_fit``: the preemption notices are handled meanwhile."""
        watching = can_handle(self.signals)
        self._notices = notices = NoticeBoard(net.accelerator, watching=watching)
        self._stop = False
        # whether the training data resumes inside epochs; known at the first batch
        self._inside: bool | None = None
        try:
            with super().during_fit(net, fit), handling_signals(self.signals, notices.note):
                yield
        finally:
            self._claiming = False
            self._release()  # the run folder, for the next job (also where fit raised)
        if notices.received is not None:
            # a notice that came too late to stop training: the previous
            # handler (the default ends the process) gets it after all
            signal.raise_signal(notices.received)

    def on_batch_finished(
        self, net: AccelerateMixin, training: bool = True, batches: int = 0, **kwargs: Any
    ) -> None:
        """After every training batch and every callback's ``on_batch_end``,
        with the epoch's training batches done: save if due, stop on a notice."""
        state = net.accelerator.gradient_state
        last, stepped = state.end_of_dataloader, state.sync_gradients
        if self._inside is None:
            train_iterator = self._running.running_train_iterator()
            self._inside = resumable_inside_epochs(train_iterator)
            if self.every_n_batches and not self._inside:
                resumable_inside_epochs(train_iterator, explain=True)
        # every rank asks, whatever its signals, for the all-reduces to match;
        # a notice at an epoch's last batch waits for the epoch's end
        notice = self._notices is not None and self._notices.agreed()
        if notice and (last or not self._inside):
            self._stop = "epoch end"
        elif notice or self._stop == "step":
            # between optimizer steps the gradients are half accumulated
            self._stop = "step" if not stepped else "now"
        steps = net.accelerator.gradient_accumulation_steps
        due = (
            self.every_n_batches
            and stepped
            and not last
            and batches // self.every_n_batches > (batches - steps) // self.every_n_batches
        )
        stop = self._stop == "now"
        if due or stop:
            self._save(
                net, len(net.history) - 1, batches, asynchronous=self.asynchronous and not stop
            )
        if stop:
            self._preempted(net, f"after training batch {batches} of epoch {len(net.history)}")

    def on_epoch_finished(self, net: AccelerateMixin, stopped: bool = False, **kwargs: Any) -> None:
        """Once an epoch is over and agreed on every rank (after every
        ``on_epoch_end``): save it if due; ``stopped``: ``EarlyStopping`` ends here."""
        epoch = len(net.history)
        # notices that came during the last batches, validation or the end
        if self._notices is not None and self._notices.agreed(drain=True, batch=False):
            self._stop = "epoch end"
        stop = self._stop == "epoch end"
        if stop or not epoch % self.every_n_epochs:
            self._save(net, epoch, 0, asynchronous=self.asynchronous and not stop, stopped=stopped)
        if stop:
            self._preempted(net, f"at the end of epoch {epoch}")

    def _save(
        self,
        net: AccelerateMixin,
        epoch: int,
        batch: int,
        asynchronous: bool,
        stopped: bool = False,
    ) -> None:
        name = checkpoint_name(epoch, batch, net.accelerator.num_processes)
        path = storage.join(self._folder, name)
        net.save_state(path, asynchronous=asynchronous, on_written=self._written, stopped=stopped)

    def _preempted(self, net: AccelerateMixin, where: str) -> None:
        notices = self._notices
        assert notices is not None, "only a notice that during_fit's board agreed on preempts"
        notices.close()
        received, notices.received = notices.received, None  # acted on
        net.wait_for_saves()
        if writes_files(net.accelerator):
            self._write_manifest("preempted")
        self._give_up(net)
        name = signal.Signals(received).name if received else "a signal to another rank"
        raise Preempted(
            f"Preempted (notice: {name}): training stopped {where}, and its state is saved in "
            f"{self.run_folder_}. Run the same script again to resume there (ResumeTraining)."
        )

    def _written(self) -> None:
        """On the writing process, once a file is complete."""
        folder = self._folder
        # of killed saves, whose names were this run's (the folder claim: no other job's)
        remove_temporaries(folder)
        remove_partial_folders(folder)
        if self.keep_last is not None:
            ends = [
                path
                for (_, batch), path in sorted(checkpoint_positions(folder).items())
                if not batch
            ]
            for path in checkpoint_files(folder)[: -self.keep_last]:
                if ends and path == ends[-1]:
                    continue  # the newest epoch's end resumes on any number of processes
                remove_training_state(path)
        self._write_manifest("running")

    def _write_manifest(self, status: str) -> None:
        assert self.run_ is not None, "on_train_begin sets the run"
        write_manifest(self._folder, self.run_, checkpoint_positions(self._folder), status)

    def on_train_end(self, net: AccelerateMixin, **kwargs: Any) -> None:
        if self._notices is not None:
            self._notices.close()
        if self.asynchronous:
            net.wait_for_saves()
        self._record_end(net)
        self._give_up(net)

    def _give_up(self, net: AccelerateMixin) -> None:
        """Give the run folder up; every rank returns from fit once it is,
        so that none sees the marker afterwards."""
        if self._claiming:
            self._claiming = False
            self._release()
            if net.accelerator.num_processes > 1:
                net.wait_for_everyone("TrainingCheckpoint")

    def _record_end(self, net: AccelerateMixin) -> None:
        if self.run_ is None or not writes_files(net.accelerator):
            return
        if self._folder_due and not storage.isdir(self._folder):
            return  # no epoch began and nothing resumed: no run to record
        if stopped_early(net.callbacks_):
            status = "stopped early"
        elif len(net.history) >= net.max_epochs:
            status = "finished"
        else:
            status = "interrupted"
        self._write_manifest(status)


class ResumeTraining(_RunCallback):
    """Resume the run from its latest complete training state, if it has one.

    At the start of training, computes the run's identity as
    ``TrainingCheckpoint`` does and loads the newest complete file in the
    run's folder; ``fit`` then trains only the epochs that remain up to
    ``max_epochs`` (none after ``EarlyStopping``), and one line names the
    file and the position it continues after. A fit with other data or
    hyperparameters (another fold, another candidate of a search) is another
    run and starts afresh, and one line says what differs from the newest
    run in the folder (another run's, or states outside run folders). A
    warning on the main process says where the net's ``TrainingCheckpoint``
    writes to another folder (a rerun would never resume this fit), and
    where the net has none and nothing was resumed (the callback did
    nothing). A fit with a value that the identity cannot describe by
    content and no ``run_name`` is never resumed, and a warning on the main
    process says which value, once. Where machines keep their own
    copies (``save_on_each_node``), every rank resumes from the newest epoch
    that all of them have, and all raise a ``CheckpointError`` if some have
    files and others none of those.

    Parameters
    ----------
    dirname : str
      The folder ``TrainingCheckpoint`` writes to.

    run : str or None (default=None)
      To continue another run deliberately, say with a changed learning
      rate: the id of that run, its name (``TrainingCheckpoint(run_name=...)``)
      or the name of its folder without ``run-``. While this run has no
      training state of its own, training starts from the newest state of
      that run; its checkpoints go to this run's own folder, so a rerun
      after a crash resumes this run. The name this fit's own
      ``TrainingCheckpoint`` gives names this fit's own run (a fit on other
      data under that name starts afresh, as a run of its own); a name that
      several other runs share raises: pass the id of one of them.

    sink : callable (default=print)
      Where the line about what training resumed from, or about a new run
      next to other runs' states, goes: on the main process only, and
      nowhere when the net's ``verbose`` is 0.

    Attributes
    ----------
    resumed_from_ : str or None
      The training state training resumed from, if any.

    """

    def __init__(
        self,
        dirname: str | os.PathLike[str],
        run: str | None = None,
        sink: Callable[[str], object] = print,
    ) -> None:
        self.dirname = dirname
        self.run = run
        self.sink = sink

    def initialize(self) -> Self:
        self.resumed_from_: str | None = None
        return self

    def on_train_begin(
        self, net: AccelerateMixin, X: Any = None, y: Any = None, **kwargs: Any
    ) -> None:
        self._check_net(net)
        identity = _fit_identity(net, X, y, self._running)
        dirname = storage.local(self.dirname)
        runs = run_folders(dirname)
        own = storage.join(dirname, identity.folder)
        if identity.key in runs:
            read_manifest(own)  # a clear error where it was edited
        source = None  # the other run this one continues, if any
        if self.run is not None:
            wanted = find_run(runs, self.run, own=identity)
            if wanted is None:
                raise CheckpointError(
                    f"ResumeTraining(run={self.run!r}): {self.dirname} holds no run {self.run} "
                    f"(it holds {sorted(runs) or 'none'}); pass the id or the name of one of "
                    "them, or the name of its folder without 'run-'."
                )
            if wanted != identity.key:
                source = runs[wanted]
                read_manifest(source)
        if identity.refused and identity.name is None and net.accelerator.is_main_process:
            # the same text for every such fit: Python shows it once
            warnings.warn(
                f"ResumeTraining: {identity.refused}; the run identity cannot describe it by "
                "content, so such a fit is never resumed: it starts afresh in a run of its own. "
                "Give the value get_params or plain attributes, or name the run "
                "(TrainingCheckpoint(run_name=...)) to resume it.",
                RuntimeWarning,
                stacklevel=2,
            )
        if net.accelerator.is_main_process:
            self._check_writer(net)
        # every rank gets here before the ranks compare their files, or
        # raises if a callback before this one failed on some rank
        net.wait_for_everyone("ResumeTraining")
        path, what = agreed_checkpoint(own, net.accelerator), f"resuming run {identity.key}"
        if path is None and source is not None:
            path = agreed_checkpoint(source, net.accelerator)
            what = f"run {identity.key} continues run {wanted}"
        if path is not None:
            net.load_state(path)
            self.resumed_from_ = path
            if self._speaks(net):
                position = position_of(path)
                assert position is not None, "agreed_checkpoint gives training-state names"
                where = describe_position(position)

                self.sink(f"ResumeTraining: {what} from {path} (after {where})")
            return
        if net.accelerator.is_main_process and not self._writers(net):
            warnings.warn(
                f"ResumeTraining: {self.dirname} holds no training state of this fit's run, "
                "and the net has no TrainingCheckpoint: nothing is resumed, and no state is "
                "saved for a rerun to resume. Add TrainingCheckpoint with the same dirname to "
                "the callbacks.",
                UserWarning,
                stacklevel=2,
            )
        # not for a fit that is never resumed: a warning said why
        if self._speaks(net) and not identity.described.get("unique"):
            line = _fresh_start(identity, dirname, runs)
            if line:
                self.sink(line)

    @staticmethod
    def _speaks(net: AccelerateMixin) -> bool:
        return net.verbose and net.accelerator.is_main_process

    @staticmethod
    def _writers(net: NeuralNet) -> list[TrainingCheckpoint]:
        return [cb for _, cb in net.callbacks_ if isinstance(cb, TrainingCheckpoint)]

    def _check_writer(self, net: NeuralNet) -> None:
        """Warn where the net's TrainingCheckpoints write elsewhere: a rerun
        would then never resume what this fit saves (a misspelt folder)."""
        written = sorted({os.fspath(cb.dirname) for cb in self._writers(net)})
        if written and _same_folder(self.dirname) not in {_same_folder(d) for d in written}:
            warnings.warn(
                f"ResumeTraining resumes from {self.dirname}, but the net's TrainingCheckpoint "
                f"writes to {', '.join(written)}: a rerun never resumes what this fit saves. "
                "Give both the same dirname.",
                UserWarning,
                stacklevel=3,
            )


def _same_folder(dirname: str | os.PathLike[str]) -> str:
    dirname = storage.local(dirname)
    if storage.is_url(dirname):
        return str(dirname).rstrip("/")
    return os.path.normcase(os.path.realpath(os.fspath(dirname)))


def _fresh_start(
    identity: RunIdentity, dirname: str | os.PathLike[str], runs: Mapping[str, str]
) -> str | None:
    """The line of a run that starts afresh next to other runs' training
    states (run folders, or files outside them), or None."""
    others = {key: folder for key, folder in runs.items() if key != identity.key}
    loose = checkpoint_files(dirname)
    line = f"ResumeTraining: run {identity.key} starts afresh in {dirname}"
    if others:
        line += f", next to {len(others)} other run(s); {differs_from_newest(identity, others)}"
    if loose:
        line += (
            f"; the {len(loose)} training state(s) there outside run folders were written "
            "before run folders existed and are never resumed (load one with "
            "net.load_state(path))"
        )
    return line if others or loose else None
