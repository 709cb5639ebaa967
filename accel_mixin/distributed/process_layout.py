"""The layout of the processes: refuse launches and backends that would train
wrong models or hang; say which processes write files, and let the main one
speak for all (what torch's C++ code writes to the stderr descriptor is left
alone: the guide's "One voice" silences it)."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from accelerate.utils import DistributedType, parse_flag_from_env

from accel_mixin.distributed.parallelism import check_parallelism
from accel_mixin.distributed.sharding import sharded

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["check_not_a_child_of_a_rank", "check_process_layout", "check_supported"]
__all__ += ["quiet_unless_main", "saves_on_each_node", "silent", "sink_for", "writes_files"]


def _env_int(name: str, default: int = 1) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def check_process_layout(accelerator: Accelerator) -> None:
    """Raise ``RuntimeError`` if ``WORLD_SIZE`` says several processes were
    launched together while the accelerator sees one: ``torchrun`` without a
    GPU, unless accelerate is told to use the CPU, trains independent models."""
    world_size = _env_int("WORLD_SIZE")
    if world_size <= 1 or accelerator.num_processes > 1:
        return
    raise RuntimeError(
        f"This process is one of WORLD_SIZE={world_size} processes launched "
        "together, but the Accelerator sees a single process "
        f"(distributed_type={accelerator.distributed_type}), so every process "
        "would train its own model without syncing gradients. On CPU, set "
        "ACCELERATE_USE_CPU=true in the environment of the launcher or create "
        "the accelerator with Accelerator(cpu=True); with GPUs, make sure "
        "every process can see CUDA."
    )


# these backends break late and obscurely: DeepSpeed and Megatron-LM wrap the
# model, optimizer and scheduler into engines of their own, FSDP1 wraps the
# module in a FlatParameter wrapper whose optimizer and state dicts the
# mixin's files do not know, and XLA's collectives of several processes are
# not the ones used here. FSDP2 (torch's fully_shard) is supported (sharding.py).
_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.MEGATRON_LM: "Megatron-LM",
}

# What names a rank: inherited by the processes it starts, absent from the
# environment its launcher was started with.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def _started_with(pid: int) -> dict[str, str] | None:
    """The environment process ``pid`` was started with (Linux's
    ``/proc/PID/environ``, which later changes to its ``os.environ`` leave
    alone); None where it cannot be read: no ``/proc``, another user's."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    pairs = (item.partition(b"=") for item in data.split(b"\0") if item)
    return {os.fsdecode(name): os.fsdecode(value) for name, _, value in pairs}


def check_not_a_child_of_a_rank() -> None:
    """Raise ``RuntimeError`` in a process (``GridSearchCV(n_jobs=2)``'s
    workers) started by a rank of a job of several processes.

    Such a process inherits the rank's ``RANK`` and ``WORLD_SIZE``, and an
    Accelerator built there waits for a rendezvous that never comes. Its
    parent is then a program that ``torchrun`` (or ``accelerate launch``)
    started with this very ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``. A
    rank's own parent is its launcher, started without them: ``torchrun``
    (in a job of its own, as Kubeflow's pods, without ``LOCAL_RANK``), or
    the kernel whose ``notebook_launcher`` forks the ranks after setting
    them. Linux only (``/proc``): elsewhere nothing is refused, nor a worker
    of a rank that was itself forked (``notebook_launcher``'s).
    """
    if _env_int("WORLD_SIZE") <= 1:
        return
    parent = os.getppid()
    started = _started_with(parent)
    if started is None or any(started.get(k) != os.environ.get(k) for k in _RANK_VARIABLES):
        return
    raise RuntimeError(
        f"This process (pid {os.getpid()}) was started by rank {os.environ.get('RANK')} of a "
        f"job of WORLD_SIZE={os.environ.get('WORLD_SIZE')} processes (pid {parent}), e.g. "
        "as a worker of GridSearchCV(n_jobs=...) or cross_validate(n_jobs=...): it inherits "
        "the job's RANK and WORLD_SIZE, and an Accelerator built here would wait forever for "
        "a process group it cannot join. Use n_jobs=1 in a job of several processes: its "
        "processes already share every fit."
    )


def check_fsdp_selected(accelerator: Accelerator) -> None:
    """Raise ``ValueError`` where FSDP was asked for and accelerate did not
    select it: it would train unsharded, without a word.

    ``Accelerator(fsdp_plugin=...)`` sets ``ACCELERATE_USE_FSDP=true``, as
    ``accelerate launch --use_fsdp`` does; accelerate then selects FSDP only
    for several processes on GPUs and other accelerators, never on CPU.
    """
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP or not parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return
    raise ValueError(
        f"FSDP was asked for (an FSDP plugin passed to the Accelerator, or "
        f"ACCELERATE_USE_FSDP=true, which `accelerate launch --use_fsdp` and the plugin set), "
        f"but accelerate selected distributed_type={kind} on {accelerator.num_processes} "
        f"process(es) of device {accelerator.device}: accelerate shards with FSDP only "
        "across several processes on GPUs (or other accelerators), never on CPU, so this "
        "net would train unsharded without a word. Launch it on GPUs to shard, or, to "
        "train unsharded (DDP), create the Accelerator without fsdp_plugin and launch "
        "without --use_fsdp (ACCELERATE_USE_FSDP unset)."
    )


def check_supported(accelerator: Accelerator) -> None:
    """Raise ``ValueError``, naming the backend, for the backends this mixin
    cannot train with, where FSDP was asked for but not selected, and for
    the settings only accelerate's ``prepare()`` applies (``parallelism``)."""
    check_fsdp_selected(accelerator)
    check_parallelism(accelerator)
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP and not sharded(accelerator):
        raise ValueError(
            f"AccelerateMixin does not support FSDP1 (distributed_type={kind}, "
            "fsdp_version=1): it shards with FSDP2, torch's fully_shard. Create the "
            "accelerator with Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin("
            "fsdp_version=2)), or set fsdp_version: 2 in `accelerate config`; see the guide "
            "page 'Models larger than one process' for moving from FSDP1."
        )
    name = _UNSUPPORTED.get(kind)
    if name is None and kind == DistributedType.XLA and accelerator.num_processes > 1:
        name = "XLA (TPU) with several processes"
    if name is not None:
        raise ValueError(
            f"AccelerateMixin does not support {name} (distributed_type={kind}), whose "
            "engines replace the module, optimizer and scheduler that skorch builds. "
            "Supported: one process, DDP across processes and machines (CPU, CUDA, MPS; "
            "one XLA device), and FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2)), "
            "with mixed precision and gradient accumulation. Configure accelerate without "
            "it (`accelerate config`), or train with accelerate directly."
        )


def saves_on_each_node(accelerator: Accelerator) -> bool:
    """Whether ``ProjectConfiguration(save_on_each_node=True)`` is set."""
    config = getattr(accelerator, "project_configuration", None)
    return bool(getattr(config, "save_on_each_node", False))


def writes_files(accelerator: Accelerator) -> bool:
    """Whether this process writes checkpoint files: the main process; with
    ``ProjectConfiguration(save_on_each_node=True)``, every machine's."""
    if saves_on_each_node(accelerator):
        return accelerator.is_local_main_process
    return accelerator.is_main_process


def silent(*args: Any, **kwargs: Any) -> None:  # pylint: disable=unused-argument
    """A sink that prints nothing: the sink of processes other than the main."""


def sink_for(accelerator: Accelerator) -> Callable[..., None]:
    """``print`` on the main process only: the builtin itself, for skorch's
    rule that ``verbose=0`` silences a ``print`` sink."""
    return print if accelerator.is_main_process else silent


@contextlib.contextmanager
def quiet_unless_main(accelerator: Accelerator) -> Iterator[None]:
    """On processes other than the main one, silence stdout, stderr and warnings."""
    if accelerator.is_main_process:
        yield
        return
    with (
        contextlib.redirect_stdout(_devnull()),
        contextlib.redirect_stderr(_devnull()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        yield


@functools.cache
def _devnull() -> TextIO:
    # one file, never closed: a progress bar made while quiet keeps it
    return open(os.devnull, "w", encoding="utf-8")
