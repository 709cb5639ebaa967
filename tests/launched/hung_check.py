"""Checks with deadlines: ``stuck`` never ends on rank 1 while rank 0 waits
for it in a barrier; the launch must end at the check's deadline, naming it,
with the checks before it reported and none after it run."""

import time

import torch.distributed as dist
from common import Checks, make_accelerator

accelerator = make_accelerator(cpu=True)
checks = Checks()


@checks
def first():
    return accelerator.process_index


@checks.within(3)
def stuck():
    if accelerator.process_index == 1:
        time.sleep(3600)
    dist.barrier()


@checks
def after():
    return "ran"
