"""Checkpoint folders that know their run: identities, one folder per run,
cross-validation without leaks, stale folders, deliberate continuations,
manifests and clear errors. One process here; searches interrupted in one
and two real processes at the end."""

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from common import MLP, AcceleratedNet
from harness import run_plain, run_processes
from sklearn.model_selection import KFold, cross_val_score
from skorch.callbacks import Callback, EarlyStopping, Freezer, LRScheduler, PrintLog

from accel_mixin import CheckpointError
from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint
from accel_mixin.runs import fingerprint, run_identity


class EpochCounter(Callback):
    """How many epochs this fit trained (not resumed)."""

    in_run_identity = False

    def initialize(self):
        # no trailing underscore: a training state would restore the count
        self.trained = 0
        return self

    def on_epoch_begin(self, net, **kwargs):
        self.trained += 1


def make_net(dirname, accelerator=None, run=None, lines=None, **kwargs):
    torch.manual_seed(0)
    params = dict(
        max_epochs=3,
        lr=0.1,
        batch_size=32,
        verbose=1,
        callbacks__print_log__sink=print,
        callbacks=[
            EpochCounter(),
            TrainingCheckpoint(dirname),
            ResumeTraining(dirname, run=run, sink=lines.append if lines is not None else print),
        ],
    )
    params.update(kwargs)
    return AcceleratedNet(MLP, accelerator=accelerator or Accelerator(cpu=True), **params)


def identity(data, X=None, **kwargs):
    net = AcceleratedNet(MLP, accelerator=Accelerator(cpu=True), **kwargs).initialize()
    return run_identity(net, data[0] if X is None else X, data[1]).id


def trained(net):
    return dict(net.callbacks_)["EpochCounter"].trained


def runs_in(dirname):
    return sorted(p.name for p in Path(dirname).glob("run-*"))


# --- the identity -----------------------------------------------------------


def test_the_identity_continues_or_starts_a_new_run_as_documented(data):
    X, _ = data
    base = identity(data)
    assert identity(data) == base  # the same script again, after a crash
    # these continue the run
    assert identity(data, max_epochs=50, verbose=0, warm_start=True) == base
    assert identity(data, callbacks__print_log__sink=lambda *_: None) == base
    assert identity(data, callbacks=[PrintLog(keys_ignored="dur")]) == base
    # these start another
    other = {
        identity(data, lr=0.05),
        identity(data, batch_size=64),
        identity(data, module__hidden=16),
        identity(data, optimizer__momentum=0.9),
        identity(data, callbacks=[LRScheduler(step_every="epoch")]),
        identity(data, callbacks=[Freezer("hidden.*", at=1)]),
        identity(data, callbacks=[Freezer("hidden.*", at=2)]),
        identity(data, X=X.copy() + 1e-3),  # other values
        identity(data, X=X[:150]),  # another fold
        identity(data, X=X[::-1].copy()),  # other rows in another order
    }
    assert base not in other and len(other) == 10


def test_a_fingerprint_reads_a_sample_of_the_rows():
    class Counting(torch.utils.data.Dataset):
        reads = 0

        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            Counting.reads += 1
            return torch.full((3,), float(i)), 0

    print_ = fingerprint(Counting())
    assert Counting.reads == 64 and print_["length"] == 10**6
    big = np.zeros((10**5, 4), dtype=np.float32)
    changed = big.copy()
    changed[-1, 0] = 1  # the last row is always in the sample
    assert fingerprint(big)["sample_sha256"] != fingerprint(changed)["sample_sha256"]
    assert fingerprint(big)["rows"] == [["float32", [4]]]


# --- one folder per run -----------------------------------------------------


def test_cross_validation_trains_every_fold_from_scratch(data, tmp_path):
    X, y = data
    net = make_net(tmp_path, verbose=0)
    cross_val_score(net, X, y, cv=KFold(3), error_score="raise")
    assert len(runs_in(tmp_path)) == 3
    for folder in Path(tmp_path).glob("run-*"):
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["status"] == "finished" and manifest["epochs"] == [2, 3]
    # a fold fitted again resumes its own run, finished: nothing to train
    first_fold, _ = next(KFold(3).split(X))
    again = make_net(tmp_path, verbose=0).fit(X[first_fold], y[first_fold])
    assert trained(again) == 0 and len(again.history) == 3


def test_a_stale_run_with_higher_epochs_is_neither_resumed_nor_deleted(data, tmp_path):
    X, y = data
    make_net(tmp_path, verbose=0, max_epochs=8).fit(X[:150], y[:150])  # another data set
    (stale,) = runs_in(tmp_path)
    stale_files = sorted(os.listdir(tmp_path / stale))
    lines = []
    net = make_net(tmp_path, lines=lines).fit(X, y)
    assert trained(net) == 3
    (new,) = set(runs_in(tmp_path)) - {stale}
    assert sorted(os.listdir(tmp_path / stale)) == stale_files
    assert sorted(os.listdir(tmp_path / new)) == [
        "manifest.json",
        "training-state-000002.pt",
        "training-state-000003.pt",
    ]
    # one line says so, and what differs from the newest run
    (line,) = lines
    assert line.startswith(
        f"ResumeTraining: run {new[4:]} starts afresh in {tmp_path}, next "
        f"to 1 other run(s); it differs from the newest, {stale[4:]}, in: "
    )
    assert "X (other data)" in line and "y (other data)" in line


def test_training_longer_continues_the_run(data, tmp_path):
    first = make_net(tmp_path).fit(*data)
    longer = make_net(tmp_path, max_epochs=5).fit(*data)
    assert trained(first) == 3 and trained(longer) == 2 and len(longer.history) == 5
    assert len(runs_in(tmp_path)) == 1


def test_a_deliberate_continuation_of_another_run(data, tmp_path):
    first = make_net(tmp_path).fit(*data)
    (original,) = runs_in(tmp_path)
    # a lower learning rate from where the first run ended: another run
    tuned = make_net(tmp_path, run=original[4:], lr=0.01, max_epochs=5).fit(*data)
    assert trained(tuned) == 2 and len(tuned.history) == 5
    assert dict(tuned.callbacks_)["ResumeTraining"].resumed_from_.startswith(
        str(tmp_path / original)
    )
    (continued,) = set(runs_in(tmp_path)) - {original}
    assert sorted(os.listdir(tmp_path / continued))[1:] == [
        "training-state-000004.pt",
        "training-state-000005.pt",
    ]
    assert trained(first) == 3
    # a rerun after a crash resumes the continuation, not the original
    again = make_net(tmp_path, run=original[4:], lr=0.01, max_epochs=6).fit(*data)
    assert trained(again) == 1
    assert str(tmp_path / continued) in dict(again.callbacks_)["ResumeTraining"].resumed_from_


def test_the_manifest_says_what_went_into_the_run_and_how_it_ended(data, tmp_path):
    stopper = EarlyStopping(
        monitor="train_loss", patience=1, threshold=100, threshold_mode="abs", sink=lambda *_: None
    )
    net = make_net(tmp_path, verbose=0, max_epochs=10, callbacks__EarlyStopping=stopper)
    net.set_params(callbacks=net.callbacks + [stopper]).fit(*data)
    (folder,) = Path(tmp_path).glob("run-*")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["run"] == folder.name[4:]
    assert manifest["status"] == "stopped early" and manifest["epochs"] == [1, 2]
    described = manifest["identity"]
    assert described["net"]["params"]["lr"] == "0.1"
    assert described["data"]["X"]["length"] == 200
    assert set(described["callbacks"]) >= {"EarlyStopping", "train_loss"}
    assert "TrainingCheckpoint" not in described["callbacks"]


# --- clear errors -------------------------------------------------------------


def test_a_corrupt_or_edited_manifest_is_a_clear_error(data, tmp_path):
    make_net(tmp_path, verbose=0).fit(*data)
    (folder,) = Path(tmp_path).glob("run-*")
    manifest = folder / "manifest.json"
    manifest.write_text('{"format": "accel_mixin.run", "run": "someone else", "epochs": []}')
    with pytest.raises(CheckpointError, match=f"{manifest} is not the manifest of run"):
        make_net(tmp_path, verbose=0).fit(*data)
    manifest.write_text("{cut")
    with pytest.raises(
        CheckpointError,
        match=rf"{manifest} is not a readable run manifest.*"
        f"delete the folder {folder}",
    ):
        make_net(tmp_path, verbose=0).fit(*data)


def test_a_run_that_does_not_exist_is_a_clear_error(data, tmp_path):
    make_net(tmp_path, verbose=0).fit(*data)
    (folder,) = runs_in(tmp_path)
    expected = rf"holds no run nope \(it holds \['{folder[4:]}'\]\)"
    with pytest.raises(CheckpointError, match=expected):
        make_net(tmp_path, verbose=0, run="nope").fit(*data)


def test_a_folder_that_is_a_file_or_cannot_be_made_is_a_clear_error(data, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(CheckpointError, match=f"{afile} is a file, not a folder of runs"):
        make_net(afile, verbose=0).fit(*data)
    with pytest.raises(CheckpointError, match=f"{afile / 'sub'} cannot be a folder of runs"):
        make_net(afile / "sub", verbose=0).fit(*data)


def test_a_run_folder_that_cannot_be_made_is_a_clear_error(data, tmp_path, monkeypatch):
    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "makedirs", refuse)
    with pytest.raises(
        CheckpointError,
        match=rf"Cannot create the run folder {tmp_path}/run-\w+ "
        r"\(PermissionError.*a dirname this process can",
    ):
        make_net(tmp_path, verbose=0).fit(*data)


# --- interrupted searches -----------------------------------------------------


def search(nproc):
    dirname = tempfile.mkdtemp(prefix="accel_mixin_search_")
    full = run_processes("search_run.py", "full", dirname + "/full", nproc=nproc, timeout=300)
    crash = (
        run_processes("search_run.py", "crash", dirname + "/resumed", nproc=nproc, timeout=300)
        if nproc > 1
        else run_plain("search_run.py", "crash", dirname + "/resumed", timeout=300)
    )
    assert crash.returncode != 0 and not crash.timed_out, crash.describe()
    rerun = (
        run_processes("search_run.py", "rerun", dirname + "/resumed", nproc=nproc, timeout=300)
        if nproc > 1
        else run_plain("search_run.py", "rerun", dirname + "/resumed", timeout=300)
    )
    return full.check(), rerun.check()


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [1, 2])
def test_an_interrupted_search_resumes_to_the_same_results(nproc):
    full, rerun = search(nproc)
    assert all(rank["cv_results"] == full[0]["cv_results"] for rank in full)
    for uninterrupted, resumed in zip(full, rerun):
        assert resumed["cv_results"] == uninterrupted["cv_results"]
        assert resumed["best_params"] == uninterrupted["best_params"] == {"lr": 0.2}
        # 4 fits of 3 epochs and the refit; killed when the third fit's
        # second epoch began: the first two resume finished, the third
        # from its first epoch
        assert uninterrupted["trained"] == [3, 3, 3, 3, 3]
        assert resumed["trained"] == [0, 0, 2, 3, 3]


@pytest.mark.multiprocess
def test_errors_of_run_folders_are_clear_on_every_rank(tmp_path):
    from harness import check_values as values

    checks = [r["checks"] for r in run_processes("runs_checks.py", tmp_path, timeout=180).check()]
    for files in values(checks, "one_run_folder_written_once"):
        assert files == ["manifest.json", "training-state-000001.pt", "training-state-000002.pt"]
    for name, expected in (
        ("an_edited_manifest", "is not the manifest of run"),
        ("a_run_that_does_not_exist", "ResumeTraining(run='nope')"),
        ("a_folder_that_is_a_file", "is a file, not a folder of runs"),
    ):
        for value in values(checks, name):
            assert value["error"].startswith("CheckpointError: ") and expected in value["error"]
            assert value["seconds"] < 25  # not the 30 s collective timeout
