"""What a bug report needs: versions, what accelerate sees, every rank's layout.

``python -m accel_mixin env`` prints it; launched on several processes, the
main process prints one line per rank, with whether its layout check passes.
"""

from __future__ import annotations

import os
import platform
import sys

import accelerate
import skorch
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

import accel_mixin
from accel_mixin.distributed.process_layout import check_process_layout

__all__ = ["environment_report", "rank_line", "restart_store"]

_LAUNCH_VARIABLES: tuple[str, ...] = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_CPU")
_LAUNCH_VARIABLES += ("ACCELERATE_MIXED_PRECISION", "CUDA_VISIBLE_DEVICES")


def restart_store() -> str | None:
    """Whether the launch's rendezvous keeps its store across restarts, in
    words, or None outside an elastic launch."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (
            "restarts: the rendezvous store is shared across restarts (static "
            "--master_addr/--master_port, or c10d's default); accel_mixin keeps its keys "
            "apart per attempt, but torch's gloo may read a dead attempt's addresses and "
            "fail or hang in init_process_group: use --rdzv-backend c10d --rdzv-endpoint "
            "HOST:PORT with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        )
    return "restarts: every attempt gets a store of its own"


def rank_line(accelerator: Accelerator) -> str:
    """What this rank sees, and what the launch layout check says here."""
    try:
        check_process_layout(accelerator)
        layout = "layout check: ok"
    except RuntimeError as exc:
        layout = f"layout check: FAILS: {exc}"
    launch = [f"{name}={os.environ[name]}" for name in _LAUNCH_VARIABLES if name in os.environ]
    return (
        f"rank {accelerator.process_index} of {accelerator.num_processes}: "
        f"distributed_type={accelerator.distributed_type.value}, "
        f"mixed_precision={accelerator.mixed_precision}, device={accelerator.device}; "
        f"{', '.join(launch) or 'no launcher variables'}; {layout}"
    )


def environment_report(accelerator: Accelerator | None = None) -> str | None:
    """The report of ``accelerator`` (by default ``Accelerator()``, as a script
    builds it) on the main process, None on the others; every process calls it."""
    accelerator = accelerator or Accelerator()
    lines: list[str] = [rank_line(accelerator)]

    if accelerator.num_processes > 1:
        lines = gather_object(lines)
    if not accelerator.is_main_process:
        return None
    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"
    versions = [
        f"accel_mixin {accel_mixin.__version__}",
        f"python {platform.python_version()} ({sys.executable}) on {platform.platform()}",
        f"torch {torch.__version__} ({cuda if torch.cuda.is_available() else 'no CUDA device'})",
        f"accelerate {accelerate.__version__}",
        f"skorch {skorch.__version__}",
    ]
    restarts = restart_store()
    return "\n".join(versions + ([restarts] if restarts else []) + lines)
