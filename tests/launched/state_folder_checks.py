"""Training states as one DCP folder (``_save_state_folder``) on real processes.

``python state_folder_checks.py ddp|fsdp SHARED``: a fitted net saves its
state synchronously and asynchronously (training on while the save is in
flight); each is one folder whose module weights, read whole, equal the full
weights ``save_params`` writes at the save, with every rank's generators
under its own key and one data file per rank. A commit that fails on rank 0
raises on every rank and leaves the previous state.
"""

import os
import sys
from pathlib import Path

import torch
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    make_accelerator,
    make_data,
    make_fsdp_accelerator,
    outcome,
    report,
)
from skorch.callbacks import EarlyStopping

from accel_mixin.checkpoint.dcp_folder import read_full, saved_keys, unplain

LAYOUT, SHARED = sys.argv[1], Path(sys.argv[2])
X, y = make_data(n=200)
checks = Checks(deadline=180)

accelerator = make_fsdp_accelerator() if LAYOUT == "fsdp" else make_accelerator()
torch.manual_seed(0)
net = AcceleratedNet(
    MLP,
    accelerator=accelerator,
    max_epochs=2,
    lr=0.1,
    batch_size=32,
    verbose=0,
    optimizer=torch.optim.Adam,
    callbacks=[("stop", EarlyStopping(patience=5, threshold=10.0, load_best=True))],
)
net.fit(X, y)
RANK = accelerator.process_index


def saved(name, asynchronous):
    path = SHARED / f"{LAYOUT}-{name}"
    reference = SHARED / f"{LAYOUT}-{name}.params.pt"
    net.save_params(f_params=reference)  # the full weights at the save
    net.save_state(path, asynchronous=asynchronous)
    if asynchronous:
        net.partial_fit(X, y)  # trains on while the save is in flight
    net.wait_for_saves()
    net.wait_for_everyone()
    full = torch.load(reference, weights_only=True)
    read = read_full(path, keys={"modules", "history", "optimizers"})
    module = read["modules"]["module"]
    return {
        "files": sorted(os.listdir(path)),
        "beside": sorted(e for e in os.listdir(SHARED) if e.startswith(f".{LAYOUT}-")),
        "rng": saved_keys(path)["rng"],
        "weights": sorted(module) == sorted(full)
        and all(torch.equal(module[k], v) for k, v in full.items()),
        "epochs": len(unplain(read["history"])),
        "moments": sorted(read["optimizers"]["optimizer"]["state"]),
    }


@checks
def synchronous():
    return saved("sync", asynchronous=False)


@checks
def asynchronous():
    return saved("async", asynchronous=True)


def _refused(*args):
    raise OSError(28, "No space left on device")


@checks
def commit_fails_on_rank_0():
    path = SHARED / f"{LAYOUT}-sync"
    rename = os.rename
    if RANK == 0:
        os.rename = _refused  # test only: the commit's rename fails on rank 0
    try:
        error = outcome(lambda: net.save_state(path))
    finally:
        os.rename = rename
    net.wait_for_everyone()  # rank 0 removes the partial folder: a rank may raise first
    return {
        "error": error,
        "epochs": len(unplain(read_full(path, keys={"history"})["history"])),
        "beside": sorted(e for e in os.listdir(SHARED) if e.startswith(f".{LAYOUT}-")),
    }


report({"checks": checks.results})
