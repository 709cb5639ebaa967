"""Every epoch's shuffled order drawn as one process draws it
(``accel_mixin.training.shuffling``), in this process."""

import copy
import pickle

import torch
from torch.utils.data import RandomSampler

from accel_mixin.training.shuffling import _SeededAsOneProcess


def seeded_as_one_process(n=10):
    # accelerate gives the sampler a generator when it prepares it
    return _SeededAsOneProcess(RandomSampler(range(n), generator=torch.Generator()))


def test_every_epoch_s_order_is_the_one_a_sampler_without_a_generator_draws():
    wrapped = seeded_as_one_process()
    for seed in (0, 1):
        torch.manual_seed(seed)
        orders = [list(wrapped), list(wrapped)]
        torch.manual_seed(seed)
        plain = RandomSampler(range(10))
        assert orders == [list(plain), list(plain)]
        assert orders[0] != orders[1]  # a new order every epoch


def test_the_wrapper_stands_for_its_sampler_and_copies():
    wrapped = seeded_as_one_process()
    assert len(wrapped) == 10
    assert wrapped.data_source == range(10) and wrapped.replacement is False
    # a copy looks attributes up before it has a sampler: no endless recursion
    for copied in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        assert isinstance(copied, _SeededAsOneProcess)
        assert len(copied) == 10 and copied.data_source == range(10)
