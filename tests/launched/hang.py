"""Rank 1 never reaches the barrier: the harness must kill the group on
timeout and show what every rank printed."""

import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} started as pid {os.getpid()}", flush=True)
if rank == 1:
    time.sleep(3600)
dist.barrier()
