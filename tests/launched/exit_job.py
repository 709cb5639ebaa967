"""A whole job as the README writes one: fit, predict, save, end_training,
and nothing else. It must exit with status 0, every time.

With ``busy``, each rank's presence thread calls the store without pause,
many times in a row for each beat, so that it is inside a store call (the
GIL released by pybind11) whenever Python starts to shut down: the moment
that used to abort a process at exit. Without the run of calls, the thread
spends part of each loop in Python and in socket calls, and under load an
exit missed the moment in about half the launches.

Usage: torchrun --nproc_per_node 2 exit_job.py DIRNAME [busy]
"""

import sys
import threading
from pathlib import Path

from common import MLP, AcceleratedNet, make_accelerator, make_data

from accel_mixin.distributed import liveness

if sys.argv[2:] == ["busy"]:
    presence_init = liveness.Presence.__init__
    announce = liveness.Presence.announce

    def busy_presence(self, coordinator):
        presence_init(self, coordinator)
        self.beat = 0  # the thread's own pause; the coordinator's beat is unchanged

    def announce_in_a_row(self, coordinator):
        # the main thread's announcements (as sections begin and end) stay single
        for _ in range(50 if threading.current_thread() is self else 1):
            announce(self, coordinator)

    liveness.Presence.__init__ = busy_presence
    liveness.Presence.announce = announce_in_a_row

accelerator = make_accelerator()
X, y = make_data(400)
net = AcceleratedNet(MLP, accelerator=accelerator, max_epochs=2, verbose=0)
net.fit(X, y)
net.predict(X)
net.save_params(f_params=Path(sys.argv[1]) / "params.pt")
accelerator.end_training()
print(f"rank {accelerator.process_index} done", flush=True)
