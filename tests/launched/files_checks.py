"""Checkpoint files under several processes: prefixes, clean keys, and bad
input that raises a clear error on every rank instead of hanging.

Usage: torchrun --nproc_per_node 2 files_checks.py
"""

import os
import subprocess
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import gather_object
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    error_and_seconds,
    make_accelerator,
    make_data,
    report,
)

accelerator = make_accelerator()
rank = accelerator.process_index
X, y = make_data(200)
checks = Checks()
net = AcceleratedNet(
    MLP, accelerator=accelerator, max_epochs=2, verbose=0, unwrap_after_train=False
)
net.fit(X, y)
net.save_params(f_params="good.pt", f_optimizer="good_opt.pt")
if rank == 0:
    good = Path("good.pt").read_bytes()
    Path("cut.pt").write_bytes(good[: len(good) // 2])
    Path("adir").mkdir()
    torch.save(
        OrderedDict(("module." + k, v) for k, v in torch.load("good.pt").items()), "ddp_prefixed.pt"
    )
accelerator.wait_for_everyone()


@checks
def bad_input_raises_on_every_rank():
    wide = AcceleratedNet(MLP, module__hidden=64, accelerator=accelerator).initialize()
    return {
        "missing": error_and_seconds(lambda: net.load_params(f_params="nope.pt")),
        "truncated": error_and_seconds(lambda: net.load_params(f_params="cut.pt")),
        "directory": error_and_seconds(lambda: net.load_params(f_params="adir")),
        "architecture": error_and_seconds(lambda: wide.load_params(f_params="good.pt")),
        "save_to_directory": error_and_seconds(lambda: net.save_params(f_params="adir")),
    }


@checks
def files_of_separate_saves_load_on_every_rank():
    """As in skorch, load_params loads the files it is given, whichever saves
    wrote them, and save_params writes no file it was not given."""
    if rank == 0:
        Path("separate").mkdir()
    accelerator.wait_for_everyone()
    net.save_params(f_params="separate/params_e1.pt", f_optimizer="separate/opt_e1.pt")
    net.save_params(f_params="separate/params_e2.pt")
    net.save_params(f_optimizer="separate/opt_e3.pt")
    net.save_params(f_params="separate/params_e1.pt")  # alone, after the joint save
    fresh = AcceleratedNet(MLP, accelerator=accelerator).initialize()
    return {
        "separate": error_and_seconds(
            lambda: fresh.load_params(
                f_params="separate/params_e2.pt", f_optimizer="separate/opt_e3.pt"
            )
        )["error"],
        "saved_again": error_and_seconds(
            lambda: fresh.load_params(
                f_params="separate/params_e1.pt", f_optimizer="separate/opt_e1.pt"
            )
        )["error"],
        "files": sorted(os.listdir("separate")),
    }


@checks
def unwritable_target_keeps_the_previous_file():
    before = Path("good.pt").read_bytes()
    locked = rank != 0 or subprocess.run(["chattr", "+i", "."], check=False).returncode == 0
    locked = all(gather_object([locked]))
    try:
        result = error_and_seconds(lambda: net.save_params(f_params="good.pt")) if locked else None
    finally:
        if rank == 0:
            subprocess.run(["chattr", "-i", "."], check=False)
    accelerator.wait_for_everyone()
    return {
        "locked": locked,
        "save": result,
        "intact": Path("good.pt").read_bytes() == before,
        "strays": [p for p in os.listdir(".") if "accel_mixin-tmp" in p],
    }


@checks
def prefixed_file_loads_under_ddp():
    fresh = AcceleratedNet(MLP, accelerator=accelerator, unwrap_after_train=False).initialize()
    fresh.load_params(f_params="ddp_prefixed.pt")
    return {
        "module_type": type(fresh.module_).__name__,
        "same_predictions": bool(np.array_equal(fresh.predict_proba(X), net.predict_proba(X))),
    }


@checks
def compiled_net_saves_clean_keys():
    compiled = AcceleratedNet(
        MLP,
        accelerator=accelerator,
        max_epochs=1,
        verbose=0,
        compile=True,
        compile__backend="eager",
    )
    compiled.fit(X, y)
    compiled.save_params(f_params="compiled.pt")
    return {"keys": list(torch.load("compiled.pt", weights_only=True))}


@checks
def one_machine_saves_one_state_together():
    """save_on_each_node on one machine: its ranks share the folder and write
    their parts of one state, as without it."""
    config = accelerator.project_configuration
    config.save_on_each_node = True
    try:
        net.save_state("together")
    finally:
        config.save_on_each_node = False
    return sorted(p.name for p in Path("together").iterdir() if p.suffix == ".distcp")


@checks
def named_files_are_written_while_the_others_arrive():
    """A file given by name is replaced atomically, so the main process writes
    it before the others arrive; a file object only once all have."""
    if rank == 1:
        time.sleep(1)  # the main process waits here
        named_before = Path("early.pt").exists()
    net.save_params(f_params="early.pt")
    with open(f"object-{rank}.pt", "wb") as f:
        if rank == 1:
            time.sleep(1)
            object_before = Path("object-0.pt").stat().st_size
        net.save_params(f_params=f)
    return {"named_before": named_before, "object_before": object_before} if rank == 1 else {}


report({"rank": rank, "checks": checks.results})
