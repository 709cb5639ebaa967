"""Every epoch's shuffled order in N processes, drawn as one process draws it.

A ``RandomSampler`` without a generator seeds a new one from the global
generator each time an epoch begins. accelerate gives it a generator instead
when it prepares the dataloader for several processes, seeded once, so N
processes and one would train on other orders from the same seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

__all__ = ["draw_orders_as_one_process", "keeping_global_draws", "shuffles_without_generator"]


class _SeededAsOneProcess:
    """A shuffling sampler whose generator accelerate made, seeded at the
    start of every epoch from the global generator, where and as a
    ``RandomSampler`` without a generator seeds itself in one process. The
    seed is rank 0's: ranks seeded apart still agree on the order."""

    def __init__(self, sampler: RandomSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[int]:
        seed = [int(torch.empty((), dtype=torch.int64).random_().item())]
        generator = self.sampler.generator
        assert generator is not None  # accelerate gave it one: draw_orders_as_one_process
        generator.manual_seed(broadcast_object_list(seed)[0])
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)


def shuffles_without_generator(dataloader: DataLoader | None) -> bool:
    """Whether ``dataloader`` shuffles with a generator of its own making."""
    sampler = getattr(dataloader, "sampler", None)
    return type(sampler) is RandomSampler and sampler.generator is None  # pylint: disable=unidiomatic-typecheck


def draw_orders_as_one_process(prepared: DataLoader) -> None:
    """Make ``prepared`` (the training dataloader of several processes, which
    ``shuffles_without_generator`` before accelerate prepared it) draw every
    epoch's order as one process draws it. accelerate seeds the generator it
    gives the sampler once, when it prepares it; one process seeds a new one
    every epoch. Without this, N processes and one see other orders."""
    batch_sampler = getattr(getattr(prepared, "batch_sampler", None), "batch_sampler", None)
    # exactly these: a SeedableRandomSampler (use_seedable_sampler) seeds itself
    sampler = getattr(batch_sampler, "sampler", None)
    if type(batch_sampler) is BatchSampler and type(sampler) is RandomSampler:  # pylint: disable=unidiomatic-typecheck
        batch_sampler.sampler = _SeededAsOneProcess(sampler)


@contextmanager
def keeping_global_draws(keep: bool = True) -> Iterator[None]:
    """With ``keep``, the global generator is as it was after the block: the
    seed accelerate draws for the generator it makes (reseeded every epoch
    here) is a draw one process never makes."""
    state = torch.get_rng_state() if keep else None
    try:
        yield
    finally:
        if state is not None:
            torch.set_rng_state(state)
