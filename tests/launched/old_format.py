"""Training states in the format of the releases before issue 47 (a torch
file; under FSDP2 a file plus the folder of shards it names).

``python old_format.py make FOLDER one|ddp|fsdp``, run once with the old code
(on 1, 2 and 2 processes), wrote ``tests/data/old_format/<layout>/``: a run
folder of an interrupted run (``TrainingCheckpoint``, stopped inside epoch 2;
kept: the state after epoch 1 and one inside epoch 2) and the full files of
the uninterrupted run (``reference-*``).

``python old_format.py check COPY one|ddp|fsdp`` (a copy of such a folder):
on this launch's
processes, ``ResumeTraining`` over that run folder, and ``load_state`` of
the file saved after epoch 1, each followed by a fit, end with the weights,
optimizer state and history of the uninterrupted run: bit for bit where this
machine's uninterrupted run reproduces the fixture's, within float32
round-off where its CPU's kernels differ.
"""

import json
import os
import sys
from pathlib import Path

import torch
from common import Checks, fresh_state, make_accelerator, make_data, make_fsdp_accelerator, report
from skorch.callbacks import Callback, EarlyStopping, LRScheduler

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

PHASE, FOLDER, LAYOUT = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
RANK = int(os.environ.get("RANK", "0"))
X, y = make_data(n=160)
EPOCHS = 3


class TinyMLP(torch.nn.Module):
    """Dropout draws from every rank's generators; a few hundred parameters."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(20, 8),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(8, 2),
            torch.nn.Softmax(dim=-1),
        )

    def forward(self, X):
        return self.layers(X)


class Stop(Exception):
    pass


class StopAt(Callback):
    """Raise after training batch ``batch`` of epoch ``epoch`` (from 0)."""

    in_run_identity = False  # the rerun without it is the same run

    def __init__(self, epoch, batch):
        self.epoch, self.batch = epoch, batch

    def state_dict(self):
        return {}  # a resumed run stops nowhere

    def on_batch_end(self, net, training=False, **kwargs):
        if training and len(net.history) == self.epoch:
            self.seen_ = getattr(self, "seen_", 0) + 1
            if self.seen_ == self.batch:
                raise Stop(f"batch {self.batch} of epoch {self.epoch}")


def net_of(callbacks=()):
    from common import AcceleratedNet

    fresh_state()
    accelerator = make_fsdp_accelerator() if LAYOUT == "fsdp" else make_accelerator()
    torch.manual_seed(0)
    return AcceleratedNet(
        module=TinyMLP,
        optimizer=torch.optim.Adam,
        lr=0.02,
        max_epochs=EPOCHS,
        batch_size=16,
        verbose=0,
        accelerator=accelerator,
        callbacks=[
            ("schedule", LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.7)),
            ("stopping", EarlyStopping(monitor="valid_loss", patience=10, load_best=True)),
            *callbacks,
        ],
    )


def full_files(net, folder, name):
    files = {
        "f_params": str(folder / f"{name}-params.pt"),
        "f_optimizer": str(folder / f"{name}-opt.pt"),
        "f_history": str(folder / f"{name}-history.json"),
    }
    net.save_params(**files)
    return files


def read(files):
    params = torch.load(files["f_params"], weights_only=True)
    optimizer = torch.load(files["f_optimizer"], weights_only=True)
    with open(files["f_history"], encoding="utf-8") as f:
        history = [[row["train_loss"], row["valid_loss"]] for row in json.load(f)]
    return params, optimizer, history


def difference(a, b):
    """The largest difference between two ``read`` results' weights,
    optimizer states and histories; inf where their structure differs."""
    (pa, oa, ha), (pb, ob, hb) = a, b
    if sorted(pa) != sorted(pb) or sorted(oa["state"]) != sorted(ob["state"]) or len(ha) != len(hb):
        return float("inf")
    worst = max(float((pa[k].float() - pb[k].float()).abs().max()) for k in pa)
    for key, state in oa["state"].items():
        for name, value in state.items():
            other = torch.as_tensor(ob["state"][key][name]).float()
            worst = max(worst, float((torch.as_tensor(value).float() - other).abs().max()))
    for row_a, row_b in zip(ha, hb):
        worst = max(worst, *(abs(u - v) for u, v in zip(row_a, row_b)))
    return worst


if PHASE == "make":
    FOLDER.mkdir(parents=True, exist_ok=True)
    full_files(net_of().fit(X, y), FOLDER, "reference")
    saving = TrainingCheckpoint(str(FOLDER / "states"), keep_last=2, every_n_batches=2)
    net = net_of(callbacks=[("checkpoint", saving), ("stop", StopAt(epoch=2, batch=3))])
    try:
        net.fit(X, y)
    except Stop as exc:
        stopped = f"{type(exc).__name__}: {exc}"
    net.wait_for_saves()
    if RANK == 0:  # the run folder's name holds a token: one name in the fixture
        run = Path(dict(net.callbacks_)["checkpoint"].run_folder_)
        report({"stopped": stopped, "run": run.name, "files": sorted(os.listdir(run))})
    else:
        report({"stopped": stopped})

if PHASE == "check":
    checks = Checks(deadline=180)
    expected = read(
        {
            k: str(FOLDER / f"reference-{v}")
            for k, v in {
                "f_params": "params.pt",
                "f_optimizer": "opt.pt",
                "f_history": "history.json",
            }.items()
        }
    )
    # FOLDER is the test's copy of the fixture: a resumed run claims its folder
    work = Path(os.environ.get("ACCEL_RESULTS_DIR", "."))
    states = FOLDER / "states"

    @checks
    def this_machine_reproduces_the_reference():
        """The uninterrupted run here against the fixture's: CPUs whose float
        kernels differ (AVX-512 or not) differ in the last bits."""
        net = net_of().fit(X, y)
        return {"difference": difference(read(full_files(net, work, "here")), expected)}

    @checks
    def resumed_from_the_run_folder():
        net = net_of(callbacks=[("resume", ResumeTraining(str(states)))])
        net.fit(X, y)
        mine = read(full_files(net, work, "resumed"))
        resumed = dict(net.callbacks_)["resume"].resumed_from_
        return {"difference": difference(mine, expected), "from": os.path.basename(resumed)}

    @checks
    def loaded_at_an_epochs_end():
        (run,) = [p for p in states.iterdir() if p.is_dir()]
        net = net_of()
        net.initialize()
        net.load_state(str(run / "training-state-000001.pt"))
        net.fit(X, y)
        return {"difference": difference(read(full_files(net, work, "loaded")), expected)}

    report({"checks": checks.results})
