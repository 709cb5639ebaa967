"""TensorRows gives skorch's batches, and stands in only where it can."""

import pickle
import warnings

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from common import AcceleratedNet
from scipy import sparse
from skorch.dataset import Dataset
from torch.utils.data import DataLoader, Subset

from accel_mixin.training.rows import TensorRows, tensor_rows

rng = np.random.default_rng(0)
X32 = rng.standard_normal((50, 6)).astype(np.float32)

DATA = {
    "float32 and labels": (X32, rng.integers(0, 3, 50)),
    "float64 and 2-D targets": (X32.astype(np.float64), rng.standard_normal((50, 2))),
    "int32 labels": (X32, rng.integers(0, 3, 50).astype(np.int32)),
    "tensors": (torch.as_tensor(X32), torch.arange(50)),
    "no y": (X32, None),
    "a dict of arrays": ({"ids": rng.integers(0, 9, (50, 4)), "mask": np.ones((50, 4))}, None),
    "strided rows": (np.asfortranarray(X32), rng.integers(0, 3, 50)),
    "images": (rng.standard_normal((50, 1, 3, 3)).astype(np.float32), np.zeros(50, np.int64)),
}


def batches(dataset):
    loader = DataLoader(
        dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    return list(loader)


def assert_same(ours, theirs):
    if isinstance(theirs, dict):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert_same(ours[key], value)
        return
    if isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert_same(a, b)
        return
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", DATA)
def test_batches_equal_skorchs_own(name):
    X, y = DATA[name]
    rows = tensor_rows(Dataset(X, y))
    assert isinstance(rows, TensorRows)
    assert len(rows) == 50
    assert_same(batches(rows), batches(Dataset(X, y)))


@pytest.mark.parametrize("name", DATA)
def test_a_batch_fetched_at_once_holds_the_samples_one_by_one(name):
    # the DataLoader's fetcher asks for a batch's samples together, also
    # through the Subset of a train split
    rows = tensor_rows(Dataset(*DATA[name]))
    indices = [3, 0, 49, 3, 17]
    assert_same(rows.__getitems__(indices), [rows[i] for i in indices])
    subset = Subset(rows, [5, 6, 7])
    assert_same(subset.__getitems__([2, 0]), [rows[7], rows[5]])


@pytest.mark.parametrize("name", ["float32 and labels", "no y", "a dict of arrays"])
def test_a_pickled_copy_views_its_own_arrays(name):
    rows = tensor_rows(Dataset(*DATA[name]))
    state = rows.__getstate__()
    assert "_X_rows" not in state and "_y_rows" not in state
    assert_same(batches(pickle.loads(pickle.dumps(rows))), batches(rows))


class Transformed(Dataset):
    def transform(self, X, y):
        return X * 2, y


def read_only():
    X = X32.copy()
    X.flags.writeable = False
    return X


KEPT = {
    "a subclass of skorch's Dataset": lambda: Transformed(X32, np.zeros(50)),
    "a read-only array": lambda: Dataset(read_only(), np.zeros(50)),
    "an object array": lambda: Dataset(np.array([{"a": i} for i in range(50)]), np.zeros(50)),
    "a sparse matrix": lambda: Dataset(sparse.csr_matrix(X32), np.zeros(50)),
    "a list": lambda: Dataset([0.5] * 50, np.zeros(50)),
    "reversed rows": lambda: Dataset(X32[::-1], np.zeros(50)),
    "big-endian": lambda: Dataset(X32.astype(">f4"), np.zeros(50)),
    "a list of labels": lambda: Dataset(X32, [0] * 50),
}


@pytest.mark.parametrize("name", KEPT)
def test_what_it_cannot_view_the_same_stays_skorchs(name):
    dataset = KEPT[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tensor_rows(dataset) is dataset


def test_the_net_indexes_tensor_rows_unless_given_a_dataset(mlp):
    X, y = DATA["float32 and labels"]
    net = AcceleratedNet(mlp, accelerator=Accelerator(cpu=True))
    assert isinstance(net.get_dataset(X, y), TensorRows)
    own = Dataset(X, y)  # the user's, passed as X or as dataset=: kept as it is
    assert net.get_dataset(own) is own
    assert net.set_params(dataset=own).get_dataset(X, y) is own
    net.set_params(dataset=Dataset)
    net.set_params(dataset=Transformed)
    assert type(net.get_dataset(X, y)) is Transformed  # pylint: disable=unidiomatic-typecheck
