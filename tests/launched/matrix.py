"""The invariant matrix: every training feature under every precision and
gradient accumulation, in several processes.

Usage: torchrun --nproc_per_node N matrix.py DIRNAME CONFIG [CONFIG ...]

DIRNAME
  A directory every rank sees, for the cases that write checkpoints.
CONFIG
  ``PRECISION:BATCH_SIZE:N_SAMPLES:CASES``, one configuration of the matrix;
  a launch fits every configuration it is given in turn, so that a process
  group's start-up is paid once per number of processes.

  PRECISION
    ``fp32``; ``bf16`` (``Accelerator(mixed_precision='bf16')``, autocast
    on CPU); or ``fp16``, emulated: torch's CPU ``GradScaler`` set on an
    fp32 accelerator, which sends training through the code paths of
    accelerate's fp16 (scaled backward, ``scaler.step``) without
    half-precision arithmetic.
  BATCH_SIZE
    Per process. The tests run N processes with batch ``b`` and 1 process
    with ``N b``: the same samples per step.
  N_SAMPLES
    The data's size (80 splits into whole global batches).
  CASES
    ``all``, or ``equivalent``: the cases without a per-batch LR schedule,
    the only ones a comparison across numbers of processes reads.

Every case of the configuration is fitted with gradient accumulation 1 and
2, each from the same seed, and reports per rank: whether it fitted, a
digest of every parameter, the parameters themselves (fp32 and fp16 only,
to compare across launches) and the train loss of every epoch. An exception
in a case is recorded and the next case runs.
"""

import gc
import hashlib
import os
import sys
from pathlib import Path

import torch
from accelerate.state import PartialState
from common import (
    AcceleratedNet,
    Checks,
    accelerator_for,
    freeze_what_is_loaded,
    make_data,
    report,
)
from skorch.callbacks import (
    Checkpoint,
    EarlyStopping,
    Freezer,
    GradientNormClipping,
    InputShapeSetter,
    LoadInitState,
    LRScheduler,
    ParamMapper,
    Unfreezer,
    WarmRestartLR,
)
from torch.optim import lr_scheduler

__all__ = [
    "ACCUMULATION",
    "CASES",
    "EQUIVALENT",
    "PER_BATCH_SCHEDULES",
    "PRECISIONS",
]

PRECISIONS = ("fp32", "bf16", "fp16")
ACCUMULATION = (1, 2)
# 80 samples: ValidSplit(5) keeps 64 for training, which 2 processes with
# batch 8 and accumulation 2 (32 samples per step) split without padding, so
# that 2 processes with batch b see exactly what 1 process with 2 b sees.
N_SAMPLES = 80
MAX_EPOCHS = 4
# Well below the gradient norm of this problem (about 0.1 to 0.5): it clips.
CLIP = 0.02

# Cases whose LR schedule steps per batch. accelerate steps a prepared
# per-batch scheduler once per process per call, so on N processes it
# advances N times per optimizer step (the history counts every batch of the
# whole data); 2 processes with batch b then differ from 1 process with 2 b
# by design.
PER_BATCH_SCHEDULES = ("step_lr_per_batch", "one_cycle_lr", "cyclic_lr")


class MLP(torch.nn.Module):
    """Tiny, without dropout; ``input_dim`` for InputShapeSetter, ``frozen``
    to build the hidden layer frozen, ``logits`` for a second stage."""

    def __init__(self, input_dim=20, hidden=8, frozen=False, logits=False):
        super().__init__()
        self.hidden = torch.nn.Linear(input_dim, hidden)
        self.out = torch.nn.Linear(hidden, 2)
        self.logits = logits
        if frozen:
            self.hidden.requires_grad_(False)

    def forward(self, X):
        out = self.out(torch.relu(self.hidden(X)))
        return out if self.logits else torch.softmax(out, dim=-1)


class Net(AcceleratedNet):
    """The net of every case but those that subclass it."""


class TwoOptimizerNet(Net):
    """Two modules, each with its own optimizer, as skorch documents custom
    optimizers: ``optimizer2_`` set in ``initialize_optimizer``."""

    def initialize_module(self):
        super().initialize_module()
        self.module2_ = torch.nn.Linear(2, 2)
        return self

    def initialize_optimizer(self, *_, **__):
        args, kwargs = self.get_params_for_optimizer("optimizer", self.module_.named_parameters())
        kwargs.setdefault("lr", self.lr)
        self.optimizer_ = self.optimizer(*args, **kwargs)
        args, kwargs = self.get_params_for_optimizer("optimizer2", self.module2_.named_parameters())
        kwargs.setdefault("lr", self.lr)
        self.optimizer2_ = torch.optim.SGD(*args, **kwargs)
        return self

    def infer(self, x, **fit_params):
        return torch.softmax(self.module2_(super().infer(x, **fit_params)), dim=-1)


class OwnStepNet(Net):
    """A ``train_step`` of the user's own, as accelerate's examples write one:
    forward and backward, step and zero, within ``accelerator.accumulate``."""

    def train_step(self, batch, **fit_params):
        with self.accelerator.accumulate(self.module_):
            step = self.train_step_single(batch, **fit_params)
            self.optimizer_.step()
            self.optimizer_.zero_grad()
        return step


class ClampingNet(Net):
    """The mixin's ``train_step`` and something after it, here a constraint on
    the weights."""

    def train_step(self, batch, **fit_params):
        step = super().train_step(batch, **fit_params)
        with torch.no_grad():
            for _, param in self.get_all_learnable_params():
                param.clamp_(-0.25, 0.25)
        return step


def halve(param):
    with torch.no_grad():
        param.mul_(0.5)


def quiet(*_):
    """A sink for callbacks that would print on every rank."""


class Case:
    """What one case needs: a net factory with the launch's settings, and a
    directory of its own that every rank of the launch agrees on."""

    def __init__(self, accelerator, precision, batch_size, dirname, name, accumulation):
        self.accelerator = accelerator
        self.precision = precision
        self.batch_size = batch_size
        self.dirname = str(Path(dirname) / f"accum{accumulation}" / name)
        os.makedirs(self.dirname, exist_ok=True)

    def net(self, cls=Net, seed=0, **overrides):
        if self.precision == "fp16":
            # a fresh scaler per net: no case inherits another's scale
            self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        torch.manual_seed(seed)
        params = dict(
            module=MLP,
            accelerator=self.accelerator,
            max_epochs=MAX_EPOCHS,
            lr=0.2,
            batch_size=self.batch_size,
            iterator_train__shuffle=False,
            verbose=0,
        )
        params.update(overrides)
        return cls(**params)


def schedule(policy, **kwargs):
    return lambda case: case.net(callbacks=[LRScheduler(policy, **kwargs)])


def clipping(case):
    return case.net(callbacks=[GradientNormClipping(gradient_clip_value=CLIP)])


def freezer(case):
    # freezes when epoch 1 begins: after accelerate wrapped the module in DDP
    return case.net(callbacks=[Freezer("hidden.*")])


def unfreezer(case):
    # frozen when accelerate prepares the module, trainable from epoch 2
    return case.net(module__frozen=True, callbacks=[Unfreezer("hidden.*", at=2)])


def freezer_then_unfreezer(case):
    return case.net(callbacks=[Freezer("hidden.*", at=1), Unfreezer("hidden.*", at=3)])


def param_mapper(case):
    return case.net(callbacks=[ParamMapper("hidden.weight", fn=halve, at=2)])


def early_stopping(case):
    # no epoch after the first improves by 100: stops after epoch 3 of 4 and
    # restores the weights of epoch 1
    return case.net(
        callbacks=[
            EarlyStopping(
                monitor="valid_loss",
                patience=2,
                threshold=100,
                threshold_mode="abs",
                load_best=True,
                sink=quiet,
            )
        ]
    )


def checkpoint(case):
    # saves after epochs 1 and 2 only, so that loading the best at the end
    # replaces the weights of epoch 4
    return case.net(
        callbacks=[
            Checkpoint(
                monitor=lambda net: len(net.history) <= 2, load_best=True, dirname=case.dirname
            )
        ]
    )


def load_init_state(case):
    first = case.net(max_epochs=2, callbacks=[Checkpoint(dirname=case.dirname)])
    first.fit(*DATA)
    cp = Checkpoint(dirname=case.dirname)
    # another seed: what it trains from must come from the checkpoint
    return case.net(seed=1, max_epochs=2, callbacks=[cp, LoadInitState(cp)])


def input_shape_setter(case):
    return case.net(module__input_dim=1, callbacks=[InputShapeSetter()])


def own_train_step(case):
    return case.net(cls=OwnStepNet)


def extended_train_step(case):
    return case.net(cls=ClampingNet)


def two_optimizers(case):
    return case.net(cls=TwoOptimizerNet, module__logits=True, optimizer2__lr=0.1)


# name -> function(case) that builds the net to fit. The cases that change
# trainable parameters come last: should one fail and leave the ranks out of
# step, the cases before it are already recorded.
CASES = {
    "plain": lambda case: case.net(),
    "clipping": clipping,
    "param_mapper": param_mapper,
    "step_lr_per_batch": schedule(lr_scheduler.StepLR, step_size=2, gamma=0.9, step_every="batch"),
    "step_lr_per_epoch": schedule(lr_scheduler.StepLR, step_size=1, gamma=0.5),
    "multi_step_lr": schedule(lr_scheduler.MultiStepLR, milestones=[1, 3], gamma=0.5),
    "cosine_annealing_lr": schedule(lr_scheduler.CosineAnnealingLR, T_max=MAX_EPOCHS),
    "one_cycle_lr": schedule(
        lr_scheduler.OneCycleLR, max_lr=0.5, total_steps=200, step_every="batch"
    ),
    "cyclic_lr": lambda case: case.net(
        optimizer__momentum=0.9,
        callbacks=[
            LRScheduler(
                lr_scheduler.CyclicLR, base_lr=0.01, max_lr=0.3, step_size_up=3, step_every="batch"
            )
        ],
    ),
    # no epoch after the first improves by 1: the LR halves after every epoch
    "reduce_lr_on_plateau": schedule(
        lr_scheduler.ReduceLROnPlateau,
        monitor="valid_loss",
        patience=0,
        factor=0.5,
        threshold=1.0,
        threshold_mode="abs",
    ),
    "warm_restart_lr": schedule(
        WarmRestartLR, min_lr=0.01, max_lr=0.3, base_period=2, period_mult=1
    ),
    "early_stopping": early_stopping,
    "checkpoint": checkpoint,
    "load_init_state": load_init_state,
    "input_shape_setter": input_shape_setter,
    "own_train_step": own_train_step,
    "extended_train_step": extended_train_step,
    "two_optimizers": two_optimizers,
    "freezer": freezer,
    "freezer_then_unfreezer": freezer_then_unfreezer,
    "unfreezer": unfreezer,
}

# 2 processes with batch b differ from 1 process with 2 b by design in these
EQUIVALENT = [case for case in CASES if case not in PER_BATCH_SCHEDULES]

DATA = make_data(N_SAMPLES)


def outcome(net, with_params):
    """What the tests compare: parameters and losses, after fit."""
    named = list(net.get_all_learnable_params())
    out = {
        "digest": [
            [name, hashlib.sha256(p.detach().cpu().numpy().tobytes()).hexdigest()]
            for name, p in named
        ],
        "train_loss": list(net.history[:, "train_loss"]),
        "epochs": len(net.history),
    }
    if with_params:
        out["params"] = {name: p.detach().cpu().flatten().tolist() for name, p in named}
    return out


def fit_configuration(dirname, config):
    """Fit every case of ``config`` (``PRECISION:BATCH_SIZE:N_SAMPLES:CASES``)
    with every accumulation; what the configuration reports."""
    global DATA  # pylint: disable=global-statement
    precision, batch_size, n_samples, which = config.split(":")
    batch_size, n_samples = int(batch_size), int(n_samples)
    DATA = make_data(n_samples)
    accelerator = accelerator_for(precision)
    dirname = Path(dirname) / config.replace(":", "-")
    checks = Checks()
    for name in CASES if which == "all" else EQUIVALENT:
        for accumulation in ACCUMULATION:

            def run(build=CASES[name], accumulation=accumulation, name=name):
                accelerator.gradient_accumulation_steps = accumulation
                case = Case(accelerator, precision, batch_size, dirname, name, accumulation)
                net = build(case)
                net.fit(*DATA)
                return outcome(net, with_params=precision != "bf16")

            try:
                checks.run(run, name=f"accum{accumulation}/{name}")
            finally:
                accelerator.scaler = None
                gc.collect()  # nets of earlier cases die in reference cycles
    return {
        "num_processes": accelerator.num_processes,
        "precision": precision,
        "mixed_precision": accelerator.mixed_precision,
        "batch_size": batch_size,
        "n_samples": n_samples,
        "cases": checks.results,
    }


def main(dirname, *configs):
    freeze_what_is_loaded()
    results = {config: fit_configuration(dirname, config) for config in configs}
    report({"rank": PartialState().process_index, "configs": results})


if __name__ == "__main__":
    main(*sys.argv[1:])
