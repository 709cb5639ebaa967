# ruff: noqa
import json, os, signal, socket, struct, sys, time, re
from datetime import timedelta
import torch, torch.distributed as dist


def own_tcp():
    inodes = set()
    for f in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[9] in inodes:
                out.append((parts[1], parts[3]))  # local hex addr:port, state
    return out


dist.init_process_group("gloo", timeout=timedelta(seconds=15))
rank, n = dist.get_rank(), dist.get_world_size()
side = dist.new_group(backend="gloo", timeout=timedelta(seconds=15))
t = torch.zeros(1)
dist.all_reduce(t, group=side)
mine = own_tcp()
table = [None] * n
dist.all_gather_object(table, mine, group=side)
ports = {}
for r, socks in enumerate(table):
    for addr, state in socks:
        ports.setdefault(int(addr.split(":")[1], 16), set()).add(r)
start = time.monotonic()
if rank == 1:
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    dist.all_reduce(t, group=side if sys.argv[1] == "side" else None)
except Exception as exc:
    port = int(re.search(r"\]:(\d+)", str(exc)).group(1))
    swapped = struct.unpack("<H", struct.pack(">H", port))[0]
    print(
        "RESULT",
        rank,
        round(time.monotonic() - start, 2),
        port,
        ports.get(port),
        swapped,
        ports.get(swapped),
        len(mine),
        flush=True,
    )
os._exit(0)
