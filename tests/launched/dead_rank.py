"""A rank that dies or leaves: the others raise within seconds, naming it.

Usage: torchrun ... dead_rank.py MODE, MODE one of
  kill-before-save       rank 1 is SIGKILLed before save_params
  kill-before-predict    rank 1 is SIGKILLed before predict
  raise-before-save      rank 1 ends with an uncaught exception before save_params

The accelerator keeps the process group's default timeout (30 minutes): the
surviving rank must not depend on it. It reports what it raised and how long
it waited.
"""

import json
import os
import signal
import sys
import time

import torch
from accelerate import Accelerator
from common import MLP, AcceleratedNet, make_data

mode = sys.argv[1]
accelerator = Accelerator()
rank = accelerator.process_index
X, y = make_data(200)
torch.manual_seed(0)
net = AcceleratedNet(MLP, accelerator=accelerator, max_epochs=1, verbose=0)
net.fit(X, y)

if rank == 1:
    if mode.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("rank 1 ends here, uncaught")

start = time.monotonic()
try:
    if mode.endswith("predict"):
        net.predict(X)
    else:
        net.save_params(f_params="params.pt")
    error = None
except Exception as exc:  # pylint: disable=broad-except
    error = f"{type(exc).__name__}: {exc}"
seconds = time.monotonic() - start
out = os.environ.get("ACCEL_RESULTS_DIR", ".")
# the process group cannot be torn down with a peer gone: report, then end
# as a script whose error nobody caught would (a job that failed)
with open(os.path.join(out, "rank0.json"), "w") as f:
    json.dump({"error": error, "seconds": seconds}, f)
os._exit(1)
