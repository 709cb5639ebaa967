"""The pieces of history sync on their own; together: test_sync.py."""

import numpy as np
import torch
from accelerate import Accelerator
from common import AcceleratedNet
from skorch import NeuralNetClassifier
from skorch.callbacks import BatchScoring, EpochScoring

from accel_mixin.distributed.history_sync import interleave, leading_samples


def test_first_cuts_nested_outputs():
    data = {"x": torch.arange(5), "pair": (torch.ones(5, 2), torch.zeros(5))}
    cut = leading_samples(data, 3)
    assert cut["x"].tolist() == [0, 1, 2]
    assert cut["pair"][0].shape == (3, 2) and cut["pair"][1].shape == (3,)


def test_first_leaves_a_scalar_beside_the_outputs_as_it_is():
    cut = leading_samples((torch.ones(5, 2), torch.tensor(3.0)), 2)
    assert cut[0].shape == (2, 2) and cut[1].item() == 3.0


def test_interleave_restores_dataset_order():
    # rank 0 took batches 0, 2, 4; rank 1 took 1, 3
    assert interleave([[0, 2, 4], [1, 3]]) == [0, 1, 2, 3, 4]
    assert interleave([[], []]) == []


def test_one_process_history_equals_plain_skorch(mlp, data):
    """No padding, no merge: every score and loss is skorch's, to the bit."""

    def callbacks():
        return [
            BatchScoring("accuracy", name="batch_acc", lower_is_better=False),
            EpochScoring("accuracy", name="acc_nocache", use_caching=False, lower_is_better=False),
        ]

    common = dict(max_epochs=3, lr=0.1, batch_size=24, verbose=0)
    torch.manual_seed(0)
    plain = NeuralNetClassifier(mlp, callbacks=callbacks(), **common).fit(*data)
    torch.manual_seed(0)
    ours = AcceleratedNet(
        mlp, accelerator=Accelerator(cpu=True), callbacks=callbacks(), **common
    ).fit(*data)
    keys = ["train_loss", "valid_loss", "valid_acc", "batch_acc", "acc_nocache"]
    np.testing.assert_array_equal(ours.history[:, keys], plain.history[:, keys])
    np.testing.assert_array_equal(
        ours.history[:, "batches", :, "train_loss"], plain.history[:, "batches", :, "train_loss"]
    )
