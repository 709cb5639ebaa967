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

from common import MLP, AcceleratedNet, make_accelerator, report

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if attempt and os.environ["RANK"] == "0":
    # torch's defect, not ours: on a store kept across attempts, gloo's
    # connect can read the dead attempt's address of rank 1 before rank 1
    # wrote its new one, and fail; rank 0 connects once rank 1 wrote it
    time.sleep(2)
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
report({"attempt": attempt, "arrived": arrived, "left": time.time(), "error": error})
