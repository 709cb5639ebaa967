"""Rows read so that chance has no say: the same rows whatever the seeds,
no draw taken from training, and rows that no seed reaches told apart."""

import functools
import random

import numpy as np
import torch

from accel_mixin.distributed.replicas import _sample_digest
from accel_mixin.distributed.sample_rows import generators_in, repeatable_digest
from accel_mixin.resume.describe import fingerprint


class Noise:
    """A torchvision-style transform with a generator of its own."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def __call__(self, x):
        return x + self.rng.normal(size=x.shape).astype(np.float32)


class Augmenting(torch.utils.data.Dataset):
    """Noise from the global generators of Python, NumPy and torch, from a
    transform's generator in a list, from a generator in a closure and in a
    partial, all seeded with ``seed``; rows and targets as tensors."""

    def __init__(self, X, y, seed):
        self.X, self.y = X, y
        closed = torch.Generator().manual_seed(seed)
        self.transforms = [Noise(seed), lambda x: x + torch.randn(x.shape, generator=closed)]
        self.jitter = functools.partial(random.Random.random, random.Random(seed))

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        x = torch.as_tensor(self.transforms[0](self.X[i]))
        x = self.transforms[1](x) + random.random() + np.random.normal() + self.jitter()
        return x + torch.randn(1), torch.as_tensor(self.y[i])


class Unrepeatable(Augmenting):
    """Noise from the operating system's entropy: other rows at every reading."""

    def __getitem__(self, i):
        x = torch.as_tensor(self.X[i]) + float(np.random.default_rng().normal())
        return x, torch.as_tensor(self.y[i])


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(100, 4)).astype(np.float32), rng.integers(0, 2, 100)


def global_states():
    return [random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()]


def test_the_generators_a_dataset_holds_are_found_in_transforms_closures_and_partials():
    dataset = Augmenting(*data(), seed=0)
    found = generators_in(dataset)
    assert {type(g).__name__ for g in found} == {"Generator", "Random"}
    assert len(found) == 3  # NumPy's and torch's Generators, Python's Random
    assert generators_in(np.zeros(3)) == [] and generators_in(None) == []
    # a cycle and a module are no trouble
    dataset.me, dataset.np = dataset, np
    assert len(generators_in(dataset)) == 3


def test_an_augmenting_dataset_digests_alike_whatever_the_seeds_and_takes_no_draw():
    X, y = data()
    digests, prints = set(), set()
    for seed in (0, 1, 2):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        dataset = Augmenting(X, y, seed)
        before = global_states()
        digests.add(_sample_digest(dataset, None, len(dataset)))
        prints.add(fingerprint(dataset)["sha256"])
        assert global_states() == before
    (digest,) = digests
    assert digest >= 0 and len(prints) == 1
    # still the data: other values, another digest
    assert _sample_digest(Augmenting(X + 1, y, 0), None, len(X)) != digest


def test_rows_that_differ_at_every_reading_are_not_compared():
    X, y = data()
    dataset = Unrepeatable(X, y, 0)
    assert repeatable_digest(dataset, lambda: dataset[3], lambda row: row[0].tolist()) is None
    assert _sample_digest(dataset, None, len(dataset)) == -1  # lengths only
    # the run identity leaves such rows out, and so is the same at every fit
    assert fingerprint(dataset) == fingerprint(Unrepeatable(X, y, 1))
    assert fingerprint(dataset) != fingerprint(Unrepeatable(X + 1, y, 0))
