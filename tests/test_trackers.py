"""accelerate's experiment trackers (``Accelerator(log_with=...)``) receive
the history's epoch rows (training/trackers.py); in two processes,
launched/sync_checks.py's ``trackers_once``."""

import pytest
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker
from common import AcceleratedNet
from skorch.callbacks import EarlyStopping


class Recorder(GeneralTracker):
    """A tracker that keeps what it is given."""

    name = "recorder"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self):
        super().__init__()
        self.config = None
        self.logged = []

    @property
    def tracker(self):
        return self.logged

    def store_init_configuration(self, values):
        self.config = values

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, values))


NUMBERS = ("train_loss", "valid_loss", "valid_acc", "dur")


def test_every_epoch_row_reaches_the_trackers(data, mlp):
    X, y = data
    recorder = Recorder()
    accelerator = Accelerator(cpu=True, log_with=[recorder])
    net = AcceleratedNet(mlp, accelerator=accelerator, max_epochs=3, verbose=0)
    net.fit(X, y)
    assert accelerator.trackers == [recorder]  # started once
    assert [step for step, _ in recorder.logged] == [1, 2, 3]
    for (_, values), row in zip(recorder.logged, net.history):
        assert {key: values[key] for key in NUMBERS} == {key: row[key] for key in NUMBERS}
        # flags and the batches' records stay in the history
        assert not any(key.endswith("_best") or key in ("batches", "epoch") for key in values)
    # a second fit goes on with the same run, at the steps of its epochs
    net.partial_fit(X, y)
    assert accelerator.trackers == [recorder]
    assert [step for step, _ in recorder.logged] == [1, 2, 3, 4, 5, 6]


def test_the_scripts_own_start_is_kept(data, mlp):
    X, y = data
    recorder = Recorder()
    accelerator = Accelerator(cpu=True, log_with=[recorder])
    accelerator.init_trackers("my_project", config={"lr": 0.1})
    net = AcceleratedNet(mlp, accelerator=accelerator, max_epochs=2, verbose=0)
    net.fit(X, y)
    assert accelerator.trackers == [recorder] and recorder.config == {"lr": 0.1}
    assert [step for step, _ in recorder.logged] == [1, 2]


def test_the_epoch_that_early_stopping_ends_is_logged(data, mlp):
    X, y = data
    recorder = Recorder()
    accelerator = Accelerator(cpu=True, log_with=[recorder])
    # valid_loss cannot improve by 10 within one epoch: stops after epoch 2
    stop = EarlyStopping(patience=1, threshold=10.0, threshold_mode="abs")
    net = AcceleratedNet(mlp, accelerator=accelerator, max_epochs=10, callbacks=[stop], verbose=0)
    net.fit(X, y)
    assert len(net.history) < 10
    assert [step for step, _ in recorder.logged] == list(range(1, len(net.history) + 1))


def test_without_trackers_nothing_is_logged(data, mlp, monkeypatch):
    X, y = data
    accelerator = Accelerator(cpu=True)
    calls = []
    monkeypatch.setattr(accelerator, "log", lambda *args, **kwargs: calls.append(args))
    monkeypatch.setattr(accelerator, "init_trackers", lambda *args, **kwargs: calls.append(args))
    AcceleratedNet(mlp, accelerator=accelerator, max_epochs=2, verbose=0).fit(X, y)
    assert calls == []


@pytest.mark.parametrize("kind", ["tensorboard"])
def test_a_named_tracker_writes_under_the_project_dir(data, mlp, tmp_path, kind):
    pytest.importorskip(kind)
    X, y = data
    accelerator = Accelerator(cpu=True, log_with=kind, project_dir=tmp_path)
    net = AcceleratedNet(mlp, accelerator=accelerator, max_epochs=2, verbose=0)
    net.fit(X, y)
    accelerator.end_training()
    # the net's class names the run where the script named none
    assert list((tmp_path / "AcceleratedNet").glob("events.out.tfevents.*"))
