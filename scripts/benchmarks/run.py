"""Run every benchmark, each in its own launch, then write the report.

python scripts/benchmarks/run.py [--quick] [--only timing|memory|sharded|control] [--out results]
    [--readme README.md] [--allocator default|tuned|both]
"""

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from jobs import kill_job  # noqa: E402  pylint: disable=wrong-import-position

QUICK = {
    "fit": ["--samples", "600", "--epochs", "1", "--repeats", "2"],
    "lightning": ["--samples", "600", "--epochs", "1", "--repeats", "2"],
    "lightning_resume": ["--samples", "600", "--epochs", "2", "--repeats", "2"],
    "checkpoint": ["--width", "256", "--depth", "2", "--repeats", "2"],
    "checkpoint_small": ["--width", "64", "--depth", "1", "--repeats", "2"],
    "stall": ["--width", "256", "--depth", "2", "--repeats", "2", "--train-seconds", "0.2"],
    "replicas": ["--width", "256", "--depth", "2", "--repeats", "2"],
    "streams": ["--samples", "640", "--positions", "0", "10", "--repeats", "2"],
    "midepoch": [
        "--width",
        "256",
        "--depth",
        "2",
        "--repeats",
        "2",
        "--samples",
        "640",
        "--every",
        "3",
        "--skips",
        "0",
        "30",
    ],
}


# epoch_memory.py: validation sizes, process counts (plain skorch runs on
# one), rounds, and the batch records whose merge is timed
MEMORY = {"sizes": [100_000, 400_000], "processes": [2, 3, 4], "rounds": 3}
MEMORY_QUICK = {"sizes": [2000], "processes": [2], "rounds": 1}

# sharded.py: process counts, the model's size, the timing's rounds
SHARDED = {"processes": [2, 4], "size": [], "time": ["--repeats", "5", "--steps", "16"]}
# control.py: process counts and its arguments
CONTROL = {"processes": [2, 4, 8], "args": []}
CONTROL_QUICK = {
    "processes": [2],
    "args": ["--repeats", "2", "--wait-repeats", "1", "--write-mb", "8"],
}

SHARDED_QUICK = {
    "processes": [2],
    "size": ["--width", "256", "--depth", "2"],
    "time": ["--repeats", "2"],
}


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# glibc's allocator for the FSDP2 memory runs (sharded.py): its defaults,
# or its mmap threshold fixed at 64 KiB, so that a freed tensor is returned
# to the system instead of staying in the heap
ALLOCATORS = {"default": {}, "tuned": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def launch(script, out, processes, extra, timeout, env_extra=None, malloc=None):
    """Run ``script`` on ``processes``; ``malloc``, when given, replaces the
    environment's ``MALLOC_*`` variables."""
    cmd = [sys.executable, str(HERE / script), "--out", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # a process that aborts (SIGABRT) prints every thread's Python stack
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.update(env_extra or {})
    if malloc is not None:
        env = {k: v for k, v in env.items() if not k.startswith("MALLOC_")} | malloc
    if processes > 1:
        cmd[1:1] = [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={processes}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
        ]
        env["ACCELERATE_USE_CPU"] = "true"
    else:
        env.pop("OMP_NUM_THREADS")
    print(f"== {script} on {processes} process(es)", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        raise
    if returncode:
        raise subprocess.CalledProcessError(returncode, cmd)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check that it runs")
    parser.add_argument("--readme", default=None, help="README whose benchmark section to update")
    parser.add_argument(
        "--only",
        choices=("timing", "memory", "sharded", "control"),
        help="run one part; the report also reads the results already in --out",
    )
    parser.add_argument(
        "--allocator",
        choices=(*ALLOCATORS, "both"),
        default="both",
        help="glibc's allocator for the FSDP2 memory runs: its defaults, "
        "MALLOC_MMAP_THRESHOLD_=65536 (tuned), or each in turn",
    )
    args = parser.parse_args()

    raw = Path(args.out) / "raw"
    timeout = 300 if args.quick else 3600
    if args.only in (None, "timing"):
        timing(raw, Path(args.out), timeout, QUICK if args.quick else {})
    if args.only in (None, "memory"):
        epoch_memory(raw, timeout, MEMORY_QUICK if args.quick else MEMORY)
    if args.only in (None, "sharded"):
        allocators = list(ALLOCATORS) if args.allocator == "both" else [args.allocator]
        sharded(raw, timeout, SHARDED_QUICK if args.quick else SHARDED, allocators)
    if args.only in (None, "control"):
        control = CONTROL_QUICK if args.quick else CONTROL
        for n in control["processes"]:
            launch("control.py", raw / f"control_{n}.json", n, control["args"], timeout)
    report = [sys.executable, str(HERE / "report.py"), "--raw", str(raw), "--out", args.out]
    if args.readme:
        report += ["--readme", args.readme]
    subprocess.run(report, check=True)


def timing(raw, out, timeout, extra):
    launch("fit.py", raw / "fit_1.json", 1, extra.get("fit", []), timeout)
    launch("fit.py", raw / "fit_2.json", 2, extra.get("fit", []), timeout)
    launch("vs_lightning.py", raw / "lightning_2.json", 2, extra.get("lightning", []), timeout)
    # states of the 2-process launch, resumed on 1 process by the second
    states = ["--states", str(out / "lightning_states")]
    resume = extra.get("lightning_resume", [])
    launch("lightning_resume.py", raw / "lightning_resume_2.json", 2, resume + states, timeout)
    one = [*resume, *states, "--other-count"]
    launch("lightning_resume.py", raw / "lightning_resume_1.json", 1, one, timeout)
    launch("checkpoint.py", raw / "checkpoint_2.json", 2, extra.get("checkpoint", []), timeout)
    # a small model too (0.85M parameters, 3.4 MB), where fixed costs such as
    # barriers show most
    launch(
        "checkpoint.py",
        raw / "checkpoint_small_2.json",
        2,
        extra.get("checkpoint_small", ["--width", "448", "--depth", "4"]),
        timeout,
    )
    launch("stall.py", raw / "stall_2.json", 2, extra.get("stall", []), timeout)
    stall_fsdp = [*extra.get("stall", []), "--kind", "fsdp"]
    launch("stall.py", raw / "stall_fsdp_2.json", 2, stall_fsdp, timeout)
    launch("replicas.py", raw / "replicas_2.json", 2, extra.get("replicas", []), timeout)
    launch("midepoch.py", raw / "midepoch_2.json", 2, extra.get("midepoch", []), timeout)
    launch("streams.py", raw / "streams_2.json", 2, extra.get("streams", []), timeout)


def sharded(raw, timeout, settings, allocators):
    """FSDP2 against DDP, each kind, process count and allocator in a launch
    of its own, the net's and a hand-written loop's; the timing under glibc's
    defaults."""
    for n in settings["processes"]:
        for allocator in allocators:
            for kind in ("ddp", "fsdp"):
                for loop in ("", "_loop"):
                    out = raw / f"sharded_memory_{kind}{loop}_{n}_{allocator}.json"
                    args = ["--variant", "memory", "--kind", kind, *settings["size"]]
                    args += ["--loop"] if loop else []
                    malloc = ALLOCATORS[allocator]
                    launch("sharded.py", out, n, args, timeout, malloc=malloc)
        args = ["--variant", "time", *settings["size"], *settings["time"]]
        launch("sharded.py", raw / f"sharded_time_{n}.json", n, args, timeout, malloc={})


def epoch_memory(raw, timeout, memory):
    for round_ in range(memory["rounds"]):
        for valid in memory["sizes"]:
            for n in [1, *memory["processes"]]:
                out = raw / f"epoch_memory_{valid}_{n}_{round_}.json"
                launch("epoch_memory.py", out, n, ["--valid", str(valid)], timeout)
            for n in memory["processes"]:
                out = raw / f"epoch_memory_everywhere_{valid}_{n}_{round_}.json"
                launch("epoch_memory.py", out, n, ["--valid", str(valid), "--everywhere"], timeout)
    for records in memory["sizes"]:
        for n in memory["processes"]:
            out = raw / f"batch_merge_{records}_{n}.json"
            launch("epoch_memory.py", out, n, ["--records", str(records)], timeout)


if __name__ == "__main__":
    main()
