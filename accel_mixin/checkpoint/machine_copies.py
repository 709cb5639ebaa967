"""Training states on machines that share no filesystem: with
``ProjectConfiguration(save_on_each_node=True)`` on several machines, the
main process of each machine writes a whole state folder of its own, alone
(``dcp_folder.save_folder(alone=True)``), holding every rank's own entries,
gathered first; the other ranks wait for it in ``save_state``'s run. Each
rank then reads its own machine's copy, and ``ResumeTraining`` resumes from
the newest one every rank has (``positions.agreed_checkpoint``).

On one machine, where every rank sees the folder, and on an object store
(an fsspec URL), which every machine sees, the ranks write one state
together whatever ``save_on_each_node`` says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from accelerate.utils import gather_object

from accel_mixin.checkpoint import storage
from accel_mixin.distributed.process_layout import saves_on_each_node, writes_files
from accel_mixin.distributed.sharding import sharded
from accel_mixin.errors import CheckpointError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from accel_mixin.checkpoint.atomic_files import Path

__all__ = ["check_unsharded", "machine_copies"]


def machine_copies(
    accelerator: Accelerator, entries: Callable[[], dict[str, Any]], path: Path
) -> dict[str, Any] | None:
    """Every rank's own entries of the state ``path`` merged (``entries()``
    returns this rank's), where each machine's main process writes a copy of
    it; None where the ranks write one state together.

    A collective where ``save_on_each_node`` is set on several processes:
    the ranks learn there how many processes write files (one per machine).
    """
    if (
        accelerator.num_processes == 1
        or not saves_on_each_node(accelerator)
        or storage.is_url(path)  # every machine sees an object store
    ):
        return None
    gathered = gather_object([(writes_files(accelerator), entries())])
    if sum(writes for writes, _ in gathered) < 2:
        return None  # one machine: its ranks share the folder
    check_unsharded(accelerator, path)
    merged: dict[str, Any] = {}
    for _, mine in gathered:
        merged.update(mine)
    return merged


def check_unsharded(accelerator: Accelerator, path: Path) -> None:
    """Raise ``CheckpointError`` where a module FSDP2 shards would be saved
    as copies per machine: no machine holds its whole state."""
    if sharded(accelerator):
        raise CheckpointError(
            f"Cannot save the training state {path}: ProjectConfiguration("
            "save_on_each_node=True) on several machines keeps a whole copy of every state "
            "on each machine, which a module that FSDP2 shards across machines has on none. "
            "Save to a filesystem every machine sees, with save_on_each_node=False (each "
            "rank writes its own shards there), or train without FSDP2 (DDP)."
        )
