# ruff: noqa
import os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank, n = dist.get_rank(), dist.get_world_size()
g = dist.ProcessGroupGloo(
    dist.PrefixStore("ctl", dist.distributed_c10d._get_default_store()),
    rank,
    n,
    timedelta(seconds=30),
)


def arrive(wait):
    peers = [r for r in range(n) if r != rank]
    inbox = {r: torch.zeros(1, dtype=torch.uint8) for r in peers}
    sends = [g.send([torch.ones(1, dtype=torch.uint8)], r, 7) for r in peers]
    recvs = {r: g.recv([inbox[r]], r, 7) for r in peers}
    deadline = time.monotonic() + wait
    missing, gone = [], []
    for r, work in recvs.items():
        try:
            if not work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic()))):
                missing.append(r)
        except RuntimeError as e:
            (gone if "closed by peer" in str(e) or "reset by peer" in str(e) else missing).append(r)
    return missing, gone


arrive(10)
start = time.monotonic()
if rank == 1:
    if sys.argv[1] == "kill":
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        time.sleep(8)
print("RESULT", sys.argv[1], rank, arrive(4), round(time.monotonic() - start, 2), flush=True)
time.sleep(3)
os._exit(0)
