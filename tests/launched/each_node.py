"""Two machines without a shared filesystem, simulated: every node runs in
its own working directory. With accelerate's save_on_each_node, the main
process of every node writes a copy and every node loads its own; without
it, only node 0 has the file, and loading fails on every node, clearly.
ResumeTraining resumes every node from the newest epoch all of them have.

Usage: torchrun --nnodes 2 --node_rank 0|1 --nproc_per_node 1 each_node.py
"""

import os
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import ProjectConfiguration
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    DropoutMLP,
    make_accelerator,
    make_data,
    make_fsdp_accelerator,
    report,
)

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint
from accel_mixin.checkpoint.dcp_folder import saved_keys
from accel_mixin.checkpoint.positions import position_of

accelerator = make_accelerator(project_config=ProjectConfiguration(save_on_each_node=True))
rank = accelerator.process_index
X, y = make_data(200)
checks = Checks()
net = AcceleratedNet(MLP, accelerator=accelerator, max_epochs=2, verbose=0)
net.fit(X, y)


@checks
def layout():
    return {
        "cwd": os.path.basename(os.getcwd()),
        "rank": rank,
        "local_main": accelerator.is_local_main_process,
        "num_processes": accelerator.num_processes,
    }


@checks
def save_on_each_node():
    Path("ckpt").mkdir(exist_ok=True)
    net.save_params(f_params="ckpt/params.pt", f_history="ckpt/history.json")
    files = sorted(p.name for p in Path("ckpt").iterdir())
    fresh = AcceleratedNet(MLP, accelerator=accelerator).initialize()
    fresh.load_params(f_params="ckpt/params.pt", f_history="ckpt/history.json")
    return {
        "files": files,
        "same_predictions": bool(np.array_equal(fresh.predict_proba(X), net.predict_proba(X))),
        "history_epochs": len(fresh.history),
    }


def resume(max_epochs):
    net = AcceleratedNet(
        MLP,
        accelerator=accelerator,
        max_epochs=max_epochs,
        verbose=0,
        callbacks=[TrainingCheckpoint("states", keep_last=None), ResumeTraining("states")],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.fit(X, y)
    return net, [str(w.message) for w in caught if "every rank has" in str(w.message)]


@checks
def resume_from_the_epoch_every_node_has():
    resume(3)  # every node keeps its own epochs 1 to 3
    if rank == 1:  # node 1 was killed while writing epoch 3
        # (a loop: where node 1 has none, the check fails alike on every node)
        for state in Path("states").glob("run-*/training-state-000003"):
            shutil.rmtree(state)
    net, caught = resume(4)
    return {
        "resumed_from": os.path.basename(dict(net.callbacks_)["ResumeTraining"].resumed_from_),
        "epochs": len(net.history),
        "train_loss": net.history[:, "train_loss"],
        "warnings": caught,
    }


@checks
def no_epoch_in_common_fails_on_every_node():
    if rank == 1:  # a new machine: nothing to resume from
        for path in Path("states").glob("run-*/*"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    resume(5)


@checks
def copies_resume_inside_an_epoch_exactly():
    """Asynchronous saves inside epochs: each node's copy holds every rank's
    generators and part of the epoch, and a fit resumed from it goes on as
    the uninterrupted one did."""

    def fit(max_epochs):
        torch.manual_seed(10 + rank)  # each rank's dropout draws its own numbers
        net = AcceleratedNet(
            DropoutMLP,
            accelerator=accelerator,
            max_epochs=max_epochs,
            batch_size=16,
            train_split=None,
            iterator_train__shuffle=True,
            verbose=0,
            callbacks=[
                TrainingCheckpoint("inside", every_n_batches=2, keep_last=None, asynchronous=True),
                ResumeTraining("inside"),
            ],
        )
        return net.fit(X, y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full = fit(3)
        full.wait_for_saves()
    # a crash during batch 5 of epoch 2: the states after batch 4 are lost
    for path in Path("inside").glob("run-*/training-state-*"):
        if position_of(str(path)) > (1, 4):
            shutil.rmtree(path)
    resumed = fit(3)  # first: a node without the state fails alike on every node
    (state,) = Path("inside").glob("run-*/training-state-000001-batch-000004-ranks-2")
    saved = saved_keys(state)
    return {
        "keys": sorted(fqn for fqns in saved.values() for fqn in fqns if ".rank-" in fqn),
        "files": sorted(p.name for p in state.iterdir() if p.suffix == ".distcp"),
        "resumed_from": os.path.basename(dict(resumed.callbacks_)["ResumeTraining"].resumed_from_),
        "same_losses": resumed.history[:, "train_loss"] == full.history[:, "train_loss"],
        # DCP's writer thread, told of no group, warns on every machine's main process
        "warnings": [str(w.message) for w in caught],
    }


@checks
def a_failed_copy_raises_on_every_node():
    Path("present").mkdir(exist_ok=True)
    errors, written = {}, []

    def slowly_written():  # an asynchronous save ends once it returned
        time.sleep(3)  # longer than the rest of the check takes, even under load
        written.append(True)

    for asynchronous in (False, True):
        try:  # node 1's writer cannot write: no folder to save in
            net.save_state(
                f"{'present' if rank == 0 else 'missing'}/state",
                asynchronous,
                on_written=slowly_written if asynchronous else None,
            )
            net.wait_for_saves()
        except Exception as exc:  # pylint: disable=broad-except
            errors[asynchronous] = f"{type(exc).__name__}: {exc}"
    net.wait_for_saves()  # waits for node 0's asynchronous copy all the same
    return {
        "errors": errors,
        "written": written,
        "saved": sorted(p.name for p in Path("present").iterdir()),
    }


@checks
def main_process_only():
    accelerator.project_configuration.save_on_each_node = False
    Path("only_main").mkdir(exist_ok=True)
    net.save_params(f_params="only_main/params.pt")
    files = sorted(p.name for p in Path("only_main").iterdir())
    try:
        net.load_params(f_params="only_main/params.pt")
        error = None
    except Exception as exc:  # pylint: disable=broad-except
        error = f"{type(exc).__name__}: {exc}"
    return {"files": files, "load_error": error}


@checks
def sharded_copies_are_refused():  # last: the accelerator state becomes FSDP's
    sharded = make_fsdp_accelerator(project_config=ProjectConfiguration(save_on_each_node=True))
    net = AcceleratedNet(
        MLP, accelerator=sharded, max_epochs=1, verbose=0, callbacks=[TrainingCheckpoint("fsdp")]
    )
    net.fit(X, y)


report({"rank": rank, "checks": checks.results})
