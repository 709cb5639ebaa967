# ruff: noqa
import os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=12))
rank, n = dist.get_rank(), dist.get_world_size()
side = dist.new_group(backend="gloo", timeout=timedelta(seconds=12))
dist.all_reduce(torch.zeros(1), group=side)
dist.barrier()
op = sys.argv[1]
start = time.monotonic()
if rank == 1:
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    if op == "barrier":
        dist.barrier(group=side)
    elif op == "allreduce":
        dist.all_reduce(torch.zeros(3, dtype=torch.int64), group=side)
    elif op == "alltoall":
        dist.all_to_all_single(torch.zeros(n), torch.zeros(n), group=side)
    elif op == "monitored":
        dist.monitored_barrier(group=side, timeout=timedelta(seconds=12), wait_all_ranks=True)
    err = None
except Exception as e:
    err = str(e).replace("\n", " ")[:260]
print("RESULT", op, rank, round(time.monotonic() - start, 2), err, flush=True)
time.sleep(3)  # survivors stay up, so that no survivor's exit is taken for the cause
os._exit(0)
