"""What a worker sees of its launch, for tests/test_prefork.py to compare a
forked launch with torchrun's.

    view              every rank reports its environment and process; rank 0
                      ends first, then rank 1 uses the store (the launcher's)
    signal-launcher   rank 0 sends SIGTERM to its parent, the launcher
    fail              rank 1 ends with status 3; rank 0 waits to be stopped
"""

import json
import os
import random
import signal
import stat
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from common import write_report

TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
    "ACCELERATE_USE_CPU",
)

mode = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
seen = {
    "argv": sys.argv[1:],
    "script": os.path.basename(__file__),
    "main": __name__,
    "path0": os.path.basename(sys.path[0]),
    "cwd_is_results": os.getcwd() == os.environ["ACCEL_RESULTS_DIR"],
    "stdin": "null" if stat.S_ISCHR(os.fstat(0).st_mode) else "other",
    "own_session": os.getsid(0) == os.getpid(),
    "variables": {name: os.environ.get(name) for name in TORCHRUN_VARIABLES},
    "port_set": "MASTER_PORT" in os.environ,
    "hash": hash("accel_mixin"),
    "draws": [random.random(), float(np.random.rand()), float(torch.rand(1))],
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
}
print(f"rank {rank} out", flush=True)
print(f"rank {rank} err", file=sys.stderr, flush=True)


def on_sigterm(signum, frame):
    write_report(dict(seen, ended_by="SIGTERM"))
    os._exit(0)  # pylint: disable=protected-access


if mode != "view":  # on every rank before the barrier, so before any signal
    signal.signal(signal.SIGTERM, on_sigterm)
if "RANK" in os.environ:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dist.barrier()

if mode == "view":
    if rank == 1:
        # rank 0 has ended: the store is the launcher's, and still there
        time.sleep(1)
        store = dist.distributed_c10d._get_default_store()  # pylint: disable=protected-access
        store.set("after-rank-0", "yes")
        seen["store_after_rank_0"] = store.get("after-rank-0").decode()
    write_report(seen)
elif mode == "signal-launcher":
    if rank == 0:
        os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(60)
    write_report(dict(seen, ended_by="sleep"))
elif mode == "fail":
    if rank == 1:
        write_report(dict(seen, ended_by="exit 3"))
        sys.exit(3)
    time.sleep(60)
    write_report(dict(seen, ended_by="sleep"))
json.dumps(seen)  # every value a report can hold
