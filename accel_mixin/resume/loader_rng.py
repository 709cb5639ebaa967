"""The random numbers a dataloader draws: saved with a training state, and
not drawn twice when a resumed fit starts persistent workers.

A dataloader's order comes from generators besides the global ones: the
``generator`` given to it (``iterator_train__generator``) or to its sampler,
and accelerate's ``synchronized_generator`` on several processes. Each is
saved and restored with the training state, by position in one list.

A dataloader with ``persistent_workers`` draws its workers' base seed once,
when its first iterator starts the workers: an uninterrupted fit draws at
its first epoch, a resumed fit at its first resumed epoch, where the
uninterrupted one drew nothing, which would shift every random number after
it (the order of the next epochs, dropout). A resumed fit therefore starts
such workers with the generators put back as they were: the base seed
differs from the uninterrupted run's, which only random numbers drawn
inside the workers could show, and those continue from epoch to epoch in
persistent workers, so they cannot be resumed anyway.
"""

import torch

from accel_mixin.checkpoint.state_values import restore_rng, rng_state
from accel_mixin.internals import start_persistent_iterator

__all__ = ["generator_states", "restore_generator_states", "start_workers_without_draws"]

# how far to look through samplers wrapped in batch samplers (accelerate's
# shards, the batches skipped on resume)
_DEPTH = 4


def _base(dataloader):
    return getattr(dataloader, "base_dataloader", dataloader)


def _generators(dataloader):
    """The generators that decide ``dataloader``'s order and seeds, each once."""
    found = [getattr(dataloader, "synchronized_generator", None)]
    base = _base(dataloader)
    found.append(getattr(base, "generator", None))
    samplers = [getattr(base, "sampler", None), getattr(base, "batch_sampler", None)]
    for _ in range(_DEPTH):
        found += [getattr(sampler, "generator", None) for sampler in samplers]
        samplers = [
            getattr(sampler, name, None)
            for sampler in samplers
            for name in ("sampler", "batch_sampler")
        ]
    seen, generators = set(), []
    for generator in found:
        if isinstance(generator, torch.Generator) and id(generator) not in seen:
            seen.add(id(generator))
            generators.append(generator)
    return generators


def generator_states(dataloader):
    """The states of the generators of ``dataloader`` (None: none)."""
    if dataloader is None:
        return []
    return [generator.get_state() for generator in _generators(dataloader)]


def restore_generator_states(dataloader, states):
    """Put back ``states`` (``generator_states`` of the same setup)."""
    generators = _generators(dataloader)
    if len(generators) == len(states):
        for generator, state in zip(generators, states):
            generator.set_state(state)


def start_workers_without_draws(dataloader):
    """Start the persistent workers of ``dataloader`` if they are not running,
    with every generator put back afterwards as it was."""
    base = _base(dataloader)
    if not (getattr(base, "persistent_workers", False) and getattr(base, "num_workers", 0)):
        return
    before, states = rng_state(), generator_states(dataloader)
    if start_persistent_iterator(base):
        restore_rng(before)
        restore_generator_states(dataloader, states)
