"""Launches whose workers do not import torch, accelerate and skorch again:
each is forked from an interpreter that imported them once.

Why: a launched worker spends seconds of CPU importing torch, accelerate,
skorch and ``torch._dynamo`` (which the first optimizer step imports), and
torchrun spends more importing torch itself, before any check runs. An empty
two-process launch (``launched/startup.py``) took 6.2 s with torchrun and
1.8 s forked (2026-12-04, quiet); a launch of ``sync_checks.py``, 16.4 s
and 9.3 s. The suite makes about 70 launches.

Each rank index has an interpreter of its own, a *zygote*, that imports
those modules once, then forks one worker per launch. A worker gets what
torchrun gives it:

- torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``), with the
  rendezvous store hosted by the launcher (``TORCHELASTIC_USE_AGENT_STORE``),
  so the store outlives every worker, as torchrun's agent's does;
- a session of its own, stdin from /dev/null, its stdout and stderr in files
  of its own, where torchrun's ``--log-dir`` puts them;
- when a worker fails, SIGTERM to the others and SIGKILL 30 s later, and
  status 1 for the launch, as torchrun's agent does; a SIGTERM, SIGINT,
  SIGHUP or SIGQUIT sent to a worker's parent (its launcher, as the script
  sees it) reaches every worker, and the launch ends with status 1.

What a fork would share that fresh interpreters do not, put back:

- string hashes: every rank index forks from its own zygote, and every
  zygote draws its own hash seed, so ranks may iterate a set of strings in
  different orders, as fresh interpreters do (a shared seed would hide a
  collective that ranks enter in different orders);
- torch's and numpy's global generators are reseeded from the OS in each
  worker (Python's ``random`` reseeds itself at a fork);
- what the imports wrote to stderr, each worker writes again first.

The harness keeps torchrun where the claim is torchrun's own or where a
launch sets variables read at start-up: see ``usable``.
"""

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)

#: What the zygotes import before any fork.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "numpy", "accelerate", "skorch")

#: What torchrun's agent forwards to its workers when it gets it.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

#: What a launch may set and still fork: variables read when the script
#: runs, not when an interpreter or torch starts (``PYTHON*``, ``TORCH*``,
#: ``OMP_*``, ``TMPDIR``, ...), which need fresh interpreters.
RUN_TIME = ("ACCEL_", "ACCELERATE_", "LIVENESS_")

#: Seconds between a worker's SIGTERM and its SIGKILL (torchrun's default).
STOP_GRACE = 30

__all__ = ["STOP_GRACE", "launch", "rank_environment", "usable"]


def usable(env):
    """Whether a launch whose extra environment is ``env`` may fork its
    workers: not with ``ACCEL_MIXIN_LAUNCHER=torchrun``, not while coverage
    follows processes (it starts with each interpreter), and only with
    variables of ``RUN_TIME``."""
    if os.environ.get("ACCEL_MIXIN_LAUNCHER", "prefork") != "prefork":
        return False
    coverage = sys.modules.get("coverage")
    if coverage is not None and coverage.Coverage.current() is not None:
        return False
    return all(name.startswith(RUN_TIME) for name in env or {})


def rank_environment(rank, world_size, port):
    """What torchrun (one agent, static rendezvous) sets for worker ``rank``."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(world_size),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


# --- the zygote: runs in its own interpreter --------------------------------


def serve():
    """Import ``PRELOAD``, then fork a worker for each request read from stdin
    and report its pid and its exit status on stdout, one JSON line each."""
    import importlib
    import tempfile

    channel = os.fdopen(os.dup(1), "w", buffering=1)
    with tempfile.TemporaryFile() as printed:
        # stdout is the channel: what the imports print must not reach it
        saved = [os.dup(1), os.dup(2)]
        os.dup2(printed.fileno(), 1)
        os.dup2(printed.fileno(), 2)
        try:
            for name in PRELOAD:
                importlib.import_module(name)
        finally:
            os.dup2(saved[1], 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            for fd in saved:
                os.close(fd)
        printed.seek(0)
        imports_output = printed.read()

    current = {"id": None}

    def tell(message):
        channel.write(json.dumps(dict(message, id=current["id"])) + "\n")

    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: tell({"signal": signum}))
    tell({"ready": os.getpid()})
    for line in sys.stdin:
        request = json.loads(line)
        current["id"] = request["id"]
        # a signal between the fork and the worker's own handlers would run
        # this zygote's handler in the worker: held until the worker has its own
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        pid = os.fork()
        if pid == 0:
            channel.close()
            _become_worker(request, imports_output)  # never returns
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        tell({"pid": pid})
        _, status = os.waitpid(pid, 0)
        tell({"exit": os.waitstatus_to_exitcode(status)})
        current["id"] = None


def _become_worker(request, imports_output):
    """Turn this forked zygote into ``python script args`` as torchrun starts
    it, run the script, and end this process as its interpreter would."""
    os.setsid()
    for sig in FORWARDED:
        handler = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if sig in request["ignored"] else handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _redirect(0, os.devnull, os.O_RDONLY)
    _redirect(1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    _redirect(2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(2, imports_output)
    _reseed()
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    sys.path[:] = [p for p in sys.path if p != TESTS]
    main = sys.modules["__main__"]
    main.__dict__.clear()
    main.__dict__.update(
        __name__="__main__", __file__=script, __builtins__=__builtins__, __spec__=None
    )
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec")
    try:
        exec(code, main.__dict__)  # pylint: disable=exec-used
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # pylint: disable=broad-exception-caught
        # printed as the interpreter prints an uncaught error, from the script down
        sys.excepthook(type(exc), exc, exc.__traceback__.tb_next)
        raise SystemExit(1) from None
    raise SystemExit(0)


def _ignored_here(sig):
    return signal.getsignal(sig) == signal.SIG_IGN


def _redirect(fd, path, flags):
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)


def _reseed():
    import numpy as np
    import torch

    torch.seed()
    np.random.seed()  # pylint: disable=no-member


# --- the launcher: runs in the test's process -------------------------------


class _Zygote:
    def __init__(self, env):
        env = dict(env, PYTHONPATH=os.pathsep.join([TESTS, env.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import prefork; prefork.serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self.buffer = b""
        self.ready = False

    def send(self, request):
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def read(self):
        """The messages now readable; None once the zygote is gone."""
        chunk = os.read(self.proc.stdout.fileno(), 65536)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        messages = [json.loads(line) for line in lines]
        self.ready = self.ready or any("ready" in message for message in messages)
        return messages

    def kill(self):
        """SIGKILL the zygote and whatever it forked, which has a session of its own."""
        from jobs import kill_tree  # scripts/jobs.py

        kill_tree(self.proc.pid)
        self.proc.wait()

    def close(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()


_pool = {"env": None, "zygotes": [], "launches": 0}


def _zygotes(env, count):
    """``count`` zygotes started with ``env``; the pool starts again when
    ``env`` differs or one of them is gone."""
    zygotes = _pool["zygotes"]
    if _pool["env"] != env or any(z.proc.poll() is not None for z in zygotes):
        _close_pool()
        _pool["env"] = env
    if not _pool["launches"]:
        import atexit

        atexit.register(_close_pool)
    _pool["launches"] += 1
    while len(zygotes) < count:
        zygotes.append(_Zygote(env))
    return zygotes[:count]


def _close_pool():
    for zygote in _pool["zygotes"]:
        zygote.close()
    _pool["zygotes"].clear()


def launch(argv, world_size, base_env, launch_env, cwd, log_dir, timeout, port=None):
    """Run ``argv`` (a script and its arguments) as ``world_size`` forked
    workers, as ``torchrun --nproc_per_node world_size`` would; with ``port``
    None, as one plain ``python`` process (stdout and stderr in one file).

    ``base_env`` is what the zygotes start with; ``launch_env`` the workers'
    whole environment before torchrun's variables. Each rank's output goes to
    ``log_dir/prefork/attempt_0/<rank>/{stdout,stderr}.log``.

    Returns ``(returncode, timed_out, summary)``: the launch's status
    (torchrun's: 1 when a worker failed or the launch was signalled; with
    ``port`` None, the process's own), whether it was killed at ``timeout``,
    and torchrun's failure summary, '' if none failed.
    """
    store = None
    if port is not None:
        import torch.distributed as dist

        # torchrun's agent hosts the store its workers rendezvous on
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    zygotes = _zygotes(base_env, world_size)
    _await_ready(zygotes)
    # an interpreter started with a signal ignored keeps it ignored (a job in
    # the background of a shell ignores SIGINT): so does a plain run's; under
    # torchrun, whose agent handles them all, none is
    ignored = [] if port is not None else [s for s in FORWARDED if _ignored_here(s)]
    for rank, zygote in enumerate(zygotes):
        logs = Path(log_dir) / "prefork" / "attempt_0" / str(rank)
        logs.mkdir(parents=True)
        env = dict(launch_env)
        stdout, stderr = logs / "stdout.log", logs / "stderr.log"
        if port is None:
            stderr = stdout
        else:
            env.update(rank_environment(rank, world_size, port))
            env["TORCHELASTIC_ERROR_FILE"] = str(logs / "error.json")
            env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        zygote.send(
            {
                "id": _pool["launches"],
                "ignored": ignored,
                "argv": argv,
                "env": env,
                "cwd": str(cwd),
                "stdout": str(stdout),
                "stderr": str(stderr),
            }
        )
    try:
        return _watch(zygotes, timeout, plain=port is None, script=Path(argv[0]).name)
    finally:
        del store


def _await_ready(zygotes, timeout=600):
    """Wait for the zygotes' imports: a launch's timeout, as torchrun's
    workers', starts when the workers do."""
    selector = selectors.DefaultSelector()
    for zygote in zygotes:
        if not zygote.ready:
            selector.register(zygote.proc.stdout, selectors.EVENT_READ, zygote)
    deadline = time.monotonic() + timeout
    while selector.get_map():
        events = selector.select(timeout=max(deadline - time.monotonic(), 0))
        if not events:
            _close_pool()
            raise RuntimeError(f"the zygotes did not import {PRELOAD} within {timeout} s")
        for key, _ in events:
            if key.data.read() is None:
                _close_pool()
                raise RuntimeError(f"a zygote ended while importing {PRELOAD}: see stderr")
            if key.data.ready:
                selector.unregister(key.fileobj)
    selector.close()


def _watch(zygotes, timeout, plain, script):
    """Follow a launch's workers to their ends, as torchrun's agent does."""
    launch_id = _pool["launches"]
    pids, codes = {}, {}
    selector = selectors.DefaultSelector()
    for rank, zygote in enumerate(zygotes):
        selector.register(zygote.proc.stdout, selectors.EVENT_READ, rank)
    deadline = time.monotonic() + timeout
    kill_at = None  # when the workers still running get SIGKILL
    timed_out = signalled = False
    pending = {}  # rank: the signal for its worker, not forked yet

    def stop(sig):
        for rank in range(len(zygotes)):
            if rank in codes:
                continue
            if rank in pids:
                _signal_worker(pids[rank], sig)
            else:
                pending[rank] = sig

    while len(codes) < len(zygotes):
        now = time.monotonic()
        if now >= deadline + STOP_GRACE:
            break  # a worker its zygote cannot reap: the pool starts again
        if not timed_out and now >= deadline:
            timed_out = True
            stop(signal.SIGKILL)
        elif kill_at is not None and now >= kill_at:
            stop(signal.SIGKILL)
            kill_at = None
        until = min(t for t in (deadline, kill_at, deadline + STOP_GRACE) if t and t > now)
        for key, _ in selector.select(timeout=max(until - now, 0.01)):
            rank = key.data
            messages = zygotes[rank].read()
            if messages is None:  # the zygote is gone: its worker goes too
                selector.unregister(key.fileobj)
                if rank in pids:
                    _signal_worker(pids[rank], signal.SIGKILL)
                codes.setdefault(rank, -signal.SIGKILL)
                continue
            for message in messages:
                if message["id"] != launch_id:
                    continue  # a signal the zygote got between launches
                if "pid" in message:
                    pids[rank] = message["pid"]
                    if rank in pending:
                        _signal_worker(pids[rank], pending.pop(rank))
                elif "exit" in message:
                    codes[rank] = message["exit"]
                elif "signal" in message and not timed_out:
                    signalled = True
                    stop(message["signal"])
                    kill_at = kill_at or time.monotonic() + STOP_GRACE
        if not plain and kill_at is None and any(codes.values()) and len(codes) < len(zygotes):
            stop(signal.SIGTERM)
            kill_at = time.monotonic() + STOP_GRACE
    selector.close()
    if len(codes) < len(zygotes):
        for zygote in zygotes:
            zygote.kill()
        _close_pool()
    if timed_out:
        returncode = -signal.SIGKILL
    elif plain:
        returncode = codes.get(0, 1)
    else:
        returncode = int(signalled or any(codes.values()))
    failed = {rank: code for rank, code in sorted(codes.items()) if code}
    summary = f"{script} FAILED\n" if failed else ""
    for rank, code in failed.items():
        summary += (
            f"[{rank}]:\n  rank      : {rank} (local_rank: {rank})\n"
            f"  exitcode  : {code} (pid: {pids.get(rank)})\n"
        )
    return returncode, timed_out, summary


def _signal_worker(pid, sig):
    """``sig`` to a worker's session, as torchrun sends it, and to the worker
    itself, whose session may not be made yet; SIGKILL also to every process
    under it, which may have left its session."""
    if sig == signal.SIGKILL:
        from jobs import kill_tree  # scripts/jobs.py

        kill_tree(pid)
        return
    for send in (os.kill, os.killpg):
        try:
            send(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
