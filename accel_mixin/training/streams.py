"""Streams (an ``IterableDataset``) on several processes: which kind a stream
is, and the steps of one that splits itself by rank.

A plain stream yields the same samples on every process. accelerate shares
it: by default the main process reads every batch and sends each rank its
part (``dispatch_batches``); with ``dispatch_batches=False`` each rank reads
the whole stream and keeps its part. A stream that splits itself by rank
(``datasets.distributed.split_dataset_by_node``, webdataset's
``split_by_node``, an ``__iter__`` that reads the rank) yields each rank its
own samples. Shared again, it would lose all but one rank's share: it is used
as it is, each rank reading its own.

Which kind a stream is, is seen rather than declared: when a fit (or a
prediction) begins, each rank takes its stream's first sample (from a copy), with every
random generator seeded alike so that random augmentation draws alike, and
the ranks compare fingerprints in one gather. All alike: plain. All
different: it splits itself. Some alike and some not: refused, naming the
ranks, since two ranks would train on the same samples.

A stream that splits itself may give the ranks different numbers of batches,
and DDP needs every rank to take every step. Each step the ranks sum, in one
all-reduce of a few integers on the control group, whether they hold a batch,
its samples, and whether one follows; each rank reads two batches ahead, so
that the next step's sum runs while this one trains. A rank whose stream ended trains its
last batch again with weight 0 until the others end, and each rank weighs
its loss by its share of the step's samples (``shares.py``), so that a
partial step trains on the mean over its real samples. A plain stream
that every rank reads whole (``dispatch_batches=False``) takes these steps
too, each rank keeping its batches: accelerate's ``IterableDatasetShard``
fills the last batch with samples from the start, which would train as real
ones, since a stream's length is not known. torch's ``Join`` does
the per-step all-reduce for DDP alone and divides by all the ranks; this
weighs the real samples and works under FSDP2 as well.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from accelerate.data_loader import _PYTORCH_DATALOADER_KWARGS, DataLoaderStateMixin
from accelerate.state import GradientState
from accelerate.utils import send_to_device, slice_tensors, synchronize_rng_states
from torch.utils.data import DataLoader, IterableDataset

from accel_mixin.distributed.sample_rows import fixed_random_state, generators_in
from accel_mixin.training.shares import samples_in

if TYPE_CHECKING:
    from accelerate import Accelerator

    from accel_mixin.distributed.control import Control

__all__ = [
    "SplitStream",
    "fingerprint",
    "is_stream",
    "keeps_state",
    "prepare_stream",
    "stream_kind",
    "stream_position",
]

_EMPTY = -1  # the fingerprint of a stream without samples
_NOTHING = object()
_ENDED = (None, None, None)  # after a stream's last batch (a batch is never None)
_STEP = "a step of a stream that splits itself by rank"


def is_stream(dataloader: DataLoader) -> bool:
    """Whether ``dataloader`` iterates an ``IterableDataset``."""
    return isinstance(getattr(dataloader, "dataset", None), IterableDataset)


def keeps_state(dataset: object) -> bool:
    """Whether ``dataset`` gives and takes its position (torch's ``Stateful``:
    ``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


def fingerprint(sample: Any) -> int:
    """A checksum of ``sample``'s values, the same in every process: tensors
    and arrays by their bytes, nested in tuples, lists, dicts and sets;
    numbers, strings and bytes by value; anything else by its pickle.
    ``TypeError`` for a value that has none of these the same everywhere."""
    if sample is _NOTHING:
        return _EMPTY
    if sample is None or isinstance(sample, (bool, int, float, complex, str, bytes)):
        return zlib.crc32(repr(sample).encode())
    if isinstance(sample, torch.Tensor):
        sample = (
            sample.detach().cpu().numpy()
            if sample.dtype != torch.bfloat16
            else sample.float().numpy()
        )
    if isinstance(sample, np.ndarray):
        head = f"{sample.dtype}{sample.shape}".encode()
        return zlib.crc32(np.ascontiguousarray(sample).tobytes(), zlib.crc32(head))
    if isinstance(sample, dict):
        return zlib.crc32(repr([(repr(k), fingerprint(v)) for k, v in sample.items()]).encode())
    if isinstance(sample, (tuple, list)):
        return zlib.crc32(repr([fingerprint(value) for value in sample]).encode())
    if isinstance(sample, (set, frozenset)):  # in an order each process's hash seed picks
        return zlib.crc32(repr(sorted(fingerprint(value) for value in sample)).encode())
    try:
        return zlib.crc32(pickle.dumps(sample, protocol=4))
    except Exception as exc:  # pylint: disable=broad-except
        raise TypeError(
            f"A sample of the stream holds a {type(sample).__name__}, which neither pickles "
            "nor compares by value, so the ranks cannot see whether they read the same "
            "samples. Yield tensors, arrays, numbers or strings."
        ) from exc


def _first_sample_print(dataset: IterableDataset) -> int:
    """The fingerprint of the first sample ``dataset`` yields on this rank,
    read from a shallow copy, so that what its iterator sets on the dataset
    (a position, a counter) stays on the copy; a dataset that keeps a state
    (``state_dict``) gets it back afterwards too."""
    kept = copy.deepcopy(dataset.state_dict()) if keeps_state(dataset) else None  # type: ignore[attr-defined]
    try:
        probe = copy.copy(dataset)
    except Exception:  # pylint: disable=broad-except
        probe = dataset  # one that cannot be copied is read itself
    samples = iter(probe)
    try:
        with fixed_random_state(generators_in(probe)):
            return fingerprint(next(samples, _NOTHING))
    finally:
        # a generator's own cleanup runs now, not when it is collected later
        close = getattr(samples, "close", None)
        if callable(close):
            close()
        if kept is not None:
            dataset.load_state_dict(kept)  # type: ignore[attr-defined]


def _kind(prints: Sequence[int]) -> str | None:
    """ "plain", "split", or None where the ranks neither all agree nor all
    differ (a rank without samples agrees with none)."""
    found = [p for p in prints if p != _EMPTY]
    if not found or (len(found) == len(prints) and len(set(found)) == 1):
        return "plain"
    return "split" if len(set(found)) == len(found) else None


def stream_kind(
    accelerator: Accelerator, dataset: IterableDataset, control: Control, training: bool
) -> str:
    """ "split" where the stream ``dataset`` splits itself by rank, else
    "plain", seen on every rank in one gather (see the module's docstring);
    ``ValueError`` where it cannot be used as it is."""
    prints = [p for (p,) in control.gather("which kind of stream", [_first_sample_print(dataset)])]
    kind = _kind(prints)
    name = type(dataset).__name__
    if kind is None:
        alike = sorted(
            {rank for rank, p in enumerate(prints) if prints.count(p) > 1 and p != _EMPTY}
        )
        raise ValueError(
            f"The stream {name} gives ranks {', '.join(map(str, alike))} the same first sample "
            "and other ranks other samples: it neither yields the same samples on every rank "
            "(a plain stream, which accelerate shares) nor splits itself by rank (each rank "
            "its own), so two ranks would train on the same samples. Split it by "
            "torch.distributed.get_rank() and get_worldsamples_in() on every rank, or not at all."
        )
    if kind == "plain":
        return kind
    if not training:
        raise ValueError(
            f"The stream {name} splits itself by rank (each rank's first sample differs), so "
            "the predictions of several processes would come back in no defined order. "
            "Predict and validate from a plain stream (the same samples on every rank), which "
            "accelerate shares, or from a Dataset."
        )
    for setting, value in (("dispatch_batches", True), ("split_batches", True)):
        if getattr(accelerator, setting, None) is value:
            raise ValueError(
                f"The stream {name} splits itself by rank (each rank's first sample differs), "
                f"and DataLoaderConfiguration({setting}=True) would share it again: "
                + (
                    "the main process would read its own share alone, and the other ranks' "
                    "shares would never be read. "
                    if setting == "dispatch_batches"
                    else "each rank would take a part of batches that hold its share only. "
                )
                + f"Leave {setting} at its default with a stream that splits itself."
            )
    return kind


class SplitStream(DataLoaderStateMixin):
    """A stream's training ``DataLoader`` where every rank takes the same
    number of steps, and which resumes inside an epoch where it keeps state.

    Each rank iterates ``dataloader`` and moves its batches to the
    accelerator's device. ``real`` and ``weight`` say, for the batch just
    yielded, how many of its samples are real (0 where the rank's stream has
    ended and its last batch runs again) and the weight of its mean loss;
    ``counted``, whether the history counts it as a batch of the data.
    ``kept``: None for all of the rank's batches (a stream that splits
    itself, or one process); ``"batches"`` for a plain stream that every rank
    reads whole, keeping the batches ``rank, rank + N, ...``; ``"parts"`` for
    the same with ``split_batches``, keeping the rank's part of every batch.
    The engine's ``DataLoaderStateMixin`` tells accelerate's gradient
    accumulation where the epoch ends: at the step every rank agrees is the
    last.

    Where ``dataloader`` is torchdata's ``StatefulDataLoader``,
    ``state_dict()`` is where the batch just yielded leaves it (taken before
    the next one is read ahead), and ``load_state_dict`` makes the next
    iteration go on from there, reading nothing twice.
    """

    def __init__(
        self,
        dataloader: DataLoader,
        accelerator: Accelerator,
        control: Control,
        kept: str | None = None,
    ) -> None:
        self.base_dataloader = dataloader
        self.kept = kept
        self.keeps_state = keeps_state(dataloader)
        self.dataset = dataloader.dataset
        self.batch_size = dataloader.batch_size
        self.gradient_state = GradientState()
        self.device, self.non_blocking = accelerator.device, bool(accelerator.non_blocking)
        self.rank, self.processes = accelerator.process_index, accelerator.num_processes
        self.control = control
        self.iteration = 0
        self.real, self.weight, self.counted = 0, 1.0, False
        self._state: dict[str, Any] | None = None  # after the batch just yielded
        self._before: dict[str, Any] | None = None  # before the last batch held
        self._pending: dict[str, Any] | None = None  # where the next iteration goes on
        self.rng_types = list(accelerator.rng_types or [])

    def state_dict(self) -> dict[str, Any] | None:
        """Where the batch just yielded leaves this rank's stream (None
        before any, or where it keeps no state)."""
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (a ``state_dict()``) when next iterated."""
        self._pending = state

    def set_epoch(self, epoch: int) -> None:
        """Tell the dataset the epoch, where it takes one, as accelerate does."""
        self.iteration = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def begin(self) -> None:
        # a stream's length, where it has one, says nothing of its steps here
        self.reset()
        self.gradient_state._add_dataloader(self)  # pylint: disable=protected-access

    def __iter__(self) -> Iterator[Any]:
        self.begin()
        self.set_epoch(self.iteration)
        if self.kept is not None:
            # every rank reads the whole stream: its order drawn alike, as
            # accelerate's own loaders draw it (rng_types, the dataset's generator)
            generator = getattr(self.dataset, "generator", None)
            # as prepare_data_loader does: "generator" only where there is one
            types = [t for t in self.rng_types if str(t) != "generator" or generator is not None]
            synchronize_rng_states(types, generator)
        resumed, batches = self._pending, self._batches()
        last = None
        if resumed is not None and resumed.get("ended"):
            # this rank's stream had ended: its last batch, read again, pads;
            # read to its end, as the uninterrupted run's stream was
            last = send_to_device(next(batches)[0], self.device, non_blocking=self.non_blocking)
            for _ in batches:
                pass
            self._state = resumed
        # this rank's batches k, k + 1 and k + 2 with their positions: the
        # ranks sum step k + 1's counts while step k trains
        window = [next(batches, _ENDED), next(batches, _ENDED)]
        counts = self._counts(window, first=last is None)()
        try:
            while True:
                holding, samples, more, stuck = counts
                if not holding:
                    break
                if stuck:
                    raise ValueError(
                        f"The stream {type(self.dataset).__name__} gave {stuck} of "
                        f"{self.processes} ranks no batch in this epoch while the others had "
                        "some: a rank needs a batch of its own to take the others' steps. Give "
                        "every rank a share of at least one sample."
                    )
                (current, after, before), real = window[0], 0
                if current is not None:
                    last = send_to_device(current, self.device, non_blocking=self.non_blocking)
                    real, self._state, self._before = samples_in(current), after, before
                elif self._state is not None and not self._state.get("ended"):
                    # a resume reads the last batch again, to pad with it
                    self._state = dict(self._before or {}, ended=True)
                following = None
                if more:  # the next step's counts, summed while this one trains
                    window.append(next(batches, _ENDED) if window[1][0] is not None else _ENDED)
                    following = self._counts(window[1:])
                self.real, self.weight = real, real * self.processes / samples
                # with split_batches a batch of the data is every rank's part
                self.counted = bool(real) and (self.kept != "parts" or self.rank == 0)
                self.end_of_dataloader = not more
                yield last
                if following is None:
                    break
                counts, window = following(), window[1:]
            self.iteration += 1
        finally:
            self._state = None
            self.end()

    def _counts(
        self, window: list[tuple[Any, Any, Any]], first: bool = False
    ) -> Callable[[], list[int]]:
        """Start summing, over the ranks, whether each holds the batch
        ``window[0]``, its samples, whether ``window[1]`` follows, and, at an
        epoch's first step, whether it holds none: after that step every
        rank has a batch to run again."""
        batch, following = window[0][0], window[1][0]
        held = batch is not None
        return self.control.total(
            _STEP,
            [held, samples_in(batch) if held else 0, following is not None, first and not held],
        )

    def _batches(self) -> Iterator[tuple[Any, dict[str, Any] | None, dict[str, Any] | None]]:
        """This rank's batches, each with where it leaves the stream and
        where the stream was before it (where it keeps state)."""
        loader, start, self._pending = self.base_dataloader, self._pending, None
        index = 0  # of the batch read next, in the stream's whole order
        if start is not None and start["loader"] is not None:
            loader.load_state_dict(start["loader"])  # type: ignore[attr-defined]
        if start is not None:
            index = start["next"]
        before: dict[str, Any] | None = {"loader": None, "next": index} if start is None else start
        part = slice(
            self.rank * (self.batch_size or 0) // self.processes,
            (self.rank + 1) * (self.batch_size or 0) // self.processes,
        )
        for batch in loader:
            index += 1
            if self.kept == "batches" and (index - 1) % self.processes != self.rank:
                continue
            if self.kept == "parts":
                batch = slice_tensors(batch, part)
                if not samples_in(batch):
                    continue
            after = None
            if self.keeps_state:
                where = loader.state_dict()  # type: ignore[attr-defined]
                after = {"loader": copy.deepcopy(where), "next": index}
            yield batch, after, before
            before = after

    def __getattr__(self, name: str) -> Any:
        # what a DataLoader has and this lacks (num_workers, collate_fn, ...)
        if name == "base_dataloader":
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)


def stream_position(
    train_iterator: object, position: tuple[int, int] | None
) -> dict[str, Any] | None:
    """Where this rank's stream stopped, for a state saved inside an epoch
    (``position``), or None: at an epoch's end, or where the training data
    is no stream."""
    if position is None or not isinstance(train_iterator, SplitStream):
        return None
    return train_iterator.state_dict()


def _stateful(dataloader: DataLoader) -> DataLoader:
    """``dataloader`` as torchdata's ``StatefulDataLoader``, with its settings."""
    try:
        from torchdata.stateful_dataloader import (  # pylint: disable=import-outside-toplevel
            StatefulDataLoader,
        )
    except ImportError as exc:
        raise ImportError(
            f"Saving a training state inside an epoch of the stream "
            f"{type(dataloader.dataset).__name__} needs torchdata's StatefulDataLoader, which "
            "records where the stream stopped: pip install torchdata (or "
            "accel_mixin[streams])."
        ) from exc
    if isinstance(dataloader, StatefulDataLoader):
        return dataloader
    if type(dataloader) is not DataLoader:
        raise TypeError(
            f"The stream {type(dataloader.dataset).__name__} is read by "
            f"{type(dataloader).__name__}, and recording where it stopped needs torchdata's "
            "StatefulDataLoader, which would drop what that class adds. Give "
            "iterator_train=StatefulDataLoader (or a subclass of it), or torch's DataLoader."
        )
    # the DataLoader's settings that this torchdata takes (torch's in_order came later)
    takes = inspect.signature(StatefulDataLoader.__init__).parameters
    settings = {
        key: getattr(dataloader, key)
        for key in (*_PYTORCH_DATALOADER_KWARGS, "in_order")
        if key in takes
        and hasattr(dataloader, key)
        and key not in ("shuffle", "sampler", "batch_sampler", "drop_last", "batch_size")
    }
    with warnings.catch_warnings():
        # torchdata calls torch.set_vital, which torch 2.13 deprecates: noise on every rank
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        stateful = StatefulDataLoader(
            dataloader.dataset,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **settings,
        )
    return cast(DataLoader, stateful)


def prepare_stream(
    accelerator: Accelerator,
    dataloader: DataLoader,
    control: Control,
    training: bool,
    inside_epochs: bool,
) -> SplitStream | None:
    """The ``SplitStream`` that a stream's ``dataloader`` runs as, or None
    where accelerate prepares it (not a stream; a plain stream that it
    shares). ``inside_epochs``: training states are saved inside epochs, so
    that the stream must record where it stops; ``ValueError`` where it
    cannot (see the module's docstring)."""
    if not is_stream(dataloader):
        return None
    dataset = cast(IterableDataset, dataloader.dataset)
    stateful = training and (inside_epochs or bool(accelerator.use_stateful_dataloader))
    if stateful and not keeps_state(dataset):
        if not inside_epochs:
            stateful = False  # use_stateful_dataloader without a place to keep state
        else:
            raise ValueError(
                f"Training states inside an epoch of the stream {type(dataset).__name__} need "
                "it to give and take its position: it has no state_dict() and "
                "load_state_dict(state) (torch's Stateful protocol). Add them (the position "
                "in its files, its shuffle buffer's generator), or save at epoch ends only "
                "(TrainingCheckpoint(every_n_batches=None))."
            )
    loader = _stateful(dataloader) if stateful else dataloader
    if accelerator.num_processes == 1:
        return SplitStream(loader, accelerator, control) if stateful else None
    kind = stream_kind(accelerator, dataset, control, training)
    if kind == "split":
        return SplitStream(loader, accelerator, control)
    if not training or not (stateful or accelerator.dispatch_batches is False):
        return None  # accelerate shares it
    if accelerator.dispatch_batches:
        raise ValueError(
            f"The stream {type(dataset).__name__} is saved inside epochs, and with "
            "DataLoaderConfiguration(dispatch_batches=True) the main process reads it ahead "
            "for every rank, so no rank can record where it stopped. Leave dispatch_batches "
            "at its default: every rank then reads the stream and keeps its own batches."
        )
    if accelerator.split_batches and not dataloader.batch_size:
        raise ValueError(
            f"With DataLoaderConfiguration(split_batches=True) each rank takes its part of "
            f"every batch of the stream {type(dataset).__name__}, whose DataLoader has no "
            "batch_size (batch_size=None: the stream yields whole batches), so the parts "
            "are unknown. Give the DataLoader a batch_size, or leave split_batches off."
        )
    kept = "parts" if accelerator.split_batches else "batches"
    return SplitStream(loader, accelerator, control, kept)
