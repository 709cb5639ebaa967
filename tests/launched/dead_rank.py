"""A rank that dies or leaves: the others raise within seconds, naming it.

Usage: torchrun ... dead_rank.py MODE, MODE one of
  kill    rank 1 is SIGKILLed after fit
  raise   rank 1 ends with an uncaught exception after fit

Rank 0 then calls save_params, predict and load_params in turn, each a check of its own
(``save_params``, ``inference``, ``load_params``): every call looks for the gone rank anew,
so one end serves both. The accelerator keeps the process group's default
timeout (30 minutes): the surviving rank must not depend on it. It reports
what each call raised and how long it waited.
"""

import os
import signal
import sys

import torch
from accelerate import Accelerator
from common import MLP, AcceleratedNet, Checks, error_and_seconds, make_data, write_report

mode = sys.argv[1]
accelerator = Accelerator()
rank = accelerator.process_index
X, y = make_data(200)
torch.manual_seed(0)
net = AcceleratedNet(MLP, accelerator=accelerator, max_epochs=1, verbose=0)
net.fit(X, y)

if rank == 1:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("rank 1 ends here, uncaught")

# a hang detector: against the 30 minutes the others would wait without us
checks = Checks(deadline=60)
checks.run(lambda: error_and_seconds(lambda: net.save_params(f_params="params.pt")), "save_params")
checks.run(lambda: error_and_seconds(lambda: net.predict(X)), "inference")
# no save in flight: the error names the load, not a wait for saves
checks.run(lambda: error_and_seconds(lambda: net.load_params(f_params="params.pt")), "load_params")
# the process group cannot be torn down with a peer gone: report, then end
# as a script whose error nobody caught would (a job that failed). The
# report is renamed into place: torchrun's agent may stop this rank at any
# moment once rank 1 ended, and a half-written report read as empty
write_report(checks.results)
os._exit(1)
