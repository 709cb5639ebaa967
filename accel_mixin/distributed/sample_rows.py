"""Rows of training data read so that chance has no say in them.

The replica check compares rows of ``X`` and ``y`` across the ranks when
training begins, and the run identity hashes rows of a ``Dataset``. A
Dataset that augments draws from Python's, NumPy's and torch's global
generators and from generators it holds, seeded per rank (as accelerate's
``set_seed(s, device_specific=True)`` does) or not at all: read as they
are, the same data gives other rows on every rank and in every launch, and
the reading takes draws from training.

So rows are read with every one of those generators set to a fixed seed,
and all of them put back afterwards (``fixed_random_state``). They are read
twice: rows that still differ draw from a source no seed reaches (a
generator made anew in ``__getitem__``, the operating system's entropy), and
are reported as unrepeatable (None) rather than compared or hashed.
"""

from __future__ import annotations

import contextlib
import random
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch

if TYPE_CHECKING:
    from typing import TypeGuard

__all__ = [
    "fixed_random_state",
    "generator_state",
    "generators_in",
    "is_generator",
    "repeatable_digest",
    "slot_names",
]

_SEED = 0  # the seed of every generator while rows are read
# how far generators_in looks into a Dataset's attributes (transforms in
# lists, their own attributes, closures)
_MAX_DEPTH = 8
_MAX_OBJECTS = 10_000
_LEAVES: tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes, np.ndarray)
_LEAVES += (torch.Tensor, type, types.ModuleType)

# the random generators whose state can be set
Generator = Union[np.random.RandomState, np.random.Generator, torch.Generator, random.Random]


def is_generator(value: object) -> TypeGuard[Generator]:
    """Whether ``value`` is a random generator whose state can be set."""
    return isinstance(value, (np.random.RandomState, np.random.Generator, torch.Generator)) or (
        isinstance(value, random.Random) and not isinstance(value, random.SystemRandom)
    )


def generator_state(generator: Generator) -> Any:
    """The state of a generator that ``is_generator`` accepts."""
    if isinstance(generator, np.random.RandomState):
        return generator.get_state(legacy=False)
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    return generator.getstate()


def _set_state(generator: Generator, state: Any) -> None:
    if isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, torch.Generator):
        generator.set_state(state)
    else:
        generator.setstate(state)


def _seed(generator: Generator) -> None:
    if isinstance(generator, np.random.Generator):
        bits = generator.bit_generator
        bits.state = type(bits)(_SEED).state
    elif isinstance(generator, torch.Generator):
        generator.manual_seed(_SEED)
    else:  # RandomState, random.Random
        generator.seed(_SEED)


def _children(value: Any) -> list[object]:
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    if isinstance(value, torch.nn.Module):
        return []  # parameters, not draws
    func = getattr(value, "func", None)  # functools.partial
    if func is not None and hasattr(value, "keywords"):
        return [func, *value.args, *value.keywords.values()]
    closure = getattr(value, "__closure__", None)
    if closure:
        cells: list[object] = []
        for cell in closure:
            with contextlib.suppress(ValueError):  # a cell not yet filled
                cells.append(cell.cell_contents)
        return cells
    attributes = getattr(value, "__dict__", None)
    children = list(attributes.values()) if isinstance(attributes, dict) else []
    return children + [
        getattr(value, name) for name in slot_names(type(value)) if hasattr(value, name)
    ]


def slot_names(cls: type) -> list[str]:
    """The names in the ``__slots__`` of ``cls`` and its bases."""
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return [name for name in names if name not in ("__dict__", "__weakref__")]


def generators_in(data: object) -> list[Generator]:
    """The random generators ``data`` holds, in its attributes, containers,
    transforms and closures, each once (by identity)."""
    found: dict[int, Generator] = {}
    seen: set[int] = set()
    stack = [(data, 0)]
    while stack and len(seen) < _MAX_OBJECTS:
        value, depth = stack.pop()
        if isinstance(value, _LEAVES) or id(value) in seen:
            continue
        seen.add(id(value))
        if is_generator(value):
            found[id(value)] = value
        elif depth < _MAX_DEPTH:
            stack.extend((child, depth + 1) for child in _children(value))
    return list(found.values())


@contextlib.contextmanager
def fixed_random_state(generators: Iterable[Generator] = ()) -> Iterator[None]:
    """Python's, NumPy's and torch's global CPU generators and ``generators``
    seeded with a constant, all put back as they were on leaving. CUDA's
    generators are left alone: a Dataset's rows are read on the CPU."""
    saved = [(generator, generator_state(generator)) for generator in generators]
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            random.seed(_SEED)
            np.random.seed(_SEED)
            torch.default_generator.manual_seed(_SEED)  # not CUDA's, as manual_seed would
            for generator, _ in saved:
                _seed(generator)
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)
            for generator, state in reversed(saved):  # one held twice: its first state
                _set_state(generator, state)


def repeatable_digest(data: object, read: Callable[[], Any], digest: Callable[[Any], Any]) -> Any:
    """``digest(read())`` under ``fixed_random_state`` with the generators
    ``data`` holds, or None where a second reading digests otherwise.

    Parameters
    ----------
    data : object
      What holds the generators the reading may draw from (the Dataset).

    read : callable
      Reads the rows, without arguments.

    digest : callable
      Turns the rows into a value that compares equal for equal rows.

    Returns
    -------
    digest : object or None
      The digest of the rows, or None where they are unrepeatable.
    """
    generators = generators_in(data)
    digests = []
    for _ in range(2):
        with fixed_random_state(generators):
            digests.append(digest(read()))
    return digests[0] if digests[0] == digests[1] else None
