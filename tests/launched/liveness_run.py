"""Healthy jobs finish, dead peers are named: what a rank that lives but does
not answer, or that ends inside a phase, does to the others.

Usage: torchrun ... liveness_run.py MODE, MODE one of
  busy                 (3 processes, any layout) at the end of epoch 1, rank 1 holds the
                       GIL for 20 s in a callback (a C call through
                       ctypes.PyDLL) while rank 2 is paused (SIGSTOP) for
                       20 s: the job finishes (process group timeout 60 s)
  kill-in-exchange     rank 1 ends (SIGKILL) inside the epoch-end exchange of
                       predictions, after its first message
  kill-async-in-flight rank 1 ends as epoch 2 begins, while rank 0's part
                       (its commit) of an asynchronous TrainingCheckpoint
                       save is in flight

Each mode fits, then calls save_params and predict. Every rank that lives
to the end reports ``error`` (None when the calls succeeded) and
``seconds``; ranks 1 and 2 of ``busy`` also how long they held the GIL or
were paused. With ``LIVENESS_END_AGENT=1``, a rank that failed ends its
torchrun agent once it reported.
"""

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from common import MLP, AcceleratedNet, make_data, report, write_report
from skorch.callbacks import Callback

from accel_mixin.callbacks import TrainingCheckpoint
from accel_mixin.checkpoint import dcp_folder
from accel_mixin.distributed import epoch_scores

mode = sys.argv[1]
rank = int(os.environ["RANK"])
X, y = make_data(400)


class OnRank(Callback):
    """Runs ``action(epoch)`` on the ranks ``ranks`` at ``when``."""

    def __init__(self, when, action, ranks=(1,)):
        self.when, self.action, self.ranks = when, action, ranks

    def _maybe(self, net):
        if rank in self.ranks:
            self.action(len(net.history))

    def on_epoch_end(self, net, **kwargs):
        if self.when == "epoch_end":
            self._maybe(net)

    def on_epoch_begin(self, net, **kwargs):
        self.first = True

    def on_batch_begin(self, net, batch=None, training=None, **kwargs):
        if self.when == "batch_begin" and training and self.first:
            self.first = False
            self._maybe(net)


held = {}


def busy(epoch):
    start = time.monotonic()
    if epoch == 1 and rank == 1:
        # libc's sleep through PyDLL keeps the GIL: no thread of this process runs
        ctypes.PyDLL(None).sleep(20)
        held["gil"] = time.monotonic() - start
    elif epoch == 1 and rank == 2:
        subprocess.Popen(["sh", "-c", f"sleep 20; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        held["paused"] = time.monotonic() - start


def kill_self(epoch):
    if epoch == 2:
        os.kill(os.getpid(), signal.SIGKILL)


callbacks = []
timeout = 30
if mode == "busy":
    callbacks, timeout = [OnRank("epoch_end", busy, ranks=(1, 2))], 60
elif mode == "kill-in-exchange" and rank == 1:
    send = epoch_scores.dist.send

    def first_then_end(*args, **kwargs):
        send(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    epoch_scores.dist.send = first_then_end
elif mode == "kill-async-in-flight":
    callbacks = [
        TrainingCheckpoint(tempfile.mkdtemp(prefix="liveness_"), asynchronous=True),
        OnRank("batch_begin", kill_self),
    ]
    commit = dcp_folder.commit_folder

    def slow_commit(*args):
        time.sleep(3)  # rank 0's part of the save, still in flight when rank 1 ends
        commit(*args)

    dcp_folder.commit_folder = slow_commit

accelerator = Accelerator(
    kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout))]
)
net = AcceleratedNet(
    MLP, accelerator=accelerator, max_epochs=3, verbose=0, callbacks=callbacks, batch_size=32
)
start = time.monotonic()
try:
    net.fit(X, y)
    net.save_params(f_params=os.path.join(os.environ["ACCEL_RESULTS_DIR"], f"p{rank}.pt"))
    net.predict(X)
    error = None
except Exception as exc:  # pylint: disable=broad-except
    error = f"{type(exc).__name__}: {exc}"
result = {"error": error, "seconds": time.monotonic() - start, **held}
if error is None:
    report(result)
else:
    # the process group cannot be torn down with a peer gone: report, then
    # end as a script whose error nobody caught would (a job that failed);
    # renamed into place, as a launcher may stop this rank meanwhile
    write_report(result)
    sys.stdout.flush()
    if os.environ.get("LIVENESS_END_AGENT") == "1":
        # the test's agent looks at its workers seldom: end it now, as it would
        os.kill(os.getppid(), signal.SIGTERM)
    os._exit(1)
