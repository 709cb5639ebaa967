"""A fit on the ranks that accelerate's ``notebook_launcher`` forks from a
kernel: this process, started without the job's variables, as Jupyter
starts a kernel. The ranks are no workers of a rank: a net they unpickle
builds its accelerator.

Usage: python notebook_ranks.py PORT
"""

import json
import os
import pickle
import sys
from pathlib import Path

from accelerate import notebook_launcher
from common import MLP, AcceleratedNet, make_accelerator, make_data, outcome, write_report

KERNEL = os.getpid()
RESULTS = Path(os.environ.get("ACCEL_RESULTS_DIR", "."))


def train():
    accelerator = make_accelerator()
    X, y = make_data(120)
    net = AcceleratedNet(MLP, accelerator=accelerator, max_epochs=1, verbose=0)
    net.fit(X, y)
    rank = accelerator.process_index
    result = {
        "rank": rank,
        "world": accelerator.num_processes,
        "forked_by_the_kernel": os.getppid() == KERNEL,
        "unpickled": outcome(lambda: pickle.loads(pickle.dumps(net))),
    }
    (RESULTS / f"notebook_rank{rank}.json").write_text(json.dumps(result))
    accelerator.end_training()


notebook_launcher(train, num_processes=2, use_port=sys.argv[1])
write_report(
    {"ranks": [json.loads((RESULTS / f"notebook_rank{r}.json").read_text()) for r in range(2)]}
)
