"""The mixin's own callback hooks, found only where a class defines them, and
what an epoch's end raises on one process."""

import pickle
from unittest.mock import Mock

import pytest
from accelerate import Accelerator
from common import MLP, AcceleratedNet, make_data
from skorch.callbacks import Callback, Checkpoint

from accel_mixin.training.notifications import hook


class Finishing(Callback):
    def __init__(self):
        self.calls = []

    def on_epoch_finished(self, net, stopped=False, **kwargs):
        self.calls.append(("epoch", len(net.history), stopped))

    def on_batch_finished(self, net, training=True, batches=0, **kwargs):
        self.calls.append(("batch", batches))


def one_process_net(*callbacks):
    return AcceleratedNet(
        MLP,
        accelerator=Accelerator(cpu=True),
        max_epochs=2,
        batch_size=60,
        train_split=None,
        verbose=0,
        callbacks=list(callbacks),
    )


def test_an_object_that_answers_every_attribute_has_no_hooks():
    assert hook(Mock(), "during_fit") is None
    assert hook(Finishing(), "on_epoch_finished") is not None


def test_hooks_run_after_every_batch_and_epoch_and_a_mock_callback_trains():
    finishing = Finishing()
    one_process_net(Mock(), finishing).fit(*make_data(120))
    assert finishing.calls == [
        ("batch", 1),
        ("batch", 2),
        ("epoch", 1, False),
        ("batch", 1),
        ("batch", 2),
        ("epoch", 2, False),
    ]


class Raising(Callback):
    def __init__(self, exc):
        self.exc = exc

    def on_epoch_end(self, net, **kwargs):
        raise self.exc


def test_an_error_in_on_epoch_end_leaves_fit_as_itself():
    finishing, error = Finishing(), ValueError("boom")
    with pytest.raises(ValueError, match="boom") as raised:
        one_process_net(Raising(error), finishing).fit(*make_data(120))
    assert raised.value is error
    assert ("epoch", 1, False) not in finishing.calls  # the epoch did not finish


def test_a_keyboard_interrupt_in_on_epoch_end_stops_after_the_epoch_finished():
    finishing = Finishing()
    net = one_process_net(Raising(KeyboardInterrupt()), finishing)
    net.fit(*make_data(120))  # skorch's partial_fit ends the fit there
    assert len(net.history) == 1
    assert finishing.calls[-1] == ("epoch", 1, False)


class Logging(Callback):
    main_process_only = True

    def on_epoch_end(self, net, **kwargs):
        self.epochs = len(net.history)


def test_a_net_pickled_mid_fit_holds_the_user_s_main_process_only_callback(tmp_path):
    checkpoint = Checkpoint(
        monitor=None, dirname=tmp_path, f_pickle="net.pkl", f_params=None, f_optimizer=None,
        f_criterion=None, f_history=None,
    )  # fmt: skip
    one_process_net(("log", Logging()), ("cp", checkpoint)).fit(*make_data(120))
    with open(tmp_path / "net.pkl", "rb") as f:
        net = pickle.load(f)  # written while the logger ran alone
    logging = dict(net.callbacks_)["log"]
    assert type(logging) is Logging and logging.epochs == 2
    assert logging is dict(net.callbacks)["log"]  # one object, as skorch keeps it
    net.partial_fit(*make_data(120))
    assert logging.epochs == 4
