"""Run a script under several real processes, the way users launch them.

``run_processes`` runs a script as ``torchrun`` starts it, with
``ACCELERATE_USE_CPU=true`` (DDP over gloo on this machine), on a free port.
Its workers are forked from interpreters that imported torch, accelerate and
skorch already (``prefork``: what torchrun gives a worker, seconds sooner);
torchrun itself starts them where the test is about torchrun (restarts,
rendezvous arguments, several agents with ``run_nodes``) or sets variables
read at start-up. Every rank writes its results as JSON through
``launched/common.py``'s ``report``, and its stdout and stderr go to files of
their own (torchrun's ``--log-dir``): tests that look at what a rank printed
read those, never the interleaved stream, whose order differs from run to
run. A run that exceeds its timeout is killed as a whole, and the test fails
with every rank's output.
"""

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import prefork
import pytest
from jobs import kill_job  # scripts/jobs.py

ROOT = Path(__file__).resolve().parent.parent
LAUNCHED = Path(__file__).resolve().parent / "launched"

__all__ = [
    "LAUNCHED",
    "Launch",
    "can_isolate",
    "check_values",
    "free_port",
    "port_block",
    "run_nodes",
    "run_plain",
    "run_processes",
]


_FIRST_PORT = 10000
_next_port = []


def port_block(environ=os.environ):
    """``(first, stop)``: the ports this pytest process hands out, those
    below the kernel's ephemeral range (where connections and ``bind(0)``
    never look), split among pytest-xdist's workers; None where that range
    leaves too few."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    count = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = (low - _FIRST_PORT) // count
    if size < 100:
        return None
    return _FIRST_PORT + index * size, _FIRST_PORT + (index + 1) * size


def free_port():
    """A TCP port free now, for a launch's rendezvous store to listen on.

    A port of ``bind(0)`` is free only for a moment: with two workers, an
    outgoing connection (gloo's, the other worker's) took one before torchrun
    listened on it (EADDRINUSE, 7 tests of one launch failed). Ports below
    the ephemeral range are taken only by an explicit bind, and each worker
    hands out its own block in turn, so none is handed out twice while its
    launch may still run.
    """
    block = port_block()
    if block is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    first, stop = block
    if not _next_port:
        _next_port.append(random.randrange(first, stop))
    for _ in range(stop - first):
        port = _next_port[0]
        _next_port[0] = first + (port + 1 - first) % (stop - first)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))  # as torchrun's store listens: every interface
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {first}..{stop - 1}")


@dataclass
class Launch:
    """The outcome of a launch: exit status, combined output, per-rank JSON,
    and per-rank ``(stdout, stderr)``."""

    returncode: int
    output: str
    timed_out: bool
    ranks: list = field(default_factory=list)
    rank_outputs: list = field(default_factory=list)

    @property
    def hung(self):
        """``{rank: (check, deadline)}`` for every rank whose check outlived
        its deadline (``launched/common.py``'s ``Checks``)."""
        return {
            rank: (report["hung"], report["deadline"])
            for rank, report in enumerate(self.ranks)
            if isinstance(report, dict) and "hung" in report
        }

    def describe(self):
        state = "timed out" if self.timed_out else f"exit status {self.returncode}"
        hung = "".join(
            f"check {name!r} hung on rank {rank}: no end within {deadline} s\n"
            for rank, (name, deadline) in self.hung.items()
        )
        return f"{hung}launch {state}; output of every rank:\n{self.output}"

    def check(self):
        """Fail the test unless every rank finished and reported."""
        if (
            self.timed_out
            or self.returncode != 0
            or self.hung
            or any(r is None for r in self.ranks)
        ):
            pytest.fail(self.describe(), pytrace=False)
        return self.ranks


class CheckedRanks:
    """Every rank's checks of ``launch``, read where a test iterates them.

    A launch that crashed (a rank aborted in a collective) then fails each
    test that reads it, with the launch's output, instead of erroring in the
    module fixture: ``scripts/breaks.py`` counts only failing tests as a
    break caught.
    """

    def __init__(self, launch):
        self.launch = launch

    def __iter__(self):
        return iter([rank["checks"] for rank in self.launch.check()])


def run_processes(
    script, *args, nproc=2, timeout=180, cpu_env=True, env=None, launcher_args=(), forked=True
):
    """Run ``script`` under ``nproc`` processes, as torchrun starts them.

    Without ``launcher_args``, the workers are forked from interpreters that
    imported torch, accelerate and skorch already (``prefork``), which
    is what torchrun would give them, seconds sooner; torchrun itself
    otherwise, or with ``forked=False``.

    Parameters
    ----------
    script : str or Path
      A script in ``tests/launched`` or a path.

    *args : str
      Command-line arguments of the script.

    nproc : int (default=2)
      Number of processes.

    timeout : float (default=180)
      Seconds before the whole process group is killed.

    cpu_env : bool (default=True)
      Whether to set ``ACCELERATE_USE_CPU=true``, which makes accelerate see
      the processes as one MULTI_CPU group.

    env : dict or None
      Additional environment variables.

    launcher_args : sequence of str
      More arguments for torchrun, e.g. ``['--max-restarts=1']``; with a
      ``--rdzv-*`` argument, no ``--master_addr`` and ``--master_port``.

    forked : bool (default=True)
      Whether the workers may be forked (``prefork.usable`` has the last word).

    Returns
    -------
    launch : Launch

    """
    port = free_port()
    if forked and not launcher_args and prefork.usable(env):
        return _launch_forked(script, args, nproc, timeout, cpu_env, env, port)
    common = [f"--nproc_per_node={nproc}", *launcher_args]
    if not any(arg.startswith("--rdzv") for arg in launcher_args):
        common += ["--master_addr=127.0.0.1", f"--master_port={port}"]
    return _launch([common], script, args, nproc, timeout, cpu_env, env)


def run_plain(script, *args, timeout=180, env=None, forked=True):
    """Run ``script`` as ``python script.py``: one process, no launcher, no
    process group, as a user's single-process run (forked from an
    interpreter that imported torch, accelerate and skorch, as
    ``run_processes``)."""
    if forked and prefork.usable(env):
        return _launch_forked(script, args, 1, timeout, False, env, None)
    return _launch([None], script, args, 1, timeout, False, env)


ISOLATED = ["unshare", "--pid", "--fork", "--mount-proc"]


def can_isolate():
    """Whether ``unshare`` may give a command a PID namespace of its own here."""
    try:
        return subprocess.run([*ISOLATED, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_nodes(script, *args, nodes=2, timeout=180, env=None, isolated=()):
    """Run ``script`` as if on ``nodes`` machines of one process each.

    Each node is its own ``torchrun --nnodes N --node_rank k``, started in its
    own working directory (``node0``, ``node1``, ...), as machines without a
    shared filesystem would be. The nodes in ``isolated`` run in a PID
    namespace of their own (``unshare``), with this hostname: a container
    with the host's network, as Docker's ``--network host`` starts one.
    """
    port = free_port()
    per_node = [
        [
            f"--nnodes={nodes}",
            f"--node_rank={k}",
            "--nproc_per_node=1",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
        ]
        for k in range(nodes)
    ]
    return _launch(per_node, script, args, nodes, timeout, True, env, isolated)


def _launch(launchers, script, args, world_size, timeout, cpu_env, env, isolated=()):
    script = _script(script)
    with tempfile.TemporaryDirectory(prefix="accel_mixin_launch_") as tmp:
        tmp = Path(tmp)
        run_env = _environment(tmp, cpu_env, env)
        procs, logs = [], []
        started = time.monotonic()
        for k, launcher in enumerate(launchers):
            cwd = tmp if len(launchers) == 1 else tmp / f"node{k}"
            cwd.mkdir(exist_ok=True)
            logs.append(tmp / f"output{k}.log")
            cmd = [sys.executable, str(script), *map(str, args)]
            if launcher is not None:
                cmd[1:1] = [
                    "-m",
                    "torch.distributed.run",
                    *launcher,
                    "--tee=3",
                    f"--log-dir={tmp / f'logs{k}'}",
                ]
            if k in isolated:
                cmd[:0] = ISOLATED
            with open(logs[-1], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=run_env,
                        cwd=cwd,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        timed_out = False
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out:
            for proc in procs:
                kill_job(proc)
        output = "\n".join(
            (f"--- node {k} ---\n" if len(logs) > 1 else "") + log.read_text(errors="replace")
            for k, log in enumerate(logs)
        )
        plain = launchers == [None]
        _log_launch(script, args, world_size, 0 if plain else len(launchers), started)
        ranks = _reports(tmp, world_size)
        if launchers == [None]:  # no torchrun: one process, one stream
            rank_outputs = [(output, "")]
        else:
            rank_outputs = _rank_outputs(tmp, len(launchers), world_size // len(launchers))
    returncode = next((p.returncode for p in procs if p.returncode), 0)
    return Launch(returncode, output, timed_out, ranks, rank_outputs)


def _script(script):
    script = Path(script)
    return script if script.is_absolute() else LAUNCHED / script


def _base_environment():
    """The environment every launch starts from: this one, one intra-op
    thread, unbuffered output, and the package and the launched scripts'
    helpers on the path."""
    run_env = dict(os.environ)
    # set per launch; and pytest's, per test, which would start the zygotes again
    for name in ("ACCELERATE_USE_CPU", "ACCEL_RESULTS_DIR", "PYTEST_CURRENT_TEST"):
        run_env.pop(name, None)
    run_env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), str(LAUNCHED), run_env.get("PYTHONPATH", "")]
            ),
        }
    )
    return run_env


def _environment(results, cpu_env, env):
    run_env = dict(_base_environment(), ACCEL_RESULTS_DIR=str(results))
    if "PYTEST_CURRENT_TEST" in os.environ:
        run_env["PYTEST_CURRENT_TEST"] = os.environ["PYTEST_CURRENT_TEST"]
    if cpu_env:
        run_env["ACCELERATE_USE_CPU"] = "true"
    run_env.update(env or {})
    return run_env


def _reports(tmp, world_size):
    """Every rank's JSON report, None where a rank wrote none."""
    paths = [tmp / f"rank{rank}.json" for rank in range(world_size)]
    return [json.loads(path.read_text()) if path.exists() else None for path in paths]


def _launch_forked(script, args, world_size, timeout, cpu_env, env, port):
    """``_launch`` with workers forked by ``prefork``: the same ``Launch``,
    with each rank's output where torchrun's ``--tee=3`` would put it."""
    script = _script(script)
    with tempfile.TemporaryDirectory(prefix="accel_mixin_launch_") as tmp:
        tmp = Path(tmp)
        started = time.monotonic()
        returncode, timed_out, summary = prefork.launch(
            [str(script), *map(str, args)],
            world_size,
            _base_environment(),
            _environment(tmp, cpu_env, env),
            cwd=tmp,
            log_dir=tmp / "logs0",
            timeout=timeout,
            port=port,
        )
        _log_launch(script, args, world_size, 0 if port is None else 1, started, forked=True)
        ranks = _reports(tmp, world_size)
        rank_outputs = _rank_outputs(tmp, 1, world_size)
    if port is None:  # one process, one stream (its stderr went to stdout.log)
        output = rank_outputs[0][0]
        return Launch(returncode, output, timed_out, ranks, [(output, "")])
    # torchrun's --tee=3: every line of every rank, prefixed with its rank
    output = "".join(
        f"[default{rank}]:{line}\n"
        for rank, streams in enumerate(rank_outputs)
        for stream in streams
        for line in stream.splitlines()
    )
    return Launch(returncode, output + summary, timed_out, ranks, rank_outputs)


def _log_launch(script, args, processes, agents, started, forked=False):
    """Append the launch to ``$ACCEL_MIXIN_LAUNCH_LOG``, if set, one JSON line
    each, for ``scripts/suite_profile.py`` to count launches per test file
    (``agents`` 0: a plain ``python`` process, no torchrun)."""
    path = os.environ.get("ACCEL_MIXIN_LAUNCH_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    record = {
        "test": test,
        "script": script.name,
        "args": [str(a) for a in args],
        "processes": processes,
        "agents": agents,
        "forked": forked,
        "seconds": round(time.monotonic() - started, 3),
        "workers": int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _rank_outputs(tmp, nodes, per_node):
    """Every rank's (stdout, stderr), from the files torchrun wrote per worker."""

    def read(node, local_rank, stream):
        found = sorted((tmp / f"logs{node}").glob(f"*/attempt_*/{local_rank}/{stream}.log"))
        return found[-1].read_text(errors="replace") if found else ""

    return [
        (read(node, local, "stdout"), read(node, local, "stderr"))
        for node in range(nodes)
        for local in range(per_node)
    ]


def check_errors(ranks, check):
    """The error a ``Checks`` check raised on every rank, None where it did not."""
    return [checks[check].get("error") for checks in ranks]


def check_values(ranks, check):
    """The value a ``Checks`` check returned on every rank; fails the test if
    it raised on any rank."""
    out = []
    for rank, checks in enumerate(ranks):
        assert check in checks, f"{check} did not run on rank {rank}"
        result = checks[check]
        assert result["ok"], f"{check} failed on rank {rank}: {result['error']}"
        out.append(result["value"])
    return out
