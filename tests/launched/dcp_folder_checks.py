"""The DCP folder of a training state on real processes.

``python dcp_folder_checks.py save SHARED``: on 2 processes (gloo), a
replicated module, plain values and every rank's own generators under its
rank's key, saved synchronously and with ``dcp.async_save``, load back on
every rank (each its own generators); one ``.metadata``, one data file per
rank, no partial folder left. ``python dcp_folder_checks.py load SHARED``:
on one process, the same folder loads, with both ranks' keys.
"""

import os
import sys
from pathlib import Path

import torch
from common import Checks, report

from accel_mixin.checkpoint.dcp_folder import (
    load_folder,
    plain,
    save_folder,
    saved_keys,
    unplain,
)

PHASE, SHARED = sys.argv[1], Path(sys.argv[2])
checks = Checks(deadline=120)


def module():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def state(rank):
    torch.manual_seed(100 + rank)  # generators that differ per rank
    return {
        "module": module().state_dict(),
        "history": plain([{"epoch": 1}]),
        f"rng.rank-{rank}": plain(torch.get_rng_state()),
    }


if PHASE == "save":
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()

    def round_trip(name, asynchronous):
        saved = state(rank)
        future = save_folder(saved, SHARED / name, asynchronous=asynchronous)
        if future is not None:
            future.result()
        torch.distributed.barrier()  # rank 0's commit
        target = {"module": torch.nn.Linear(4, 3).state_dict(), "history": None}
        target[f"rng.rank-{rank}"] = None
        load_folder(target, SHARED / name, partial=True)
        return {
            "module": all(torch.equal(target["module"][k], v) for k, v in saved["module"].items()),
            "rng": torch.equal(
                unplain(target[f"rng.rank-{rank}"]), unplain(saved[f"rng.rank-{rank}"])
            ),
            "history": unplain(target["history"]),
            "files": sorted(os.listdir(SHARED / name)),
            "beside": sorted(os.listdir(SHARED)),
        }

    @checks
    def synchronous():
        return round_trip("sync", asynchronous=False)

    @checks
    def asynchronous():
        return round_trip("async", asynchronous=True)

    report({"checks": checks.results})

if PHASE == "load":

    @checks
    def on_one_process():
        keys = saved_keys(SHARED / "async")
        target = {"module": torch.nn.Linear(4, 3).state_dict(), "rng.rank-1": None}
        load_folder(target, SHARED / "async", partial=True)
        torch.manual_seed(101)
        return {
            "keys": {top: sorted(fqns) for top, fqns in keys.items() if top != "module"},
            "module": all(
                torch.equal(target["module"][k], v) for k, v in module().state_dict().items()
            ),
            "rank_1": torch.equal(unplain(target["rng.rank-1"]), unplain(state(1)["rng.rank-1"])),
        }

    report({"checks": checks.results})
