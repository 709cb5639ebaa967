"""The mixin's own callback hooks, found only where a class defines them."""

from unittest.mock import Mock

from accelerate import Accelerator
from common import MLP, AcceleratedNet, make_data
from skorch.callbacks import Callback

from accel_mixin.training.notifications import hook


class Finishing(Callback):
    def __init__(self):
        self.calls = []

    def on_epoch_finished(self, net, stopped=False, **kwargs):
        self.calls.append(("epoch", len(net.history), stopped))

    def on_batch_finished(self, net, training=True, batches=0, **kwargs):
        self.calls.append(("batch", batches))


def test_an_object_that_answers_every_attribute_has_no_hooks():
    assert hook(Mock(), "during_fit") is None
    assert hook(Finishing(), "on_epoch_finished") is not None


def test_hooks_run_after_every_batch_and_epoch_and_a_mock_callback_trains():
    finishing = Finishing()
    net = AcceleratedNet(
        MLP,
        accelerator=Accelerator(cpu=True),
        max_epochs=2,
        batch_size=60,
        train_split=None,
        verbose=0,
        callbacks=[Mock(), finishing],
    )
    net.fit(*make_data(120))
    assert finishing.calls == [
        ("batch", 1),
        ("batch", 2),
        ("epoch", 1, False),
        ("batch", 1),
        ("batch", 2),
        ("epoch", 2, False),
    ]
