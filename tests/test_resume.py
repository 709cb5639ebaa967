"""Resumable training: exact resume in one and two real processes, rotation,
safety, asynchronous writes. Each run is a new launch, as after a crash."""

import pickle
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from common import MLP, AcceleratedNet
from harness import check_values as values
from harness import run_plain, run_processes
from resume_phases import crashed, once_per_layout
from skorch.callbacks import Callback

from accel_mixin import CheckpointError
from accel_mixin.checkpoint.positions import agreed_checkpoint, checkpoint_name
from accel_mixin.resume.state_folder import read_whole

multiprocess = pytest.mark.multiprocess


def run_folder(dirname):
    """The folder of the one run in ``dirname``."""
    (folder,) = Path(dirname).glob("run-*")
    return folder


# Per layout, one launch runs the uninterrupted fit and crashes every
# scenario (resume_run.py), and one more resumes each in turn; on two
# processes, it then runs the checks of save_state and load_state.
SCENARIOS = {1: ["sync"], 2: ["sync", "async"]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    def crash_and_resume(nproc):
        dirname = tmp_path_factory.mktemp(f"resume{nproc}")
        crash = run_processes(
            "resume_run.py", "crash", dirname, *SCENARIOS[nproc], nproc=nproc, timeout=600
        )
        crashed_checks = crashed(crash)
        for scenario in SCENARIOS[nproc][:-1]:
            values(crashed_checks, scenario)  # stopped by its exception, not another
        if nproc == 2:  # as the crash left it, for the tests of its files
            shutil.copytree(dirname / "sync", dirname / "crashed" / "sync")
        for scenario in SCENARIOS[nproc]:
            # a write killed halfway leaves only a temporary file: never picked
            temporary = run_folder(dirname / scenario) / ".accel_mixin-tmp-0123456789abcdef.tmp"
            temporary.write_bytes(b"half")
        state = ["state"] if nproc == 2 else []
        resumed = run_processes(
            "resume_run.py", "resume", dirname, *SCENARIOS[nproc], *state, nproc=nproc, timeout=600
        )
        return dirname, crashed_checks, [rank["checks"] for rank in resumed.check()]

    return once_per_layout(crash_and_resume)


@multiprocess
@pytest.mark.parametrize("nproc, scenario", [(1, "sync"), (2, "sync"), (2, "async")])
def test_resumed_run_repeats_the_uninterrupted_one_bit_for_bit(launched, nproc, scenario):
    _, crashed_checks, resumed_checks = launched(nproc)
    full, resumed = values(crashed_checks, "full"), values(resumed_checks, scenario)
    for rank_full, rank_resumed in zip(full, resumed, strict=True):
        assert rank_resumed["resumed_from"] == "training-state-000003"
        assert len(rank_resumed["history"]) == 6
        # losses, scores, learning rates, every batch: bitwise
        assert rank_resumed["history"] == rank_full["history"]
        assert rank_resumed["params"] == rank_full["params"]
        assert rank_resumed["misses"] == rank_full["misses"]  # EarlyStopping's counter


@multiprocess
@pytest.mark.parametrize("scenario", ["sync", "async"])
def test_rotation_keeps_the_last_and_numbering_continues(launched, scenario):
    _, _, resumed_checks = launched(2)
    for rank in values(resumed_checks, scenario):
        # keep_last=2; epochs 4 to 6 were numbered after the resume
        assert [f for f in rank["files"] if not f.startswith(".")] == [
            "manifest.json",
            "training-state-000005",
            "training-state-000006",
        ]
        # the temporary file of the killed write (launched): removed by the rotation
        assert not [f for f in rank["files"] if "accel_mixin-tmp" in f]


@multiprocess
def test_a_checkpoint_from_another_number_of_processes_resumes_with_one_warning(launched, tmp_path):
    dirname, crashed_checks, _ = launched(2)
    shutil.copytree(dirname / "crashed" / "sync", tmp_path / "sync")
    # on one process without DDP: state dicts of the module carry no prefix
    resumed = run_plain("resume_run.py", "resume", tmp_path, "sync", timeout=180)
    (rank,) = values([r["checks"] for r in resumed.check()], "sync")
    assert rank["resumed_from"] == "training-state-000003"
    assert len(rank["history"]) == 6
    assert resumed.output.count("was saved by 2 process(es) and resumes on 1") == 1
    # EarlyStopping(load_best=True) restored the best weights, those of
    # epoch 2, saved by two processes: the uninterrupted run's final weights
    assert rank["params"] == values(crashed_checks, "full")[0]["params"]


@multiprocess
def test_training_states_hold_best_weights_only_where_needed_under_clean_keys(launched):
    dirname, _, _ = launched(2)

    def best(epoch):
        state = read_whole(run_folder(dirname / "crashed" / "sync") / f"training-state-{epoch:06d}")
        return state["callbacks"]["best"], state["modules"]["module"]

    # after epoch 2, the best weights are the module's: no second copy
    at_best, _ = best(2)
    assert at_best["best_model_weights_"] is None and at_best["best_epoch_"] == 2
    # after epoch 3, they are epoch 2's, under the bare module's keys
    later, module = best(3)
    assert sorted(later["best_model_weights_"]) == sorted(module)  # .metadata keeps no order
    assert not any(key.startswith("module.") for key in later["best_model_weights_"])


def state_checks(launched):
    # called in the tests, not a fixture: a launch that fails (a break that
    # makes every rank save, say) then fails the test instead of erroring
    # at set-up, which scripts/breaks.py would not count as caught
    _, _, resumed_checks = launched(2)  # state_checks.py, after the resumes
    return resumed_checks


@multiprocess
def test_save_state_and_load_state(launched):
    # one folder each, in the background too: every rank's part and one .metadata
    round_trips = values(state_checks(launched), "round_trip")
    for value in round_trips:
        assert value["folders"] == [[".metadata", "__0_0.distcp", "__1_0.distcp"]] * 2
        assert value["same_predictions"] and value["epochs"] == 2
        assert value["keys"] == [
            "callbacks",
            "epoch",
            "format",
            "history",
            "loop",
            "modules",
            "num_processes",
            "optimizers",
            "rng",
            "scaler",
            "schedulers",
            "version",
        ]


@multiprocess
def test_mismatched_states_raise_clearly_on_every_rank(launched):
    for value in values(state_checks(launched), "mismatch_raises_on_every_rank"):
        assert (
            "'hidden.weight' has shape (32, 20) in the file but (64, 20)" in value["architecture"]
        )
        assert "is not a training state written by save_state" in value["params_file"]
        assert value["missing"].startswith("FileNotFoundError: No checkpoint at nope.pt")


@multiprocess
def test_a_failed_asynchronous_write_raises_on_every_rank(launched):
    failures = values(state_checks(launched), "asynchronous_failure_reaches_every_rank")
    rank0, rank1 = (v["error"] for v in failures)
    # found on every rank as the save begins, before anything is written
    # (DCP would create the directory)
    for error in (rank0, rank1):
        assert re.match(
            r"FileNotFoundError: Cannot save to vanishing/run-\w{12}/training-state-000002", error
        )


@multiprocess
def test_loads_wait_for_asynchronous_saves_in_flight(launched):
    for value in values(state_checks(launched), "load_right_after_an_asynchronous_save"):
        assert value == {"other_net": True, "same_net": True, "params_waited": True}


# --- one process, in this process ----------------------------------------------


def test_the_resumed_checkpoint_ignores_unfinished_and_foreign_files(tmp_path):
    accelerator = Accelerator(cpu=True)
    for name in (
        "training-state-000002.pt",
        "training-state-000010.pt",
        "notes.txt",
        ".accel_mixin-tmp-0123456789abcdef.tmp",
        "training-state-12.pt",
    ):
        (tmp_path / name).write_bytes(b"")
    assert agreed_checkpoint(tmp_path, accelerator) == str(tmp_path / "training-state-000010.pt")
    assert agreed_checkpoint(tmp_path / "missing", accelerator) is None


def test_a_folder_of_training_states_that_cannot_be_read_is_a_clear_error(tmp_path):
    afile = tmp_path / "states"
    afile.write_text("a file")
    with pytest.raises(
        CheckpointError,
        match=rf"Cannot look for training states in {afile}: rank 0: NotADirectoryError: ",
    ):
        agreed_checkpoint(afile, Accelerator(cpu=True))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_load_state_refuses_a_file_that_would_run_code(tmp_path):
    marker = tmp_path / "code_ran"
    torch.save({"epoch": _RunsCode(str(marker))}, tmp_path / "evil.pt")
    net = AcceleratedNet(MLP, accelerator=Accelerator(cpu=True), verbose=0)
    with pytest.raises(CheckpointError, match=r"Refused to load .*evil.pt.*weights_only"):
        net.load_state(tmp_path / "evil.pt")
    assert not marker.exists()


def test_training_state_holds_only_safe_values(data, tmp_path):
    net = AcceleratedNet(MLP, accelerator=Accelerator(cpu=True), max_epochs=2, verbose=0)
    net.fit(*data)
    net.save_state(tmp_path / "state.pt")
    state = read_whole(tmp_path / "state.pt")  # weights_only: raises on any pickle
    assert state["epoch"] == 2 and len(state["rng"]) == 1


def test_load_state_into_an_uninitialized_net_then_partial_fit_continues(data, tmp_path):
    net = AcceleratedNet(MLP, accelerator=Accelerator(cpu=True), max_epochs=4, verbose=0)
    net.set_params(max_epochs=2)
    net.fit(*data)
    net.save_state(tmp_path / "state.pt")
    fresh = AcceleratedNet(MLP, accelerator=net.accelerator, max_epochs=4, verbose=0)
    fresh.load_state(tmp_path / "state.pt")
    assert fresh._local.prepared.wrapped  # pylint: disable=protected-access; prepared after the weights were loaded
    fresh.partial_fit(*data)
    assert len(fresh.history) == 4  # only the remaining epochs


def test_every_n_epochs_and_invalid_arguments(data, tmp_path):
    from accel_mixin.callbacks import TrainingCheckpoint

    net = AcceleratedNet(
        MLP,
        accelerator=Accelerator(cpu=True),
        max_epochs=5,
        verbose=0,
        callbacks=[TrainingCheckpoint(tmp_path, every_n_epochs=2, keep_last=None)],
    )
    net.fit(*data)
    assert sorted(p.name for p in run_folder(tmp_path).iterdir()) == [
        "manifest.json",
        "training-state-000002",
        "training-state-000004",
    ]
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        AcceleratedNet(
            MLP, accelerator=net.accelerator, callbacks=[TrainingCheckpoint(tmp_path, keep_last=0)]
        ).initialize()


def test_a_params_file_is_not_a_training_state(data, tmp_path):
    net = AcceleratedNet(MLP, accelerator=Accelerator(cpu=True)).initialize()
    net.save_params(f_params=tmp_path / "params.pt")
    with pytest.raises(CheckpointError, match="not a training state written by save_state"):
        net.load_state(tmp_path / "params.pt")


class Begun(Callback):
    """Records the epoch number of every epoch that begins into ``epochs``."""

    def __init__(self, epochs):
        self.epochs = epochs

    def on_epoch_begin(self, net, **kwargs):
        self.epochs.append(len(net.history))


def fit_history(net, data):
    net.fit(*data)
    return [{k: v for k, v in row.items() if k != "dur"} for row in net.history]


def test_load_state_then_fit_goes_on_from_the_state(data, tmp_path):
    accelerator = Accelerator(cpu=True)

    def make():
        torch.manual_seed(0)
        return AcceleratedNet(
            MLP, accelerator=accelerator, max_epochs=4, verbose=0, iterator_train__shuffle=True
        )

    uninterrupted = fit_history(make(), data)
    first = make().set_params(max_epochs=2)
    first.fit(*data)
    first.save_state(tmp_path / "state.pt")

    resumed = make()
    resumed.load_state(tmp_path / "state.pt")
    assert fit_history(resumed, data) == uninterrupted  # fit did not start over

    # initialize() after load_state is a fresh start, as in skorch
    restarted = make()
    restarted.load_state(tmp_path / "state.pt")
    restarted.initialize()
    torch.manual_seed(0)  # fit initializes again, as make() would have
    assert fit_history(restarted, data) == uninterrupted


def test_load_state_fit_and_fit_again_the_second_fit_starts_over(data, tmp_path):
    accelerator = Accelerator(cpu=True)
    begun = []

    def make(**kwargs):
        torch.manual_seed(0)
        return AcceleratedNet(
            MLP,
            accelerator=accelerator,
            max_epochs=4,
            verbose=0,
            iterator_train__shuffle=True,
            **kwargs,
        )

    uninterrupted = fit_history(make(), data)
    first = make().set_params(max_epochs=2)
    first.fit(*data)
    first.save_state(tmp_path / "state.pt")

    net = make(callbacks=[Begun(begun)])
    net.load_state(tmp_path / "state.pt")
    net.fit(*data)
    assert begun == [3, 4]  # the epochs that remained
    begun.clear()
    torch.manual_seed(0)  # fit initializes again, as make() would have
    assert fit_history(net, data) == uninterrupted
    assert begun == [1, 2, 3, 4]  # a fresh run: the plan belonged to the fit before


def test_a_net_with_the_callbacks_pickles_inside_a_fit(data, tmp_path):
    from skorch.callbacks import Checkpoint

    from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

    states = tmp_path / "states"
    net = AcceleratedNet(
        MLP,
        accelerator=Accelerator(cpu=True),
        max_epochs=1,
        verbose=0,
        callbacks=[
            TrainingCheckpoint(states),
            ResumeTraining(states),
            # pickles the net at the epoch's end, while the callbacks hold the fit
            Checkpoint(dirname=tmp_path / "pickled", f_pickle="net.pkl", monitor=None),
        ],
    )
    net.fit(*data)
    with open(tmp_path / "pickled" / "net.pkl", "rb") as f:
        assert len(pickle.load(f).history) == 1


def test_a_run_stopped_early_is_not_continued_by_a_rerun(data, tmp_path):
    from skorch.callbacks import EarlyStopping

    from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

    def run():
        # no epoch after the first improves by 100: stops after epoch 3
        stopper = EarlyStopping(
            monitor="train_loss",
            patience=2,
            threshold=100,
            threshold_mode="abs",
            sink=lambda *_: None,
        )
        net = AcceleratedNet(
            MLP,
            accelerator=Accelerator(cpu=True),
            max_epochs=10,
            verbose=0,
            callbacks=[stopper, TrainingCheckpoint(tmp_path), ResumeTraining(tmp_path)],
        )
        return net.fit(*data)

    first = run()
    assert len(first.history) == 3
    with pytest.warns(RuntimeWarning, match="EarlyStopping stopped training, after epoch 3"):
        rerun = run()
    assert dict(rerun.callbacks_)["ResumeTraining"].resumed_from_.endswith("training-state-000003")
    # no epoch trained: EarlyStopping's restored misses_ == patience would
    # otherwise be passed by one and never stop again
    assert rerun.history == first.history


def test_accumulation_windows_across_epoch_ends_resume_in_phase(data, tmp_path):
    # Without sync_with_dataloader a window of gradient accumulation runs on
    # over an epoch's end: after one epoch of 7 batches, the state is in the
    # middle of one. The resumed run steps the optimizers on the batches the
    # uninterrupted one does, not on a window shifted by one batch.
    from accelerate.utils import GradientAccumulationPlugin
    from skorch.callbacks import Callback

    from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

    class Steps(Callback):
        in_run_identity = False

        def on_grad_computed(self, net, named_parameters, **kwargs):
            net.history.record_batch("stepped", True)

    def make(max_epochs, callbacks=()):
        plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
        torch.manual_seed(0)
        return AcceleratedNet(
            MLP,
            accelerator=Accelerator(cpu=True, gradient_accumulation_plugin=plugin),
            max_epochs=max_epochs,
            batch_size=32,  # 200 samples: 7 batches an epoch
            train_split=None,
            verbose=0,
            callbacks=[Steps(), *callbacks],
        )

    def run(dirname, max_epochs):
        net = make(max_epochs, [TrainingCheckpoint(dirname), ResumeTraining(dirname)])
        net.fit(*data)
        return stepped(net)

    def stepped(net):
        return [[bool(b.get("stepped")) for b in row["batches"]] for row in net.history]

    # the window's gradients are not in the state: said, not silent (the
    # states after epochs 1 and 3, of 7 batches each, are inside windows)
    with pytest.warns(RuntimeWarning, match="inside a window of gradient accumulation"):
        uninterrupted = run(tmp_path / "full", 4)
    assert uninterrupted[1][:2] == [True, False]  # the window of batches 7 and 8
    with pytest.warns(RuntimeWarning, match="inside a window of gradient accumulation"):
        run(tmp_path / "resumed", 1)
    with pytest.warns(RuntimeWarning, match="inside a window of gradient accumulation"):
        assert run(tmp_path / "resumed", 4)[1:] == uninterrupted[1:]

    # load_state before fit, instead of ResumeTraining: the same phase; after
    # 3 epochs of 7 batches the state is inside a window again
    (run_folder,) = (tmp_path / "resumed").iterdir()
    net = make(4)
    net.load_state(run_folder / checkpoint_name(3, 0, 1))
    net.fit(*data)
    assert stepped(net)[1:] == uninterrupted[1:]


def test_states_outside_a_window_of_accumulation_save_without_a_warning(data, tmp_path):
    # A window left open by another net's fit (gradient state is shared by
    # every Accelerator of a process) is no reason to warn; nor is an epoch
    # of 7 batches under accumulation 2 when its end syncs, as by default.
    from accelerate.utils import GradientAccumulationPlugin

    def make(**plugin):
        return AcceleratedNet(
            MLP,
            accelerator=Accelerator(
                cpu=True,
                gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, **plugin),
            ),
            max_epochs=1,
            batch_size=32,  # 200 samples: 7 batches an epoch
            train_split=None,
            verbose=0,
        )

    with pytest.warns(RuntimeWarning, match="inside a window of gradient accumulation"):
        open_window = make(sync_with_dataloader=False).fit(*data)
        open_window.save_state(tmp_path / "open.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net = make().initialize()
        net.save_state(tmp_path / "before.pt")
        net.fit(*data)
        net.save_state(tmp_path / "after.pt")


def test_a_stop_by_anything_but_early_stopping_is_resumed(data, tmp_path):
    from skorch.callbacks import Callback

    from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

    class TimeBudget(Callback):  # stops cleanly before the job is preempted
        in_run_identity = False  # not part of what is trained

        def on_epoch_end(self, net, **kwargs):
            if len(net.history) == 2:
                raise KeyboardInterrupt

    def run(*extra):
        net = AcceleratedNet(
            MLP,
            accelerator=Accelerator(cpu=True),
            max_epochs=4,
            verbose=0,
            callbacks=[*extra, TrainingCheckpoint(tmp_path), ResumeTraining(tmp_path)],
        )
        return net.fit(*data)

    assert len(run(TimeBudget()).history) == 2
    assert len(run().history) == 4


def test_a_failed_load_state_leaves_nothing_to_go_on_from(data, tmp_path):
    accelerator = Accelerator(cpu=True)
    net = AcceleratedNet(MLP, accelerator=accelerator, max_epochs=2, verbose=0)
    net.fit(*data)
    net.save_state(tmp_path / "state.pt")
    net.save_params(f_params=tmp_path / "params.pt")

    begun = []
    other = AcceleratedNet(
        MLP, accelerator=accelerator, max_epochs=3, verbose=0, callbacks=[Begun(begun)]
    )
    other.load_state(tmp_path / "state.pt")
    with pytest.raises(CheckpointError):
        other.load_state(tmp_path / "params.pt")
    other.fit(*data)
    assert begun == [1, 2, 3]  # started afresh, as skorch's fit does


def test_the_gradient_scaler_resumes(data, tmp_path):
    # accelerate builds a GradScaler for fp16 on GPUs only; torch's CPU
    # GradScaler goes through the same code paths of accelerate and ours
    accelerator = Accelerator(cpu=True)

    def make(max_epochs):
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
        torch.manual_seed(0)
        return AcceleratedNet(
            MLP,
            accelerator=accelerator,
            max_epochs=max_epochs,
            verbose=0,
            iterator_train__shuffle=True,
        )

    uninterrupted = fit_history(make(4), data)
    scaler_after = accelerator.scaler.state_dict()
    assert scaler_after["scale"] > 2.0**10  # it grew: there is a state to keep

    first = make(2)
    first.fit(*data)
    first.save_state(tmp_path / "state.pt")
    resumed = make(4)  # a fresh scaler
    resumed.load_state(tmp_path / "state.pt")
    assert fit_history(resumed, data) == uninterrupted
    assert accelerator.scaler.state_dict() == scaler_after


def test_an_asynchronous_write_in_flight_when_training_fails_is_finished(tmp_path):
    # the job dies of an exception while the last checkpoint is still being
    # written: the state must be committed, not cut off by the interpreter's exit
    script = tmp_path / "job.py"
    script.write_text(f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent / "launched")!r})
sys.path.insert(0, {str(Path(__file__).parents[1])!r})  # this checkout's accel_mixin
import torch
from accelerate import Accelerator
from skorch.callbacks import Callback
import accel_mixin.checkpoint.dcp_folder as dcp_folder
from accel_mixin.callbacks import TrainingCheckpoint
from common import AcceleratedNet, MLP, make_data

commit_folder = dcp_folder.commit_folder
def slow_commit(*args):
    time.sleep(1.5)
    commit_folder(*args)
dcp_folder.commit_folder = slow_commit

class Boom(Callback):
    def on_epoch_begin(self, net, **kwargs):
        if len(net.history) == 2:
            raise RuntimeError('boom')

net = AcceleratedNet(MLP, accelerator=Accelerator(cpu=True), max_epochs=3, verbose=0,
                     callbacks=[TrainingCheckpoint({str(tmp_path / "ckpt")!r}, asynchronous=True),
                                Boom()])
net.fit(*make_data(100))
""")
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 1 and "RuntimeError: boom" in out.stderr
    (state,) = (tmp_path / "ckpt").glob("run-*/training-state-000001")
    assert read_whole(state)["epoch"] == 1


def test_the_asynchronous_save_is_let_go_when_training_ends(data, tmp_path):
    from accel_mixin.callbacks import TrainingCheckpoint

    net = AcceleratedNet(
        MLP,
        accelerator=Accelerator(cpu=True),
        max_epochs=2,
        verbose=0,
        callbacks=[TrainingCheckpoint(tmp_path, asynchronous=True)],
    )
    net.fit(*data)
    # the save in flight holds DCP's CPU copy of the state
    assert net._local.saves.in_flight is None  # pylint: disable=protected-access


@pytest.mark.parametrize("callback", ["TrainingCheckpoint", "ResumeTraining"])
def test_on_a_plain_skorch_net_the_callbacks_say_why_not(callback, data, tmp_path):
    from skorch import NeuralNetClassifier

    import accel_mixin.callbacks

    cls = getattr(accel_mixin.callbacks, callback)
    net = NeuralNetClassifier(MLP, max_epochs=1, verbose=0, callbacks=[cls(tmp_path)])
    with pytest.raises(TypeError, match="AccelerateMixin in front"):
        net.fit(*data)


# --- what ResumeTraining says ----------------------------------------------------


def said(launch, rank):
    """The lines about ResumeTraining in the rank's own stdout and stderr
    (a plain run has one stream), by scenario of ``announced_run.py``."""
    parts, name = {}, None
    for stream in launch.rank_outputs[rank]:
        for line in stream.splitlines():
            if line.startswith("=== "):
                name = line[4:]
                parts.setdefault(name, [])
            elif "ResumeTraining" in line:
                parts.setdefault(name, []).append(line)
    return parts


@pytest.fixture(scope="module")
def announced(tmp_path_factory):
    """Per layout, one launch of every scenario (``announced_run.py``):
    its folder, every rank's checks and the launch."""

    def launch(nproc):
        dirname = tmp_path_factory.mktemp(f"announced{nproc}")
        if nproc == 1:  # as `python script.py` runs it
            done = run_plain("announced_run.py", dirname, timeout=300)
        else:
            done = run_processes("announced_run.py", dirname, nproc=nproc, timeout=300)
        return dirname, [rank["checks"] for rank in done.check()], done

    return once_per_layout(launch)


def resumed_line(dirname, checks, scenario, after):
    """The line of a resume, from the file that every rank resumed from."""
    (resumed_from,) = {rank["resumed_from"] for rank in values(checks, scenario)}
    key = Path(resumed_from).parent.name[len("run-") :]
    path = dirname / resumed_from
    return f"ResumeTraining: resuming run {key} from {path} (after {after})"


@multiprocess
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_resume_names_the_file_and_where_it_continues(announced, nproc):
    dirname, checks, launch = announced(nproc)
    lines = said(launch, 0)
    assert lines["first"] == [] and lines["interrupted"] == []  # nothing to resume
    assert lines["resumed"] == [resumed_line(dirname, checks, "resumed", "epoch 2")]
    # inside an epoch: the state of batch 2 of epoch 2, saved on nproc processes
    (line,) = lines["midepoch"]
    assert line == resumed_line(dirname, checks, "midepoch", "batch 2 of epoch 2")
    assert line.endswith(
        f"training-state-000001-batch-000002-ranks-{nproc} (after batch 2 of epoch 2)"
    )
    # through the sink given, a logger here
    assert lines["logged-again"] == [
        "LOG " + resumed_line(dirname, checks, "logged-again", "epoch 2")
    ]
    # ResumeTraining alone, resuming what another fit saved: no warning
    assert lines["reader"] == [resumed_line(dirname, checks, "reader", "epoch 4")]
    assert lines["quiet"] == []  # verbose=0
    for rank in values(checks, "quiet"):
        assert rank["resumed_from"].endswith("training-state-000003")


@multiprocess
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_fresh_start_next_to_other_runs_states_says_so(announced, nproc):
    dirname, _, launch = announced(nproc)
    lines = said(launch, 0)
    runs = {p.name[4:] for p in (dirname / "first").glob("run-*")}
    (line,) = lines["other"]
    assert re.fullmatch(
        rf"ResumeTraining: run (\w+) starts afresh in {dirname}/first, next to 1 other "
        r"run\(s\); it differs from the newest, (\w+), in: lr: 0.1 -> 0.05",
        line,
    )
    (line,) = lines["logged"]
    assert line.startswith("LOG ResumeTraining: run ") and "next to 2 other run(s)" in line
    assert line.endswith("in: lr: 0.05 -> 0.2") and len(runs) == 3
    # a folder holding a state outside run folders, as before run folders existed
    (line,) = lines["legacy"]
    assert line.startswith("ResumeTraining: run ") and line.endswith(
        f"starts afresh in {dirname}/legacy; the 1 training state(s) there outside run "
        "folders were written before run folders existed and are never resumed (load one "
        "with net.load_state(path))"
    )


@multiprocess
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_resume_folder_that_no_checkpoint_writes_to_warns(announced, nproc):
    dirname, checks, launch = announced(nproc)
    lines = said(launch, 0)
    (warning,) = lines["misspelt"]
    assert warning.endswith(
        f"UserWarning: ResumeTraining resumes from {dirname}/mispelt, but the net's "
        f"TrainingCheckpoint writes to {dirname}/misspelt: a rerun never resumes what this "
        "fit saves. Give both the same dirname."
    )
    (warning,) = lines["unsaved"]
    assert warning.endswith(
        f"UserWarning: ResumeTraining: {dirname}/unsaved holds no training state of this "
        "fit's run, and the net has no TrainingCheckpoint: nothing is resumed, and no state "
        "is saved for a rerun to resume. Add TrainingCheckpoint with the same dirname to the "
        "callbacks."
    )
    assert not [line for line in lines["reader"] if "Warning" in line]
    for rank in values(checks, "misspelt"):
        assert rank == {"resumed_from": None, "epochs": 2}


@multiprocess
def test_nothing_is_said_on_other_ranks(announced):
    _, checks, launch = announced(2)
    values(checks, "reader")  # every scenario ran, on both ranks
    assert [line for lines in said(launch, 0).values() for line in lines]
    # the logger's handler writes to rank 1's stdout, fit or no fit
    assert said(launch, 1) == {name: [] for name in said(launch, 0)}
