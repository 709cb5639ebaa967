"""The objects of a skorch net that accelerate prepares.

Modules, criteria and optimizers the net builds (``module_``, ``module2_``,
...) and the schedulers its ``LRScheduler`` callbacks build each live in a
slot (``wrapping.Slot``). This module lists the slots in the order accelerate
prepares them, finds the raw objects behind wrappers, and prepares again the
modules whose trainable parameters changed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import DistributedType
from skorch.callbacks import LRScheduler

from accel_mixin.distributed.history_sync import adopt_history
from accel_mixin.distributed.replicas import check_replicas, named_parameters
from accel_mixin.distributed.sharding import (
    check_shardable,
    replicated,
    reshard,
    sharded,
    sharded_module_name,
)
from accel_mixin.training.stepping import takes_closures
from accel_mixin.training.wrapping import PreparedObjects, Slot, requires_closure

if TYPE_CHECKING:
    from accelerate import Accelerator
    from skorch import NeuralNet

    from accel_mixin.distributed.object_gather import Gather

__all__ = [
    "NetObjects",
    "bare_modules",
    "check_device",
    "check_net_replicas",
    "check_optimizers",
    "check_params",
    "check_sharding",
    "prepare_retrainable_modules",
    "replica_parameters",
    "retrainable_modules",
    "shards_in_place",
]


def _scheduler_slot(cb_name: str, cb: LRScheduler) -> Slot:
    # a scheduler stepped per epoch steps once whatever the number of processes
    key = f"callbacks__{cb_name}__lr_scheduler_"
    return Slot(key, cb, "lr_scheduler_", "scheduler", step_once=cb.step_every != "batch")


class NetObjects:
    """The objects ``net`` built, by the names of skorch's registries
    (``modules``, ``criteria``, ``optimizers``), and what accelerate made of
    them (``prepared``). The net makes one where it is needed and hands it
    down, so that no module below reads the net's registries."""

    __slots__ = ("criteria", "modules", "net", "optimizers", "prepared")

    def __init__(
        self,
        net: NeuralNet,
        prepared: PreparedObjects,
        modules: list[str],
        criteria: list[str],
        optimizers: list[str],
    ) -> None:
        self.net, self.prepared = net, prepared
        self.modules, self.criteria, self.optimizers = modules, criteria, optimizers

    def slots(self) -> Iterator[Slot]:
        """Every slot accelerate prepares, in the order it must prepare them."""
        for kind, names in (
            ("module", self.modules),
            ("criterion", self.criteria),
            ("optimizer", self.optimizers),
        ):
            for name in names:
                yield Slot(name + "_", self.net, name + "_", kind)
        for cb_name, cb in getattr(self.net, "callbacks_", []):
            if isinstance(cb, LRScheduler):
                yield _scheduler_slot(cb_name, cb)

    def raw(self, name: str) -> Any:
        """The object the net built for ``name`` ('module', 'optimizer2'), wrapped now or not."""
        return self.prepared.raw_or_current(name + "_", self.net, name + "_")

    def scheduler(self, cb_name: str, cb: LRScheduler) -> Any:
        """The scheduler an ``LRScheduler`` callback built, unwrapped, or None."""
        slot = _scheduler_slot(cb_name, cb)
        return self.prepared.raw_or_current(slot.key, slot.owner, slot.attr)

    def raw_optimizers(self) -> dict[str, Any]:
        """The optimizers the net built, by name."""
        return {name: self.raw(name) for name in self.optimizers}

    def named_modules(self) -> Iterator[tuple[str, torch.nn.Module]]:
        """``(name, module)`` of every raw module and criterion that is a ``torch.nn.Module``."""
        for name in self.modules + self.criteria:
            module = self.raw(name)
            if isinstance(module, torch.nn.Module):
                yield name, module

    def sharded_module(self) -> tuple[str, torch.nn.Module] | None:
        """``(name, module)`` of the module FSDP2 shards, or None."""
        name = sharded_module_name(self.named_raw(self.modules))
        return None if name is None else (name, self.raw(name))

    def named_raw(self, names: list[str]) -> list[tuple[str, Any]]:
        """``(name, object)`` of the objects the net built for ``names``."""
        return [(name, self.raw(name)) for name in names]


def shards_in_place(objects: NetObjects) -> None:
    """Under FSDP2, make the sharded module's parameters its shards, those the
    optimizer holds: after a forward pass FSDP2 leaves the root's gathered
    parameters in place, which a callback (``Freezer``) or a new optimizer
    would otherwise take for the module's own."""
    if sharded(objects.net.accelerator):
        named = objects.sharded_module()
        if named is not None:
            reshard(named[1])


def check_sharding(objects: NetObjects) -> None:
    """Under FSDP2, refuse modules and criteria with parameters besides the one sharded."""
    if sharded(objects.net.accelerator):
        check_shardable(objects.named_raw(objects.modules), objects.named_raw(objects.criteria))


@contextmanager
def bare_modules(objects: NetObjects) -> Iterator[None]:
    """Within the block the net's module and criterion attributes hold the raw
    objects (a sharded module its shards)."""
    shards_in_place(objects)
    net, swapped = objects.net, []
    for name in objects.modules + objects.criteria:
        current = getattr(net, name + "_", None)
        bare = objects.raw(name)
        if bare is not current:
            swapped.append((name + "_", current))
            setattr(net, name + "_", bare)
    try:
        yield
    finally:
        for attr, current in swapped:
            setattr(net, attr, current)


def check_device(net: NeuralNet) -> None:
    """Refuse a ``device`` where the accelerator places the net: before skorch
    moves anything (``device='cuda'`` without CUDA would fail in torch)."""
    accelerator = net.accelerator
    if accelerator.device_placement and net.device is not None:
        raise ValueError(
            f"device={net.device!r} was given, but the accelerator places the modules and "
            f"the data itself (on {accelerator.device}). When device placement is performed "
            "by the accelerator, set device=None; to place them yourself, create the "
            "accelerator with Accelerator(device_placement=False)."
        )


def check_params(net: NeuralNet) -> None:
    """Refuse parameters that contradict the accelerator or the mixin."""
    check_device(net)
    adopt_history(net)
    every = net.replica_check_every
    if every is not None and (not isinstance(every, int) or every < 0):
        raise ValueError(
            f"replica_check_every must be a whole number of epochs (0 turns the check "
            f"off), got {every!r}"
        )
    io_timeout = net.io_timeout
    if io_timeout is not None and (
        isinstance(io_timeout, bool) or not isinstance(io_timeout, (int, float)) or io_timeout <= 0
    ):
        raise ValueError(
            f"io_timeout must be a number of seconds above 0, or None for the process "
            f"group's timeout, got {io_timeout!r}"
        )


def check_optimizers(objects: NetObjects) -> None:
    """Refuse optimizers that need a closure where accelerate cannot give one."""
    if takes_closures(objects.net.accelerator):
        return
    for name, optimizer in objects.raw_optimizers().items():
        if optimizer is not None and requires_closure(optimizer):
            raise ValueError(
                f"The optimizer {name}_ ({type(optimizer).__name__}) needs a "
                "closure to step, which accelerate's gradient scaling and "
                "accumulation do not support; with mixed precision fp16 or "
                "gradient_accumulation_steps > 1, choose an optimizer whose step() "
                "works without arguments (e.g. torch.optim.Adam)."
            )


def _in_ddp(accelerator: Accelerator) -> bool:
    """Whether prepared modules are DDP wrappers, which a change of trainable
    parameters invalidates."""
    return accelerator.distributed_type != DistributedType.NO and not sharded(accelerator)


def retrainable_modules(objects: NetObjects) -> set[str]:
    """The keys of the DDP-wrapped modules whose trainable parameters changed
    on this rank (``Freezer``, ``requires_grad_``)."""
    if not _in_ddp(objects.net.accelerator):
        return set()
    return objects.prepared.trainability_changed()


def prepare_retrainable_modules(objects: NetObjects) -> None:
    """Give a new DDP wrapper to the modules whose trainable parameters changed
    (``retrainable_modules``) on any rank; one small all-reduce."""
    accelerator, prepared = objects.net.accelerator, objects.prepared
    keys = prepared.module_keys()
    if not keys or not _in_ddp(accelerator):
        return
    changed = prepared.trainability_changed()
    flags = torch.tensor(
        [key in changed for key in keys], dtype=torch.int64, device=accelerator.device
    )
    flags = accelerator.reduce(flags, reduction="sum")
    refresh = {key for key, flag in zip(keys, flags.tolist()) if flag}
    if refresh:
        prepared.prepare(accelerator, objects.slots(), refresh=refresh)


def replica_parameters(objects: NetObjects) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of the net's modules and criteria that each rank holds
    whole: a sharded one (FSDP2) is no replica."""
    modules = ((name + "_", module) for name, module in objects.named_modules())
    return replicated(named_parameters(modules))


def check_net_replicas(objects: NetObjects, when: str, gather: Gather) -> None:
    """``check_replicas`` on the net's ``replica_parameters``."""
    check_replicas(replica_parameters(objects), when, gather)
