# ruff: noqa
"""Prototype for issue 47 point 1: what survivors see from gloo."""

import ctypes, json, os, signal, subprocess, sys, time
from datetime import timedelta
import torch, torch.distributed as dist

mode = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 10
dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
rank, n = dist.get_rank(), dist.get_world_size()
side = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
t = torch.zeros(1)
dist.all_reduce(t, group=side)  # connect the side group
dist.barrier()


def fds():
    c = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            c += os.readlink(f"/proc/self/fd/{f}").startswith("socket:")
        except OSError:
            pass
    return c


out = {"rank": rank, "sockets": fds()}
start = time.monotonic()
try:
    if rank == 1 and mode == "kill":
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1 and mode == "stop":
        subprocess.Popen(["sh", "-c", f"sleep 20; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 1 and mode == "gil":
        ctypes.PyDLL(None).sleep(30)
    if rank == 1 and mode == "missing":
        time.sleep(timeout + 8)
    if mode == "missing":
        dist.monitored_barrier(group=side, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    elif mode == "idle":
        time.sleep(2)
        dist.all_reduce(t, group=side)
    else:
        dist.all_reduce(t, group=side)
    out["error"] = None
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"[:600]
out["seconds"] = round(time.monotonic() - start, 2)
out["cpu"] = round(time.process_time(), 2)
print("RESULT", json.dumps(out), flush=True)
os._exit(0)
