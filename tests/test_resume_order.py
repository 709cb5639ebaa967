"""Exact resume with ``ResumeTraining`` for every kind of LR schedule, whether
``ResumeTraining`` comes before or after the ``LRScheduler`` in ``callbacks``.

skorch's LRScheduler builds its scheduler in ``on_train_begin`` with
``last_epoch=len(net.history) - 1``, and a scheduler's constructor sets the
optimizer's lr. When ResumeTraining comes first, the history and optimizer are
already restored by then: the constructor takes one more step on the
restored lr, and the resumed run must still repeat the uninterrupted one.

One process, in this process: an uninterrupted run of 4 epochs; the same
script preempted when epoch 3 begins (after the checkpoint of epoch 2); and
the same script run again, which resumes and trains epochs 3 and 4.
"""

import pytest
import torch
from accelerate import Accelerator
from common import MLP, AcceleratedNet
from skorch.callbacks import Callback, LRScheduler

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

MAX_EPOCHS = 4
BATCH_SIZE = 32
BATCHES = 5  # training batches an epoch: 160 training samples

# Every schedule's length is explicit: none depends on max_epochs. Where it
# matters, the values are such that building the scheduler with the restored
# history (last_epoch=1, one step more: 2) gives another lr than the restored
# one, so that a scheduler built after the restore shows.
POLICIES = {
    "StepLR-batch": dict(
        policy=torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.7, step_every="batch"
    ),
    "StepLR-epoch": dict(policy=torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
    "MultiStepLR": dict(policy=torch.optim.lr_scheduler.MultiStepLR, milestones=[2, 3], gamma=0.5),
    "CosineAnnealingLR": dict(
        policy=torch.optim.lr_scheduler.CosineAnnealingLR, T_max=6, eta_min=0.001
    ),
    "OneCycleLR": dict(
        policy=torch.optim.lr_scheduler.OneCycleLR, max_lr=0.3, total_steps=30, step_every="batch"
    ),
    "CyclicLR": dict(
        policy=torch.optim.lr_scheduler.CyclicLR,
        base_lr=0.01,
        max_lr=0.2,
        step_size_up=5,
        cycle_momentum=True,
        base_momentum=0.8,
        max_momentum=0.9,
        step_every="batch",
    ),
    "ReduceLROnPlateau": dict(
        policy=torch.optim.lr_scheduler.ReduceLROnPlateau,
        monitor="valid_loss",
        patience=0,
        factor=0.5,
    ),
    "WarmRestartLR": dict(
        policy="WarmRestartLR", min_lr=0.001, max_lr=0.1, base_period=1, period_mult=2
    ),
}


class LrLog(Callback):
    """Records the lr and momentum every training batch and every epoch uses."""

    def on_epoch_begin(self, net, **kwargs):
        group = net.optimizer_.param_groups[0]
        net.history.record("epoch_lr", group["lr"])
        net.history.record("epoch_momentum", group["momentum"])

    def on_batch_begin(self, net, batch=None, training=False, **kwargs):
        if training:
            group = net.optimizer_.param_groups[0]
            net.history.record_batch("lr", group["lr"])
            net.history.record_batch("momentum", group["momentum"])


class Preemption(Callback):
    """Stops the run when epoch 3 begins, after the checkpoint of epoch 2."""

    in_run_identity = False  # not part of what is trained

    def on_epoch_begin(self, net, **kwargs):
        if len(net.history) == 3:
            raise KeyboardInterrupt


def make_net(policy, resume_first, dirname, *extra):
    """The training script: the same net and callbacks for every run."""
    scheduler = LRScheduler(**POLICIES[policy])
    resume = ResumeTraining(dirname)
    callbacks = [resume, scheduler] if resume_first else [scheduler, resume]
    torch.manual_seed(0)
    return AcceleratedNet(
        MLP,
        accelerator=Accelerator(cpu=True),
        max_epochs=MAX_EPOCHS,
        lr=0.1,
        batch_size=BATCH_SIZE,
        optimizer=torch.optim.SGD,
        optimizer__momentum=0.9,
        iterator_train__shuffle=True,
        verbose=0,
        callbacks=[LrLog(), *callbacks, TrainingCheckpoint(dirname), *extra],
    )


def rows(net):
    return [{k: v for k, v in row.items() if k != "dur"} for row in net.history]


def flat(value, path=""):
    if isinstance(value, dict):
        return [item for key, v in value.items() for item in flat(v, f"{path}[{key!r}]")]
    if isinstance(value, list):
        return [item for i, v in enumerate(value) for item in flat(v, f"{path}[{i}]")]
    return [(path, value)]


def first_difference(got, want):
    """Where the resumed history first differs, as history[epoch][key]..."""
    want_flat = dict(flat(want, "history"))
    for path, value in flat(got, "history"):
        if path not in want_flat or want_flat[path] != value:
            return f"{path}: resumed {value!r}, uninterrupted {want_flat.get(path, 'missing')!r}"
    return "the resumed history lacks entries"


def weights(net):
    return {k: v.clone() for k, v in net.module_.state_dict().items()}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize(
    "resume_first", [False, True], ids=["LRScheduler-first", "ResumeTraining-first"]
)
def test_resumed_run_repeats_the_uninterrupted_one(data, tmp_path, policy, resume_first):
    full = make_net(policy, resume_first, tmp_path / "full").fit(*data)
    assert len(full.history) == MAX_EPOCHS

    preempted = make_net(policy, resume_first, tmp_path / "ckpt", Preemption()).fit(*data)
    assert len(preempted.history) == 3  # epoch 3 began, and nothing of it was trained
    resumed = make_net(policy, resume_first, tmp_path / "ckpt").fit(*data)
    assert dict(resumed.callbacks_)["ResumeTraining"].resumed_from_.endswith(
        "training-state-000002"
    )

    # the schedule does change the lr in the epochs that are resumed
    lrs = [b["lr"] for row in full.history[1:] for b in row["batches"] if "lr" in b]
    assert len(set(lrs[BATCHES - 1 :])) > 1, lrs  # from the last batch of epoch 2 on

    # every row (losses, lrs and momenta of every batch, events): bitwise
    got, want = rows(resumed), rows(full)
    assert got == want, first_difference(got, want)
    for name, tensor in weights(full).items():
        assert torch.equal(weights(resumed)[name], tensor), name
