"""Two attempts of one job on one store (torchrun --max-restarts 1).

Usage: torchrun --max-restarts 1 --nproc_per_node 2 restart_attempts.py

Attempt 0 passes a barrier on both ranks, then rank 1 fails in a section
(its failure goes into the store) and the job restarts. In attempt 1, rank 1
arrives at the first barrier late: rank 0 must wait for it there, and no
failure of attempt 0 may surface. Rank 1 reports when it arrived and rank 0
when it left (the same machine's clock), so that the order, not a length of
time, tells whether rank 0 waited.
"""

import os
import time
from datetime import timedelta

from common import MLP, AcceleratedNet, make_accelerator, report
from torch.distributed import TCPStore


def forget_gloo_addresses(attempt):
    """torch's defect, not ours: on a store kept across attempts, gloo's
    connect reads the address a rank of the dead attempt wrote, if it comes
    before the new one, and fails or hangs. Each rank deletes its old
    address, and gloo connects once every rank has. accel_mixin's own keys
    are left as the dead attempt wrote them: they are what the test is about.
    Returns whether the old address was there, so a torch that names it
    otherwise shows."""
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=30),
    )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    found = store.delete_key(f"default_pg/0//cpu//0/{rank}")  # as torch 2.13 names it
    key = f"restart_attempts/{attempt}/forgotten"
    store.add(key, 1)
    deadline = time.monotonic() + 30
    while store.add(key, 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
forgot = forget_gloo_addresses(attempt) if attempt and shared else None
accelerator = make_accelerator()
rank = accelerator.process_index
net = AcceleratedNet(MLP, accelerator=accelerator)
coordinator = net._coordinator  # pylint: disable=protected-access

if attempt == 0:
    net.wait_for_everyone()
    if rank == 1:
        with coordinator.session("fit"):
            raise RuntimeError("attempt 0 ends here")
    time.sleep(60)  # torchrun ends this attempt once rank 1 failed

if rank == 1:
    time.sleep(1.5)
arrived = time.time()
error = None
try:
    net.wait_for_everyone()
except Exception as exc:  # pylint: disable=broad-except
    error = f"{type(exc).__name__}: {exc}"
report(
    {"attempt": attempt, "forgot": forgot, "arrived": arrived, "left": time.time(), "error": error}
)
