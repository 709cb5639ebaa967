"""A whole job as the README writes one: fit, predict, save, end_training,
and nothing else. It must exit with status 0, every time.

With ``busy``, each rank's presence thread sets its key without pause, so
that it is inside a store call whenever Python starts to shut down: the
moment that used to abort a process at exit.

Usage: torchrun --nproc_per_node 2 exit_job.py DIRNAME [busy]
"""

import sys
from pathlib import Path

from common import MLP, AcceleratedNet, make_accelerator, make_data

from accel_mixin.distributed import liveness

if sys.argv[2:] == ["busy"]:
    presence_init = liveness.Presence.__init__

    def busy_presence(self, coordinator):
        presence_init(self, coordinator)
        self.beat = 0  # the thread's own pause; the coordinator's beat is unchanged

    liveness.Presence.__init__ = busy_presence

accelerator = make_accelerator()
X, y = make_data(400)
net = AcceleratedNet(MLP, accelerator=accelerator, max_epochs=2, verbose=0)
net.fit(X, y)
net.predict(X)
net.save_params(f_params=Path(sys.argv[1]) / "params.pt")
accelerator.end_training()
print(f"rank {accelerator.process_index} done", flush=True)
