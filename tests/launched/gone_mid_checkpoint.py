"""A rank that is gone when a synchronous checkpoint inside an epoch starts:
the surviving rank's error names the call it was in, ``save_state``.

Usage: torchrun ... gone_mid_checkpoint.py (two agents, one process each, as
on two machines: each agent keeps its own worker alive)

Rank 1 is SIGKILLed as ``TrainingCheckpoint`` saves after training batch 2;
rank 0 reports what it raised, then ends as a failed job does.
"""

import os
import signal

from accelerate import Accelerator
from common import MLP, AcceleratedNet, make_data, write_report

from accel_mixin.callbacks import TrainingCheckpoint

accelerator = Accelerator()
rank = accelerator.process_index
X, y = make_data(300)


class GoneAtTheSave(TrainingCheckpoint):
    def _save(self, net, epoch, batch, asynchronous, stopped=False):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._save(net, epoch, batch, asynchronous, stopped=stopped)


net = AcceleratedNet(
    MLP,
    accelerator=accelerator,
    max_epochs=1,
    batch_size=32,
    verbose=0,
    callbacks=[GoneAtTheSave("states", every_n_batches=2, asynchronous=False)],
)
try:
    net.fit(X, y)
    error = None
except Exception as exc:  # pylint: disable=broad-except
    error = f"{type(exc).__name__}: {exc}"
# the process group cannot be torn down with a peer gone: report (renamed
# into place, as a launcher may stop this rank meanwhile), then end
write_report({"error": error})
os._exit(1)
