"""Checkpoint folders that know their run: identities, one folder per run,
cross-validation without leaks, stale folders, deliberate continuations,
manifests and clear errors. One process here; searches interrupted in one
and two real processes at the end."""

import copy
import inspect
import json
import os
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from common import MLP, AcceleratedNet, make_data
from harness import check_values as values
from harness import run_plain, run_processes
from resume_phases import crashed, once_per_layout
from sklearn.model_selection import KFold, cross_val_score
from skorch.callbacks import (
    Callback,
    EarlyStopping,
    EpochTimer,
    Freezer,
    LRScheduler,
    PrintLog,
    ProgressBar,
)
from skorch.dataset import Dataset, ValidSplit
from skorch.helper import predefined_split

from accel_mixin import CheckpointError
from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint
from accel_mixin.resume.runs import (
    RunIdentity,
    describe_differences,
    differs_from_newest,
    fingerprint,
    run_folders,
    run_identity,
)


class EpochCounter(Callback):
    """How many epochs this fit trained (not resumed)."""

    in_run_identity = False

    def initialize(self):
        # no trailing underscore: a training state would restore the count
        self.trained = 0
        return self

    def on_epoch_begin(self, net, **kwargs):
        self.trained += 1


def make_net(dirname, accelerator=None, run=None, lines=None, module=MLP, **kwargs):
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
    return AcceleratedNet(module, accelerator=accelerator or Accelerator(cpu=True), **params)


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


def test_a_fingerprint_changes_with_any_value_and_reads_a_dataset_s_sample():
    class Counting(torch.utils.data.Dataset):
        reads = 0

        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            Counting.reads += 1
            return torch.full((3,), float(i)), 0

    print_ = fingerprint(Counting())
    # 64 rows, read twice: rows that differ at every reading are left out
    assert Counting.reads == 2 * 64 and print_["length"] == 10**6
    big = np.zeros((10**5, 4), dtype=np.float32)
    prints = {fingerprint(big)["sha256"]}
    for row in (0, 12_345, 99_999):  # anywhere: every byte is hashed
        changed = big.copy()
        changed[row, 2] = 1e-7
        prints.add(fingerprint(changed)["sha256"])
    # the same values in a tensor: another type
    prints.add(fingerprint(torch.as_tensor(big))["sha256"])
    prints.add(fingerprint({"a": big[:, :2], "b": big[:, 2:]})["sha256"])
    prints.add(fingerprint(["some", "text"])["sha256"])
    prints.add(fingerprint(["some", "texts"])["sha256"])
    assert len(prints) == 8


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
        "training-state-000002",
        "training-state-000003",
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
    lines = []
    tuned = make_net(tmp_path, run=original[4:], lr=0.01, max_epochs=5, lines=lines).fit(*data)
    assert trained(tuned) == 2 and len(tuned.history) == 5
    tuned_key = dict(tuned.callbacks_)["TrainingCheckpoint"].run_.key
    assert lines == [
        f"ResumeTraining: run {tuned_key} continues run {original[4:]} from "
        f"{tmp_path / original / 'training-state-000003'} (after epoch 3)"
    ]
    assert dict(tuned.callbacks_)["ResumeTraining"].resumed_from_.startswith(
        str(tmp_path / original)
    )
    (continued,) = set(runs_in(tmp_path)) - {original}
    assert sorted(os.listdir(tmp_path / continued))[1:] == [
        "training-state-000004",
        "training-state-000005",
    ]
    assert trained(first) == 3
    # a rerun after a crash resumes the continuation, not the original
    again = make_net(tmp_path, run=original[4:], lr=0.01, max_epochs=6).fit(*data)
    assert trained(again) == 1
    assert str(tmp_path / continued) in dict(again.callbacks_)["ResumeTraining"].resumed_from_


def test_one_folder_spelt_two_ways_is_one_folder(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    net = make_net("ckpt/", verbose=0)
    net.callbacks[2] = ResumeTraining(Path(".") / "ckpt")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ResumeTraining")
        net.fit(*data)
    assert runs_in("ckpt") == [Path(dict(net.callbacks_)["TrainingCheckpoint"].run_folder_).name]


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


# --- by content -------------------------------------------------------------


class Opaque:
    """A value without attributes or a repr to describe it by."""

    __slots__ = ()


class Holding(Callback):
    def __init__(self, thing=None, scale=1.0):
        self.thing = thing
        self.scale = scale


def test_values_are_described_by_their_content(data):
    X, y = data
    sampler = torch.utils.data.WeightedRandomSampler
    pairs = {
        "criterion__weight": (torch.tensor([1.0, 1.0]), torch.tensor([1.0, 10.0])),
        "train_split": (ValidSplit(0.1), ValidSplit(0.2)),
        "predefined_split": (
            predefined_split(Dataset(X[:20], y[:20])),
            predefined_split(Dataset(X[20:40], y[20:40])),
        ),
        "iterator_train__sampler": (sampler([1.0] * 160, 160), sampler([1.0] * 159 + [2.0], 160)),
        "callbacks": ([Holding(np.ones(3))], [Holding(np.array([1.0, 1.0, 2.0]))]),
        "random_state": (
            ValidSplit(0.2, random_state=np.random.RandomState(0)),
            ValidSplit(0.2, random_state=np.random.RandomState(1)),
        ),
    }
    for key, (one, other) in pairs.items():
        key = "train_split" if key in ("predefined_split", "random_state") else key
        first, second = identity(data, **{key: one}), identity(data, **{key: other})
        assert first != second, key
        assert identity(data, **{key: copy.deepcopy(one)}) == first, key  # an equal copy
    assert identity(data, train_split=ValidSplit(5, stratified=True)) == identity(data)  # default


def test_a_value_that_cannot_be_described_is_never_resumed(data, tmp_path):
    with pytest.warns(RuntimeWarning) as caught:
        fits = [make_net(tmp_path, callbacks__Holding=Holding(Opaque())) for _ in range(2)]
        for net in fits:
            net.set_params(callbacks=net.callbacks + [("Holding", Holding(Opaque()))]).fit(*data)
    assert [trained(net) for net in fits] == [3, 3] and len(runs_in(tmp_path)) == 2
    (reason,) = {str(w.message) for w in caught if "ResumeTraining" in str(w.message)}
    assert reason.startswith(
        "ResumeTraining: callbacks__Holding.thing is a test_runs.Opaque, which has neither "
        "get_params, attributes nor a repr without its address"
    )
    assert "name the run (TrainingCheckpoint(run_name=...)) to resume it" in reason
    manifest = json.loads(next(Path(tmp_path).glob("run-*/manifest.json")).read_text())
    assert manifest["refused"].startswith("callbacks__Holding.thing is a test_runs.Opaque")
    # a name stands for what cannot be described: the named run resumes
    named = []
    for _ in range(2):
        net = make_net(tmp_path / "named", verbose=0)
        net.callbacks[1].run_name = "opaque"
        named.append(net.set_params(callbacks=net.callbacks + [Holding(Opaque())]).fit(*data))
    assert [trained(net) for net in named] == [3, 0]


class Augmenting(torch.utils.data.Dataset):
    """Rows with noise from the global generators and from generators of its
    own, each seeded with ``seed``, as a Dataset seeded per rank is."""

    def __init__(self, X, y, seed):
        self.X, self.y = X, y
        self.own = [
            np.random.default_rng(seed),
            np.random.RandomState(seed),
            torch.Generator().manual_seed(seed),
            random.Random(seed),
        ]

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        numpy, legacy, torch_, python = self.own
        noise = (
            np.random.normal()
            + random.random()
            + numpy.normal()
            + legacy.normal()
            + python.random()
            + torch.randn(1, generator=torch_).item()
        )
        return torch.as_tensor(self.X[i]) + float(noise + torch.randn(1).item()), self.y[i]


def generator_states(dataset):
    """The states of the global generators and of those ``dataset`` holds."""
    numpy, legacy, torch_, python = dataset.own
    return [
        random.getstate(),
        np.random.get_state(legacy=False),
        torch.get_rng_state(),
        numpy.bit_generator.state,
        legacy.get_state(legacy=False),
        torch_.get_state(),
        python.getstate(),
    ]


def same_states(first, second):
    def text(states):
        return json.dumps(states, sort_keys=True, default=lambda array: array.tolist())

    return text(first) == text(second)


def test_a_dataset_that_augments_at_random_has_one_fingerprint_and_takes_no_draw(data):
    """Whatever the seeds, of the global generators and of the Dataset's own,
    the fingerprint is the same, and every generator is left as it was."""
    X, y = data
    prints = set()
    for seed in (0, 1, 2):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        dataset = Augmenting(X, y, seed)
        before = generator_states(dataset)
        prints.add(fingerprint(dataset)["sha256"])
        assert same_states(generator_states(dataset), before)
        dataset[0]  # the draws go on from where they were
        assert not same_states(generator_states(dataset), before)
    assert len(prints) == 1
    # still the data: other rows, another fingerprint
    assert fingerprint(Augmenting(X + 1, y, 0))["sha256"] not in prints
    # a generator outside a Dataset is described by its state
    splits = [ValidSplit(0.2, random_state=np.random.default_rng(seed)) for seed in (0, 1)]
    assert identity(data, train_split=splits[0]) != identity(data, train_split=splits[1])


def corrected(y, count):
    """``y`` with ``count`` labels flipped, none of them where the fingerprint
    once sampled its 64 rows."""
    sampled = set(np.linspace(0, len(y) - 1, 64).round().astype(int))
    rows = [i for i in range(len(y)) if i not in sampled][:count]
    fixed = y.copy()
    fixed[rows] = 1 - fixed[rows]
    return fixed, rows


def test_corrected_labels_or_rows_start_a_new_run(tmp_path):
    X, y = make_data(333)
    lines = []
    assert trained(make_net(tmp_path, lines=lines).fit(X, y)) == 3
    fixed_y, rows = corrected(y, 30)
    assert trained(make_net(tmp_path, lines=lines).fit(X, fixed_y)) == 3
    rescaled = X.copy()
    rescaled[rows[:10]] *= 2
    assert trained(make_net(tmp_path, lines=lines).fit(rescaled, y)) == 3
    assert trained(make_net(tmp_path, lines=lines).fit(X, y)) == 0  # the first run, finished
    assert len(runs_in(tmp_path)) == 3
    assert lines[0].endswith("in: y (other data)") and "in: X (other data)" in lines[1]


class WeightedMLP(MLP):
    def forward(self, X, sample_weight=None):
        return super().forward(X)


def test_a_changed_fit_parameter_starts_a_new_run(data, tmp_path):
    X, y = data
    weights = np.ones(len(y), dtype=np.float32)
    lines = []

    def fit(w):
        net = make_net(tmp_path, lines=lines, module=WeightedMLP, train_split=None)
        return trained(net.fit(X, y, sample_weight=w))

    heavier = weights.copy()
    heavier[101] = 5.0
    assert [fit(weights), fit(heavier), fit(weights), fit(heavier)] == [3, 3, 0, 0]
    assert lines[0].endswith("in: fit parameter sample_weight (other data)")


def test_what_differs_from_the_newest_run_is_said_in_a_few_words(tmp_path):
    old = {"net": {"class": "Net", "params": {"lr": "0.1", "module__sizes": [8, 8]}}}
    new = {"net": {"class": "Net", "params": {"lr": "0.1", "module__sizes": [8, 16]}}}
    assert describe_differences(new, old) == "module__sizes (other value)"
    many = {"net": {"class": "Net", "params": {key: 1 for key in "abcde"}}}
    assert describe_differences(many, {"net": {"class": "Net"}}) == (
        "a: (default) -> 1, b: (default) -> 1, c: (default) -> 1, d: (default) -> 1, and 1 more"
    )
    folder = tmp_path / "run-0123456789ab"
    folder.mkdir()
    (folder / "manifest.json").write_text("{cut")
    assert differs_from_newest(RunIdentity(new), run_folders(tmp_path)) == (
        "it differs from the newest, 0123456789ab, in: an unreadable manifest"
    )


# --- what does not make a run ---------------------------------------------------


def upgraded(name, base, **added):
    """A subclass of ``base`` named ``name``, as the next version of a class
    that adds ``added`` arguments with their defaults."""

    def __init__(self, *args, **kwargs):
        for key, default in added.items():
            setattr(self, key, kwargs.pop(key, default))
        base.__init__(self, *args, **kwargs)

    params = [
        inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in added.items()
    ]
    __init__.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]
        + [inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)]
        + params
        + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    )
    cls = type(name, (base,), {"__init__": __init__, "__module__": base.__module__})
    cls.__qualname__ = name
    return cls


def test_an_upgrade_that_adds_defaulted_parameters_resumes(data, tmp_path):
    """The next version of the net's class and of a callback's each add an
    argument with a default: the run resumes; set to another value, it is
    another run, and the line names it."""
    Net = upgraded("Net", AcceleratedNet)
    Scaled = upgraded("Scaled", Holding)
    lines = []

    def fit(net_cls, callback, **kwargs):
        params = make_net(tmp_path, lines=lines).get_params(deep=False)
        params["callbacks"] = params["callbacks"] + [callback]
        return trained(net_cls(**params, **kwargs).fit(*data))

    assert fit(Net, Scaled(scale=2.0)) == 3
    Net = upgraded("Net", AcceleratedNet, new_option="auto")
    Scaled = upgraded("Scaled", Holding, clip=None)
    assert fit(Net, Scaled(scale=2.0)) == 0
    (line,) = lines  # the resume's, none of a new run
    assert line.startswith("ResumeTraining: resuming run ") and "(after epoch 3)" in line
    assert fit(Net, Scaled(scale=2.0), new_option="manual") == 3
    assert lines[-1].endswith("in: new_option: (default) -> manual")


def test_logging_callbacks_and_loading_settings_do_not_make_a_run(data, tmp_path):
    assert trained(make_net(tmp_path).fit(*data)) == 3
    rerun = make_net(
        tmp_path,
        iterator_train__num_workers=2,
        iterator_train__persistent_workers=True,
        iterator_valid__pin_memory=True,
    )
    rerun.set_params(callbacks=rerun.callbacks + [ProgressBar(), EpochTimer()])
    assert trained(rerun.fit(*data)) == 0 and len(runs_in(tmp_path)) == 1


def test_a_named_run(data, tmp_path):
    net = make_net(tmp_path, verbose=0)
    net.callbacks[1].run_name = "baseline"
    net.fit(*data)
    (folder,) = runs_in(tmp_path)
    assert folder.startswith("run-baseline-") and len(folder) == len("run-baseline-") + 12
    manifest = json.loads((tmp_path / folder / "manifest.json").read_text())
    assert manifest["name"] == "baseline" and manifest["identity"]["name"] == "baseline"
    # continued by its name, with a lower learning rate
    tuned = make_net(tmp_path, verbose=0, run="baseline", lr=0.01, max_epochs=5).fit(*data)
    assert trained(tuned) == 2
    assert str(tmp_path / folder) in dict(tuned.callbacks_)["ResumeTraining"].resumed_from_
    for bad in ("", "a/b", "-x", "x" * 65, 3):
        with pytest.raises(ValueError, match="run_name must be a word"):
            TrainingCheckpoint(tmp_path, run_name=bad).initialize()


def named(dirname, lines=None, resume_first=False, **kwargs):
    """A net that names its run 'baseline' and resumes it by that name."""
    net = make_net(dirname, run="baseline", lines=lines, **kwargs)
    net.callbacks[1].run_name = "baseline"
    if resume_first:
        net.callbacks[1:] = net.callbacks[:0:-1]
    return net


@pytest.mark.parametrize("resume_first", [False, True])
def test_a_named_run_on_other_data_is_a_run_of_its_own(data, tmp_path, resume_first):
    """TrainingCheckpoint(run_name='baseline') with ResumeTraining(run='baseline'):
    the name means this fit's own run, so other data under it start afresh,
    and every fit resumes its own run after."""
    X, y = data
    lines = []
    fits = [(X, y), (X + 1, y), (X + 1, y), (X, y)]
    counts = [trained(named(tmp_path, lines, resume_first).fit(*fit)) for fit in fits]
    assert counts == [3, 3, 0, 0]
    first, second = runs_in(tmp_path)
    assert first.startswith("run-baseline-") and second.startswith("run-baseline-")
    afresh, *resumed = lines
    assert (
        afresh.endswith("in: X (other data)") and "it differs from the newest, baseline-" in afresh
    )
    # the third fit resumes the run on other data, the fourth the first run
    other_data = afresh.split()[2]
    (original,) = {first[4:], second[4:]} - {other_data}
    assert [line.split(" from ")[0] for line in resumed] == [
        f"ResumeTraining: resuming run {other_data}",
        f"ResumeTraining: resuming run {original}",
    ]


def test_a_fit_that_fails_before_its_first_epoch_leaves_no_run_folder(data, tmp_path):
    X, y = data
    with pytest.raises(CheckpointError, match="holds no run nope"):
        make_net(tmp_path, run="nope").fit(X, y)
    assert runs_in(tmp_path) == []
    named(tmp_path).fit(X, y)
    named(tmp_path).fit(X + 1, y)
    baselines = runs_in(tmp_path)
    # an unnamed fit that continues 'baseline': which of the two is not a guess
    with pytest.raises(
        CheckpointError,
        match=r"run='baseline'\): several runs are named 'baseline' \(baseline-\w+, "
        r"baseline-\w+\), fits that differ under that name; pass the id",
    ):
        make_net(tmp_path, run="baseline", lr=0.05).fit(X, y)
    assert runs_in(tmp_path) == baselines
    tuned = make_net(tmp_path, run=baselines[0][-12:], lr=0.05, max_epochs=4).fit(X, y)
    assert trained(tuned) == 1 and len(runs_in(tmp_path)) == 3


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


# --- interrupted runs, launched ------------------------------------------------

# Per layout, one launch runs the references and stops every scenario, the
# search last, by killing its processes; one more reruns each in turn, then
# checks the errors of run folders on two processes (runs_interrupted.py).
INTERRUPTED = {
    1: ["augmented-unseeded", "augmented-per_rank", "search"],
    2: ["search-weights", "augmented-unseeded", "augmented-per_rank", "search", "run-folders"],
}


def launch(nproc, phase, dirname):
    """One phase of every scenario, as ``python`` runs a script on one process."""
    args = ("runs_interrupted.py", phase, dirname, *INTERRUPTED[nproc])
    if nproc == 1:
        return run_plain(*args, timeout=900)
    return run_processes(*args, nproc=nproc, timeout=900)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    def crash_and_rerun(nproc):
        dirname = tmp_path_factory.mktemp(f"interrupted{nproc}")
        crashed_checks = crashed(launch(nproc, "crash", dirname))
        rerun = launch(nproc, "rerun", dirname).check()
        return dirname, crashed_checks, [rank["checks"] for rank in rerun]

    return once_per_layout(crash_and_rerun)


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [1, 2])
def test_an_interrupted_search_resumes_to_the_same_results(interrupted, nproc):
    _, crashed_checks, rerun_checks = interrupted(nproc)
    full = values(crashed_checks, "search/full")
    rerun = values(rerun_checks, "search")
    assert all(rank["cv_results"] == full[0]["cv_results"] for rank in full)
    for uninterrupted, resumed in zip(full, rerun, strict=True):
        assert resumed["cv_results"] == uninterrupted["cv_results"]
        assert resumed["best_params"] == uninterrupted["best_params"] == {"lr": 0.2}
        # 4 fits of 3 epochs and the refit; killed when the third fit's
        # second epoch began: the first two resume finished, the third
        # from its first epoch
        assert uninterrupted["trained"] == [3, 3, 3, 3, 3]
        assert resumed["trained"] == [0, 0, 2, 3, 3]


@pytest.mark.multiprocess
def test_errors_of_run_folders_are_clear_on_every_rank(interrupted):
    _, _, checks = interrupted(2)  # runs_checks.py, after the reruns
    for files in values(checks, "one_run_folder_written_once"):
        assert files == ["manifest.json", "training-state-000001", "training-state-000002"]
    for name, expected in (
        ("an_edited_manifest", "is not the manifest of run"),
        ("a_run_that_does_not_exist", "ResumeTraining(run='nope')"),
        ("a_folder_that_is_a_file", "is a file, not a folder of runs"),
        ("ranks_with_other_data", "the run identity of rank 1 differs from rank 0's in: X"),
    ):
        for value in values(checks, name):
            assert value["error"].startswith("CheckpointError: ") and expected in value["error"]
            assert value["seconds"] < 25  # not the 30 s collective timeout
    # a value without content to describe: every fit a run of its own, in
    # the same folder on both ranks, and the main process says why
    for value in values(checks, "a_failing_fit_leaves_no_run_folder"):
        assert "ResumeTraining(run='nope')" in value["error"] and value["folders"] == []
    # a name is not an identity: other data under it is a run of its own
    named, other_named = values(checks, "a_named_run_on_other_data")
    assert named == other_named and named["resumed"] == [False, False, True, True]
    assert [name[:13] for name in named["folders"]] == ["run-baseline-"] * 2
    # a Dataset's own generator, seeded per rank: one run, resumed
    for value in values(checks, "a_dataset_with_a_generator_seeded_per_rank"):
        assert value["resumed"] == [False, True] and len(value["folders"]) == 1
    main, other = values(checks, "an_undescribable_value")
    assert main["folders"] == other["folders"] and len(set(main["folders"])) == 2
    assert len(main["on_disk"]) == 4  # both fits trained both epochs
    (reason,) = set(main["warnings"])  # the same line for both fits: Python shows it once
    assert len(main["warnings"]) == 2
    assert "callbacks__Holding.thing is a builtins.object" in reason and not other["warnings"]


@pytest.mark.multiprocess
def test_a_search_over_tensor_values_with_checkpoints_scores_as_without(interrupted):
    """Two processes, GridSearchCV over criterion__weight tensors: with
    checkpoints in an empty folder, every fit trains (no candidate resumes
    another's run) and the scores are those without checkpoints; run again,
    in the next launch, every fit resumes its own finished run, with the
    same scores."""
    dirname, crashed_checks, rerun_checks = interrupted(2)
    plain = values(crashed_checks, "search-weights/plain")
    first = values(crashed_checks, "search-weights")
    again = values(rerun_checks, "search-weights")
    scores = plain[0]["test_scores"]
    assert scores["split0_test_score"][0] != scores["split0_test_score"][1]
    for rank in range(2):
        assert first[rank]["test_scores"] == plain[rank]["test_scores"] == scores
        assert again[rank]["test_scores"] == scores
        assert plain[rank]["trained"] == first[rank]["trained"] == [3] * 5
        assert again[rank]["trained"] == [0] * 5
        assert first[rank]["best_weight"] == plain[rank]["best_weight"]
    assert len(runs_in(dirname / "weights")) == 5


# --- data that augments at random ---------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("seeding", ["unseeded", "per_rank"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_dataset_that_augments_at_random_resumes_exactly(interrupted, nproc, seeding):
    """A Dataset that draws its noise from the global generators, unseeded
    or seeded per rank: it trains (the replica check reads its rows with
    fixed seeds), the ranks agree on the run, a fit stopped in one
    launch resumes its own run in the next, and the history and weights
    equal those of the same fit without checkpoints, uninterrupted
    (augmented_run.py)."""
    _, crashed_checks, rerun_checks = interrupted(nproc)
    values(crashed_checks, f"augmented-{seeding}")  # stopped where it should
    ranks = values(rerun_checks, f"augmented-{seeding}")
    # one model, bit for bit, however differently the ranks augment
    assert all(rank["params"] == ranks[0]["params"] for rank in ranks)
    for rank in ranks:
        # resumed after epoch 2: its last 3 epochs trained
        assert rank["resumed_from"].endswith("training-state-000002")
        assert len(rank["runs"]) == 1 and len(rank["history"]) == 5
        assert rank["history"] == rank["reference"]["history"]
        assert rank["params"] == rank["reference"]["params"]
