# ruff: noqa
import json, os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from accel_mixin.distributed.control import Control

dist.init_process_group(
    "gloo", timeout=timedelta(seconds=float(sys.argv[2]) if len(sys.argv) > 2 else 15)
)
rank, n = dist.get_rank(), dist.get_world_size()
c = Control(
    n,
    rank,
    timeout=float(sys.argv[2]) if len(sys.argv) > 2 else 15,
    store=dist.distributed_c10d._get_default_store(),
)
c.barrier("warm up")
start = time.monotonic()
try:
    with c.session("fit"):
        with c.section("step"):
            if rank == 1 and sys.argv[1] in ("control", "data"):
                time.sleep(1)
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 1 and sys.argv[1] == "stop":
                import subprocess

                subprocess.Popen(["sh", "-c", f"sleep 20; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)
            if rank == 1 and sys.argv[1] == "gil":
                import ctypes

                ctypes.PyDLL(None).sleep(30)
            if sys.argv[1] == "data":
                dist.all_reduce(torch.zeros(3))
            c.barrier("step")
    err = None
except Exception as e:
    err = f"{type(e).__name__}: {e}"
print(
    "RESULT",
    rank,
    round(time.monotonic() - start, 2),
    round(time.process_time(), 2),
    err,
    flush=True,
)
os._exit(0)
