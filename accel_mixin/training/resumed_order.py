"""The training data's order, saved and resumed.

The order comes from generators besides the global ones (the dataloader's
or its sampler's ``generator``, accelerate's ``synchronized_generator``):
each is saved and restored, by position in one list. Persistent workers
draw their base seed when the first iterator starts them, which a resumed
fit would do where the uninterrupted one drew nothing, so they start with
the generators put back afterwards. Inside an epoch, a resumed epoch draws
the indices of the batches done and skips them unread: exact where loading
a sample draws no random numbers (no random augmentation).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader

from accel_mixin.internals import batch_sampler_owner, start_persistent_iterator
from accel_mixin.training.rng import restore_rng, rng_state

__all__ = [
    "generator_states",
    "restore_generator_states",
    "resumable_inside_epochs",
    "skipping_batches",
    "start_workers_without_draws",
]

# how far to look through samplers wrapped in batch samplers (accelerate's
# shards, the batches skipped on resume)
_DEPTH = 4


def _base(dataloader: DataLoader) -> DataLoader:
    return getattr(dataloader, "base_dataloader", dataloader)


def _generators(dataloader: DataLoader) -> list[torch.Generator]:
    """The generators that decide ``dataloader``'s order and seeds, each once."""
    base = _base(dataloader)
    found = [getattr(dataloader, "synchronized_generator", None), getattr(base, "generator", None)]
    samplers = [getattr(base, "sampler", None), getattr(base, "batch_sampler", None)]
    for _ in range(_DEPTH):
        found += [getattr(sampler, "generator", None) for sampler in samplers]
        samplers = [
            getattr(sampler, name, None)
            for sampler in samplers
            for name in ("sampler", "batch_sampler")
        ]
    unique = {id(g): g for g in found if isinstance(g, torch.Generator)}
    return list(unique.values())


def generator_states(dataloader: DataLoader | None) -> list[torch.Tensor]:
    """The states of the generators of ``dataloader`` (None: none)."""
    if dataloader is None:
        return []
    return [generator.get_state() for generator in _generators(dataloader)]


def restore_generator_states(dataloader: DataLoader, states: list[torch.Tensor]) -> None:
    """Put back ``states`` (``generator_states`` of the same setup)."""
    generators = _generators(dataloader)
    if len(generators) == len(states):
        for generator, state in zip(generators, states):
            generator.set_state(state)


def start_workers_without_draws(dataloader: DataLoader) -> None:
    """Start the persistent workers of ``dataloader`` if they are not running,
    with every generator put back afterwards as it was."""
    base = _base(dataloader)
    if not (getattr(base, "persistent_workers", False) and getattr(base, "num_workers", 0)):
        return
    before, states = rng_state(), generator_states(dataloader)
    if start_persistent_iterator(base):
        restore_rng(before)
        restore_generator_states(dataloader, states)


def resumable_inside_epochs(train_iterator: DataLoader, explain: bool = False) -> bool:
    """Whether the training data of ``train_iterator`` (a running fit's) has
    batch indices to skip (map-style data); ``explain`` raises the
    ``ValueError`` that says why not."""
    if getattr(train_iterator, "keeps_state", False):
        return True  # a stream that records where it stops (streams.SplitStream)
    try:
        batch_sampler_owner(train_iterator)
    except ValueError:
        if explain:
            raise
        return False
    return True


class _SkipFirst:
    """A batch sampler that draws every batch of ``batch_sampler`` and
    yields all but the first ``skip``; everything else is the original's."""

    def __init__(self, batch_sampler: Iterable[list[int]], skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        batches = iter(self.batch_sampler)
        for _ in range(self.skip):
            if next(batches, None) is None:
                return
        yield from batches

    def __len__(self) -> int:
        # typed an Iterable, as torch types it: a DataLoader's batch sampler has a length
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "batch_sampler":
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


@contextmanager
def skipping_batches(dataloader: DataLoader, skip: int) -> Iterator[None]:
    """While the block runs, iterating ``dataloader`` (prepared by
    accelerate) skips its first ``skip`` batches without loading them."""
    if not skip:
        yield
        return
    owner = batch_sampler_owner(dataloader)
    original = owner.batch_sampler
    skipping = _SkipFirst(original, skip)
    # DataLoader refuses a new batch_sampler once built; the object lasts
    # the whole fit, so it is swapped for this epoch only
    object.__setattr__(owner, "batch_sampler", skipping)
    try:
        yield
    finally:
        object.__setattr__(owner, "batch_sampler", original)
        # persistent workers keep the sampler their iterator began with
        skipping.skip = 0
