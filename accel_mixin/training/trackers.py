"""accelerate's experiment trackers (``Accelerator(log_with=...)``) receive
the history's epoch rows, as skorch's own loggers do.

accelerate starts its trackers and logs to them on the main process only
(``init_trackers`` and ``log`` do nothing elsewhere), so this adds no
collective: every rank has the same row once the epoch's end agreed on it.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["log_row", "start_trackers"]


def start_trackers(accelerator: Accelerator, project_name: str) -> None:
    """Start the trackers of ``log_with`` as ``project_name``, unless the
    script started them already (``accelerator.init_trackers``), with a
    name and configuration of its own."""
    if accelerator.log_with and not accelerator.trackers:
        accelerator.init_trackers(project_name)


def log_row(accelerator: Accelerator, row: dict[str, Any]) -> None:
    """Log the numbers of the history's ``row`` at the step of its epoch;
    flags (``valid_loss_best``) and the batches' records are left out."""
    if not accelerator.log_with:
        return
    values = {
        key: float(value)
        for key, value in row.items()
        if key != "epoch" and isinstance(value, numbers.Real) and not isinstance(value, bool)
    }
    accelerator.log(values, step=int(row["epoch"]))
