"""Writes that stall and writes that crawl, on the main process.

Usage: torchrun --nproc_per_node 2 stalled_io.py

The process group's timeout is 10 s. A save_params whose write never
progresses (the main process opens a FIFO that nobody reads, as a hung
mount would block) must fail on every rank after the I/O timeout (by
default the process group's); a save that keeps writing for longer than its
I/O timeout must finish.
"""

import os
import time
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from common import MLP, AcceleratedNet, Checks, make_data, report

accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=10))])
rank = accelerator.process_index
X, y = make_data(200)
checks = Checks()
original_save = torch.save


def make_net(**kwargs):
    torch.manual_seed(0)
    return AcceleratedNet(MLP, accelerator=accelerator, max_epochs=1, verbose=0, **kwargs).fit(X, y)


def timed(fn):
    start = time.monotonic()
    try:
        fn()
        error = None
    except Exception as exc:  # pylint: disable=broad-except
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start}


@checks
def a_stuck_write_fails_on_every_rank():
    net = make_net()
    if rank == 0:
        os.mkfifo("nobody-reads")

        def stuck(obj, f, *args, **kwargs):
            with open("nobody-reads", "wb"):  # blocks: no reader ever comes
                pass

        torch.save = stuck
    try:
        return timed(lambda: net.save_params(f_params="params.pt"))
    finally:
        torch.save = original_save


@checks
def a_slow_write_that_progresses_finishes():
    net = make_net(io_timeout=1)

    def crawling(obj, f, *args, **kwargs):
        original_save(obj, f, *args, **kwargs)
        with open(f, "ab") as file:  # then three seconds more of writing
            for _ in range(15):
                file.write(b"\0")
                file.flush()
                time.sleep(0.2)

    torch.save = crawling
    try:
        outcome = timed(lambda: net.save_params(f_params="slow.pt"))
    finally:
        torch.save = original_save
    outcome["written"] = os.path.exists("slow.pt")
    return outcome


report(checks.results)
