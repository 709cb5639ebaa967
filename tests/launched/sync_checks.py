"""One truth on every rank: synced history, scores over the whole data,
skorch's callbacks, one voice, failures that reach every rank.

Usage: torchrun --nproc_per_node 2 sync_checks.py
"""

import base64
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import tqdm
import uneven_check
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, gather_object
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    error_and_seconds,
    make_accelerator,
    make_data,
    report,
)
from sklearn.metrics import accuracy_score
from skorch.callbacks import (
    BatchScoring,
    Callback,
    Checkpoint,
    EarlyStopping,
    EpochScoring,
    LoadInitState,
    LRScheduler,
    ProgressBar,
    TrainEndCheckpoint,
)
from skorch.callbacks import logging as skorch_logging

from accel_mixin.callbacks import ResumeTraining

ORIGINAL_TQDM = tqdm.tqdm
accelerator = make_accelerator()
rank = accelerator.process_index
X, y = make_data(600, noise=0.3, seed=1)  # noisy: scores move up and down
checks = Checks()


def make_net(**kwargs):
    params = dict(
        module=MLP,
        accelerator=accelerator,
        max_epochs=3,
        lr=0.3,
        batch_size=16,
        verbose=0,
        iterator_train__shuffle=True,
    )
    params.update(kwargs)
    return AcceleratedNet(**params)


def spread(net):
    mine = torch.cat([p.detach().flatten() for p in net.module_.parameters()]).numpy()
    everyone = gather_object([mine])
    return float(max(np.abs(other - everyone[0]).max() for other in everyone))


def rows(net):
    """The history as plain data, for comparing ranks."""
    return [dict(row) for row in net.history]


class CountWrites:
    """Counts the files this rank writes: save_params' files and f_pickle."""

    def __enter__(self):
        import skorch.callbacks.training as training

        import accel_mixin.checkpoint.atomic_files as files

        self.calls = []
        self.saved = (files.atomic_files, training.open_file_like)

        def atomic_files(paths, **kwargs):
            paths = list(paths)
            self.calls.extend(str(p) for p in paths)
            return self.saved[0](paths, **kwargs)

        def open_file_like(f, mode):
            self.calls.append(str(f))
            return self.saved[1](f, mode)

        files.atomic_files, training.open_file_like = atomic_files, open_file_like
        return self

    def __exit__(self, *exc):
        import skorch.callbacks.training as training

        import accel_mixin.checkpoint.atomic_files as files

        files.atomic_files, training.open_file_like = self.saved


@checks
def rows_and_scores():
    net = make_net(
        callbacks=[
            EpochScoring(
                "accuracy", lower_is_better=False, use_caching=False, name="valid_acc_nocache"
            ),
            BatchScoring("accuracy", lower_is_better=False, name="valid_acc_batch"),
        ]
    )
    net.fit(X, y)
    _, dataset_valid = net.get_split_datasets(X, y)
    X_valid, y_valid = X[dataset_valid.indices], y[dataset_valid.indices]
    proba = net.predict_proba(X_valid)
    eps = np.finfo(np.float32).eps
    last = net.history[-1]
    return {
        "rows": rows(net),
        "n_train": len(X) - len(X_valid),
        "n_valid": len(X_valid),
        "train_sizes": [
            sum(b["train_batch_size"] for b in r["batches"] if "train_batch_size" in b)
            for r in net.history
        ],
        "valid_sizes": [
            sum(b["valid_batch_size"] for b in r["batches"] if "valid_batch_size" in b)
            for r in net.history
        ],
        "scores": {
            k: last[k] for k in ("valid_acc", "valid_acc_nocache", "valid_acc_batch", "valid_loss")
        },
        "one_process": {
            "accuracy": accuracy_score(y_valid, net.predict(X_valid)),
            "loss": float(-np.mean(np.log(proba[np.arange(len(y_valid)), y_valid] + eps))),
        },
    }


@checks
def checkpoint_on_best_accuracy():
    net = make_net(
        max_epochs=12,
        lr=1.0,
        callbacks=[Checkpoint(monitor="valid_acc_best", dirname="cp_best", f_pickle="net.pkl")],
    )
    with CountWrites() as writes:
        net.fit(X, y)
    with open("cp_best/net.pkl", "rb") as f:  # every rank: predict is collective
        restored_rows = len(pickle.load(f).predict(X[:333]))
    return {
        "event_cp": net.history[:, "event_cp"],
        "writes": len(writes.calls),
        "pickle_rows": restored_rows,
    }


@checks
def early_stopping():
    net = make_net(max_epochs=40, lr=1.0, callbacks=[EarlyStopping(patience=2)])
    net.fit(X, y)
    return {"epochs": len(net.history)}


@checks
def load_best():
    net = make_net(
        max_epochs=6,
        lr=1.0,
        callbacks=[Checkpoint(monitor="valid_loss_best", dirname="cp_load_best", load_best=True)],
    )
    net.fit(X, y)
    return {"rows": rows(net), "spread": spread(net)}


@checks
def load_init_state_resume():
    first = make_net(max_epochs=2, callbacks=[Checkpoint(monitor=None, dirname="cp_resume")])
    first.fit(X, y)
    checkpoint = Checkpoint(monitor=None, dirname="cp_resume")
    second = make_net(max_epochs=2, callbacks=[checkpoint, LoadInitState(checkpoint)])
    second.fit(X, y)
    return {"rows": rows(second), "epochs": len(second.history), "spread": spread(second)}


@checks
def reduce_lr_on_plateau():
    net = make_net(
        max_epochs=8,
        lr=1.0,
        callbacks=[
            LRScheduler(
                torch.optim.lr_scheduler.ReduceLROnPlateau,
                monitor="valid_loss",
                patience=0,
                factor=0.5,
            )
        ],
    )
    net.fit(X, y)
    return {"event_lr": net.history[:, "event_lr"], "spread": spread(net)}


@checks
def train_end_checkpoint():
    net = make_net(callbacks=[TrainEndCheckpoint(dirname="cp_end")])
    with CountWrites() as writes:
        net.fit(X, y)
    return {"writes": len(writes.calls), "files": sorted(p.name for p in Path("cp_end").iterdir())}


class WarningMLP(MLP):
    """Warns in every forward pass outside training."""

    def forward(self, X):
        if not self.training:
            warnings.warn("forward pass in evaluation mode", UserWarning)
        return super().forward(X)


@checks
def one_voice():
    # in both streams: warnings and progress bars go to stderr
    for stream in (sys.stdout, sys.stderr):
        print("=== one voice starts", file=stream, flush=True)
    # monitor='valid_loss' makes skorch's Checkpoint warn every epoch
    net = make_net(
        verbose=1,
        max_epochs=2,
        callbacks=[ProgressBar(), Checkpoint(monitor="valid_loss", dirname="cp_voice", sink=print)],
    )
    net.fit(X, y)
    # DDP's reducer warns from C++ on every rank, unless TORCH_CPP_LOG_LEVEL=ERROR
    unused = make_net(
        max_epochs=1,
        accelerator=Accelerator(
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)]
        ),
    )
    unused.fit(X, y)
    # a Python warning in the module's forward, during inference
    warns = make_net(module=WarningMLP, max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fit's warnings are not the point here
        warns.fit(X, y)
    warns.predict(X)
    for stream in (sys.stdout, sys.stderr):
        print("=== one voice ends", file=stream, flush=True)
    return {"epochs": len(net.history)}


class RecordingBar(tqdm.tqdm):
    """tqdm that remembers, when it closes, how far it got and its total."""

    closed: ClassVar[list] = []

    def close(self):
        RecordingBar.closed.append((self.n, self.total))
        super().close()


@checks
def progress_bars_count_this_ranks_batches():
    bars = []
    for batches_per_epoch in ("auto", "count"):
        RecordingBar.closed = []
        skorch_logging.tqdm.tqdm = RecordingBar
        try:
            make_net(max_epochs=2, callbacks=[ProgressBar(batches_per_epoch)]).fit(X, y)
        finally:
            skorch_logging.tqdm.tqdm = ORIGINAL_TQDM
        bars.append(list(RecordingBar.closed))
    return bars


def read_scalars(files):
    """Every scalar of the event files, read with tensorboard's own reader:
    {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for path in files:
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            out.setdefault(tag, []).extend(
                (event.step, event.value) for event in accumulator.Scalars(tag)
            )
    return out


@checks
def tensorboard_once():
    """skorch's TensorBoard, with the writer made on the main process only
    (the README's way) and, as a user may write it, on every rank."""
    from skorch.callbacks import TensorBoard
    from torch.utils.tensorboard import SummaryWriter

    out = {}
    for layout in ("main_only", "every_rank"):
        logdir = Path(f"tb_{layout}").resolve()
        writer = (
            SummaryWriter(str(logdir / f"rank{rank}"))
            if layout == "every_rank"
            else SummaryWriter(str(logdir))
            if accelerator.is_main_process
            else None
        )
        net = make_net(max_epochs=3, callbacks=[TensorBoard(writer)])
        net.fit(X, y)
        if writer is not None:
            writer.close()
        accelerator.wait_for_everyone()  # every writer closed
        keys = ("train_loss", "valid_loss", "valid_acc", "dur")
        files = sorted(logdir.rglob("events.out.tfevents.*"))
        out[layout] = {
            "event_files": len(files),
            "scalars": read_scalars(files),
            "history": {key: net.history[:, key] for key in keys},
        }
    return out


@checks
def trackers_once():
    """accelerate's trackers (log_with): the main process logs each row."""
    logdir = Path("trackers").resolve()
    tracked = make_accelerator(log_with="tensorboard", project_dir=logdir)
    net = make_net(accelerator=tracked, max_epochs=3)
    net.fit(X, y)
    # as end_training does, which would also end the process group here
    for tracker in tracked.trackers:  # the main process's only
        tracker.finish()
    tracked.wait_for_everyone()
    keys = ("train_loss", "valid_loss", "valid_acc")
    files = sorted(logdir.rglob("events.out.tfevents.*"))
    return {
        "runs": sorted(str(path.parent.relative_to(logdir)) for path in files),
        "scalars": read_scalars(files),
        "history": {key: net.history[:, key] for key in keys},
    }


class ProfilerSteps(Callback):
    """Steps a profiler after each training batch, for its schedule."""

    def __init__(self, profiler):
        self.profiler = profiler

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.profiler.step()


@checks
def profile_a_fit():
    """accelerate's ProfileKwargs, through accelerator.profile() around fit:
    the whole fit, then a schedule stepped per batch by a callback."""
    from accelerate.utils import ProfileKwargs

    traces = Path("traces").resolve()
    handler = ProfileKwargs(activities=["cpu"], output_trace_dir=str(traces))
    profiled = make_accelerator(kwargs_handlers=[handler])
    with profiled.profile() as profiler:
        make_net(accelerator=profiled, max_epochs=1).fit(X, y)
    names = {event.key for event in profiler.key_averages()}
    ready = []
    scheduled = ProfileKwargs(
        activities=["cpu"],
        schedule_option={"wait": 1, "warmup": 1, "active": 2, "repeat": 1},
        on_trace_ready=lambda p: ready.append(
            sum(e.count for e in p.key_averages() if e.key == "aten::linear")
        ),
    )
    with profiled.profile(scheduled) as profiler:
        make_net(accelerator=profiled, max_epochs=1, callbacks=[ProfilerSteps(profiler)]).fit(X, y)
    return {
        "traces": sorted(path.name for path in traces.iterdir()),
        "linear": "aten::linear" in names,
        "gloo": sorted(name for name in names if "gloo" in name)[:3],
        "scheduled": ready,
    }


class SavingLogger(Callback):
    """As WandbLogger(save_model=True) and MlflowLogger(create_artifact=True)
    do: a logger that saves the net's parameters."""

    main_process_only = True

    def on_epoch_end(self, net, **kwargs):
        net.save_params(f_params=f"logged-{len(net.history)}.pt")


class PredictingLogger(Callback):
    """A logger that would need every rank: predict is collective."""

    main_process_only = True

    def on_epoch_end(self, net, **kwargs):
        net.predict(X[:10])


@checks
def loggers_that_save_or_predict():
    saving = error_and_seconds(lambda: make_net(max_epochs=2, callbacks=[SavingLogger()]).fit(X, y))
    saved = sorted(p.name for p in Path(".").glob("logged-*.pt"))
    predicting = error_and_seconds(
        lambda: make_net(max_epochs=2, callbacks=[PredictingLogger()]).fit(X, y)
    )
    return {"saving": saving, "saved": saved, "predicting": predicting}


@checks
def padding_only_batches_are_not_counted():
    # 100 samples in batches of 16: 7 batches in one process; under two, rank
    # 1's fourth batch is padding only
    net = make_net(max_epochs=1, train_split=None, iterator_train__shuffle=False)
    net.fit(X[:100], y[:100])
    row = net.history[-1]
    return {
        "count": row["train_batch_count"],
        "records": len(row["batches"]),
        "samples": sum(batch["train_batch_size"] for batch in row["batches"]),
    }


@checks
def pickle_made_on_each_rank():
    net = make_net(max_epochs=1, verbose=1).fit(X, y)
    return base64.b64encode(pickle.dumps(net)).decode()


class FailOnRank1(Callback):
    """Raises in one notification, in the second epoch, on rank 1 only; in
    ``on_batch_end``, at a validation batch (no collective per batch there:
    rank 0 meets the failure at the epoch's end, not DDP's next all-reduce)."""

    def __init__(self, hook):
        self.hook = hook
        setattr(self, hook, self.fail)

    def fail(self, net, training=None, **kwargs):
        per_batch = self.hook == "on_batch_end"
        if rank == 1 and len(net.history) == 2 and (not per_batch or training is False):
            raise ValueError("boom from rank 1")


@checks
def error_in_a_callback_on_rank_1():
    results = {}
    for hook in ("on_epoch_end", "on_epoch_begin", "on_train_begin", "on_batch_end"):
        # Checkpoint comes after the failing callback: rank 0 waits in save_params
        # ResumeTraining compares the ranks' files at train begin: after a
        # failed callback, only on the ranks that did not fail
        net = make_net(
            max_epochs=4,
            callbacks=[
                FailOnRank1(hook),
                ResumeTraining("no_states"),
                Checkpoint(monitor=None, dirname="cp_error"),
            ],
        )
        if hook == "on_train_begin":
            net.set_params(max_epochs=2)
            net.fit(X, y)
            net.set_params(warm_start=True)  # the second fit has a history of 2
        start = time.monotonic()
        try:
            net.fit(X, y)
            results[hook] = {"error": None}
        except Exception as exc:  # pylint: disable=broad-except
            results[hook] = {
                "error": f"{type(exc).__name__}: {exc}",
                "seconds": time.monotonic() - start,
            }
    return results


# scripts of their own, in this launch: one process group's start-up for all
uneven_check.add_checks(checks)
try:
    import sequence_outputs  # transformers: the examples extra
except ImportError:
    pass
else:
    sequence_outputs.add_checks(checks)
report({"rank": rank, "checks": checks.results})
