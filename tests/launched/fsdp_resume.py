"""Training states of a module sharded by FSDP2, on N real processes.

``python fsdp_resume.py train SHARED``: on the launch's processes, resumes
at an epoch's end and inside an epoch equal the uninterrupted run bit for
bit; a save that fails before its file is renamed into place leaves the
previous state; rotation removes folders with their files; and a state for
the other launches is saved in ``SHARED`` (``reshard/``), with the full
files of ``save_params`` beside it as the reference.

``python fsdp_resume.py load SHARED sharded|unsharded``: that state loaded on
this launch's processes (another number than saved it), into a sharded net
or one that is not, equals the reference, and trains on.
"""

import os
import signal
import sys
from pathlib import Path

import torch
from common import (
    AcceleratedNet,
    Checks,
    DropoutMLP,
    fresh_state,
    make_accelerator,
    make_data,
    make_fsdp_accelerator,
    outcome,
    report,
)
from skorch.callbacks import Callback, EarlyStopping, LRScheduler

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint
from accel_mixin.checkpoint import dcp_folder
from accel_mixin.distributed.preemption import NoticeBoard

PHASE, SHARED = sys.argv[1], Path(sys.argv[2])
OUT = Path(os.environ.get("ACCEL_RESULTS_DIR", "."))
RANK = int(os.environ.get("RANK", "0"))
X, y = make_data(n=250)
EPOCHS = 4
checks = Checks(deadline=180)


class Stop(Exception):
    pass


class StopAt(Callback):
    """Raise after training batch ``batch`` of epoch ``epoch`` (0: when it begins)."""

    in_run_identity = False  # the rerun without it is the same run

    def __init__(self, epoch, batch=0):
        self.epoch, self.batch = epoch, batch

    def state_dict(self):
        return {}  # a resumed run stops nowhere

    def on_epoch_begin(self, net, **kwargs):
        if not self.batch and len(net.history) == self.epoch:
            raise Stop(f"epoch {self.epoch}")

    def on_batch_end(self, net, training=False, **kwargs):
        if training and self.batch and len(net.history) == self.epoch:
            self.seen_ = getattr(self, "seen_", 0) + 1
            if self.seen_ == self.batch:
                raise Stop(f"batch {self.batch} of epoch {self.epoch}")


class NoticeAt(StopAt):
    """SIGTERM to the last rank after training batch ``batch`` of epoch
    ``epoch``, as a scheduler's notice of preemption."""

    def on_batch_end(self, net, training=False, **kwargs):
        if training and len(net.history) == self.epoch:
            self.seen_ = getattr(self, "seen_", 0) + 1
            last = net.accelerator.process_index == net.accelerator.num_processes - 1
            if self.seen_ == self.batch and last:
                os.kill(os.getpid(), signal.SIGTERM)


def net_of(kind="fsdp", callbacks=(), best_is_highest=False, **kwargs):
    fresh_state()
    accelerator = make_fsdp_accelerator() if kind == "fsdp" else make_accelerator()
    torch.manual_seed(0)
    params = dict(
        module=DropoutMLP,  # dropout draws from every rank's generator
        optimizer=torch.optim.Adam,
        lr=0.02,
        max_epochs=EPOCHS,
        batch_size=16,
        verbose=0,
        callbacks=[
            ("schedule", LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.7)),
            (
                "stopping",
                EarlyStopping(
                    monitor="valid_loss",
                    patience=10,
                    load_best=True,
                    lower_is_better=not best_is_highest,
                ),
            ),
            *callbacks,
        ],
    )
    params.update(kwargs)
    return AcceleratedNet(accelerator=accelerator, **params)


def full_files(net, name):
    """The net's full weights and optimizer state as ``save_params`` writes them."""
    files = {"f_params": str(OUT / f"{name}-params.pt"), "f_optimizer": str(OUT / f"{name}-opt.pt")}
    net.save_params(**files)
    return {key: torch.load(f, weights_only=True) for key, f in files.items()}


def difference(a, b):
    """The largest difference between two states of ``full_files``; inf if
    their structure differs."""
    worst = 0.0
    pa, pb = a["f_params"], b["f_params"]
    if sorted(pa) != sorted(pb):
        return float("inf")
    for key in pa:
        worst = max(worst, float((pa[key].float() - pb[key].float()).abs().max()))
    oa, ob = a["f_optimizer"]["state"], b["f_optimizer"]["state"]
    if sorted(oa) != sorted(ob):
        return float("inf")
    for key in oa:
        for name, value in oa[key].items():
            other = torch.as_tensor(ob[key][name]).float()
            worst = max(worst, float((torch.as_tensor(value).float() - other).abs().max()))
    groups = [
        {k: v for k, v in g.items() if k != "params"} for g in a["f_optimizer"]["param_groups"]
    ]
    others = [
        {k: v for k, v in g.items() if k != "params"} for g in b["f_optimizer"]["param_groups"]
    ]
    return worst if groups == others else float("inf")


def history_of(net):
    return [[row["train_loss"], row["valid_loss"]] for row in net.history]


def best_epoch(net):
    return dict(net.callbacks_)["stopping"].best_epoch_


def partial_folders(folder):
    """What saves left beside their states: partial folders, states set aside."""
    return sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("."))


def state_files(folder):
    """The committed training states (folders with DCP's .metadata)."""
    return sorted(
        p.name
        for p in Path(folder).iterdir()
        if p.name.startswith(("training-state", "state")) and (p / ".metadata").is_file()
    )


if PHASE == "train":

    def resumed_run(name, stop, options=None, **checkpoint):
        """An interrupted run resumed by a new net; its states and the
        resumed net's full files."""
        dirname = str(OUT / name)
        saving = lambda: TrainingCheckpoint(dirname, keep_last=None, **checkpoint)  # noqa: E731
        options = options or {}
        first = net_of(callbacks=[("checkpoint", saving()), ("stop", stop)], **options)
        stopped = outcome(lambda: first.fit(X, y))
        second = net_of(
            callbacks=[("checkpoint", saving()), ("resume", ResumeTraining(dirname))], **options
        )
        second.fit(X, y)
        callbacks = dict(second.callbacks_)
        second.resumed_from_ = os.path.basename(callbacks["resume"].resumed_from_ or "")
        return second, stopped, callbacks["checkpoint"].run_folder_

    reference = net_of().fit(X, y)
    expected = full_files(reference, "reference")

    def against_the_reference(name, stop, **checkpoint):
        """An interrupted run resumed, compared with the uninterrupted one."""
        net, stopped, folder = resumed_run(name, stop, **checkpoint)
        return {
            "stopped": stopped,
            "difference": difference(full_files(net, name), expected),
            "history": history_of(net) == history_of(reference),
            "resumed_from": net.resumed_from_,
            "best_epoch": [best_epoch(net), best_epoch(reference)],
            "files": state_files(folder),
            "folders": partial_folders(folder),
        }

    @checks
    def epoch_end_resume_is_exact():
        # the file written in the background, once every rank wrote its shards
        return against_the_reference("epochs", StopAt(epoch=2), asynchronous=True)

    @checks
    def mid_epoch_resume_is_exact():
        return against_the_reference("batches", StopAt(epoch=2, batch=5), every_n_batches=4)

    @checks
    def early_stoppings_best_weights_come_back():
        """The best epoch is the first (the highest validation loss), so
        that the state saved inside epoch 2 keeps best weights other than
        the current ones (in its folder of shards), which load_best puts
        in place when training ends."""
        options = {"best_is_highest": True}
        first_is_best = net_of(**options).fit(X, y)
        net, stopped, _ = resumed_run(
            "best", StopAt(epoch=2, batch=5), options=options, every_n_batches=4
        )
        return {
            "stopped": stopped,
            "resumed_from": net.resumed_from_,
            "best_epoch": [best_epoch(net), best_epoch(first_is_best)],
            "difference": difference(full_files(net, "best"), full_files(first_is_best, "first")),
        }

    @checks
    def a_notice_stops_saves_and_the_rerun_resumes_exactly():
        # a poll after every batch, as midepoch_run.py's notices
        interval = NoticeBoard.max_interval
        NoticeBoard.max_interval = 1
        try:
            return against_the_reference("notice", NoticeAt(epoch=2, batch=5))
        finally:
            NoticeBoard.max_interval = interval

    @checks
    def rotation_removes_folders_with_files():
        dirname = str(OUT / "rotation")
        net = net_of(callbacks=[("checkpoint", TrainingCheckpoint(dirname, keep_last=1))])
        net.fit(X, y)
        folder = dict(net.callbacks_)["checkpoint"].run_folder_
        return {"files": state_files(folder), "folders": partial_folders(folder)}

    @checks
    def a_failed_save_leaves_the_previous_state():
        net = net_of(max_epochs=1).fit(X, y)
        path = OUT / "failing" / "state.pt"
        path.parent.mkdir(exist_ok=True)
        net.save_state(str(path))
        before = state_files(path.parent)
        good = full_files(net, "good")
        net.partial_fit(X, y)  # other weights, which the failed save held
        real = dcp_folder.commit_folder

        def fail_after_the_shards(*args, **kwargs):
            # every rank wrote its part; rank 0's commit fails
            raise OSError("the disk went away")

        dcp_folder.commit_folder = fail_after_the_shards
        try:
            failed = outcome(lambda: net.save_state(str(path)))
        finally:
            dcp_folder.commit_folder = real
        net.accelerator.wait_for_everyone()  # rank 0 removed the partial folder
        after_failure = state_files(path.parent) + partial_folders(path.parent)
        loaded = net_of()
        loaded.initialize()
        loaded.load_state(str(path))
        restored = difference(full_files(loaded, "restored"), good)
        net.save_state(str(path))  # a complete save removes the other folders
        return {
            "failed": failed,
            "before": before,
            "after_failure": after_failure,
            "restored": restored,
            "after_next_save": state_files(path.parent) + partial_folders(path.parent),
        }

    @checks
    def a_state_for_other_process_counts():
        net = net_of(max_epochs=2).fit(X, y)
        folder = SHARED / "reshard"
        if RANK == 0:
            folder.mkdir(parents=True, exist_ok=True)
        net.wait_for_everyone()
        net.save_state(str(folder / "state.pt"))
        files = {"f_params": str(folder / "params.pt"), "f_optimizer": str(folder / "opt.pt")}
        net.save_params(**files)
        # a DDP net on the same processes loads it too
        ddp = net_of("ddp")
        ddp.initialize()
        ddp.load_state(str(folder / "state.pt"))
        saved = {key: torch.load(f, weights_only=True) for key, f in files.items()}
        ddp_difference = difference(full_files(ddp, "ddp"), saved)
        predicts = len(ddp.predict(X))
        # and the state a DDP net saves loads into a sharded net
        ddp.save_state(str(folder / "ddp-state"))
        sharded = net_of()
        sharded.initialize()
        sharded.load_state(str(folder / "ddp-state"))
        return {
            "ddp_difference": ddp_difference,
            "predicts": predicts,
            "back_to_fsdp_difference": difference(full_files(sharded, "back"), saved),
        }

elif PHASE == "load":
    kind = sys.argv[3]
    folder = SHARED / "reshard"

    @checks
    def a_state_loads_on_another_number_of_processes():
        net = net_of("fsdp" if kind == "sharded" else "ddp")
        torch.manual_seed(1)
        net.initialize()
        net.load_state(str(folder / "state.pt"))
        saved = {
            key: torch.load(folder / f"{name}.pt", weights_only=True)
            for key, name in (("f_params", "params"), ("f_optimizer", "opt"))
        }
        difference_ = difference(full_files(net, "loaded"), saved)
        epochs = len(net.history)
        net.partial_fit(X, y)
        return {
            "difference": difference_,
            "epochs": [epochs, len(net.history)],
            "sharded": type(next(net.module_.parameters())).__name__,
        }


report({"checks": checks.results, "world_size": int(os.environ.get("WORLD_SIZE", "1"))})
