"""A whole job as the README writes one: fit, predict, save, end_training,
and nothing else. It must exit with status 0, every time.

Usage: torchrun --nproc_per_node 2 exit_job.py DIRNAME
"""

import sys
from pathlib import Path

from common import MLP, AcceleratedNet, make_accelerator, make_data

accelerator = make_accelerator()
X, y = make_data(400)
net = AcceleratedNet(MLP, accelerator=accelerator, max_epochs=2, verbose=0)
net.fit(X, y)
net.predict(X)
net.save_params(f_params=Path(sys.argv[1]) / "params.pt")
accelerator.end_training()
print(f"rank {accelerator.process_index} done", flush=True)
