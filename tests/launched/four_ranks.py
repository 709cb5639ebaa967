"""Four processes, one of which stalls past the timeout or ends, before a
``save_params`` every rank calls, or the main process ends while it writes:
each other rank names it, the stalled one after the census, an ended one at
once.

Usage: torchrun --nproc_per_node 4 ... four_ranks.py MODE, MODE one of
  absent  rank 2 sleeps past the timeout (3 s) before save_params
  ended   rank 2 ends its process (os._exit(0)) before save_params: with a
          status of 0, as a launcher would otherwise stop the others first
  writer-ended  rank 0 ends its process (os._exit(0)) a second into writing
          the file, the others waiting for its outcome

Each rank reports what save_params raised and how long it waited, then ends
with os._exit: the process group cannot be torn down with a peer gone.
"""

import os
import sys
import time
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from common import MLP, AcceleratedNet, error_and_seconds, make_data, write_report

mode = sys.argv[1]
# a short timeout: the census waits for it a second time
accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=3))])
X, y = make_data(200)
torch.manual_seed(0)
net = AcceleratedNet(MLP, accelerator=accelerator, max_epochs=1, verbose=0).fit(X, y)
if mode == "writer-ended" and accelerator.process_index == 0:

    def end_while_writing(*args):
        time.sleep(1)  # the others met it, and wait for its outcome
        os._exit(0)

    accelerator.unwrap_model(net.module_).register_state_dict_pre_hook(end_while_writing)
if mode != "writer-ended" and accelerator.process_index == 2:
    if mode == "ended":
        os._exit(0)
    time.sleep(10)
write_report(error_and_seconds(lambda: net.save_params(f_params=f"params-{mode}.pt")))
os._exit(0)
