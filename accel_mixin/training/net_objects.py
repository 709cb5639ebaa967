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
from accel_mixin.training.process_state import process_state
from accel_mixin.training.stepping import takes_closures
from accel_mixin.training.wrapping import Slot, requires_closure

if TYPE_CHECKING:
    from skorch import NeuralNet

__all__ = [
    "bare_modules",
    "check_device",
    "check_net_replicas",
    "check_optimizers",
    "check_params",
    "check_sharding",
    "net_modules",
    "prepare_retrainable_modules",
    "raw",
    "raw_scheduler",
    "sharded_module",
    "shards_in_place",
    "slots",
]


def _scheduler_slot(cb_name: str, cb: LRScheduler) -> Slot:
    # a scheduler stepped per epoch steps once whatever the number of processes
    key = f"callbacks__{cb_name}__lr_scheduler_"
    return Slot(key, cb, "lr_scheduler_", "scheduler", step_once=cb.step_every != "batch")


def slots(net: NeuralNet) -> Iterator[Slot]:
    """Every slot accelerate prepares, in the order it must prepare them."""
    for kind, names in (
        ("module", net._modules),  # pylint: disable=protected-access
        ("criterion", net._criteria),  # pylint: disable=protected-access
        ("optimizer", net._optimizers),  # pylint: disable=protected-access
    ):
        for name in names:
            yield Slot(name + "_", net, name + "_", kind)
    for cb_name, cb in getattr(net, "callbacks_", []):
        if isinstance(cb, LRScheduler):
            yield _scheduler_slot(cb_name, cb)


def raw(net: NeuralNet, name: str) -> Any:
    """The object the net built for ``name`` ('module', 'optimizer2'), wrapped now or not."""
    return process_state(net).prepared.raw_or_current(name + "_", net, name + "_")


def raw_scheduler(cb_name: str, cb: LRScheduler, net: NeuralNet) -> Any:
    """The scheduler an ``LRScheduler`` callback built, unwrapped, or None."""
    slot = _scheduler_slot(cb_name, cb)
    return process_state(net).prepared.raw_or_current(slot.key, slot.owner, slot.attr)


def _named_raw(net: NeuralNet, names: list[str]) -> list[tuple[str, Any]]:
    return [(name, raw(net, name)) for name in names]


def sharded_module(net: NeuralNet) -> tuple[str, torch.nn.Module] | None:
    """``(name, module)`` of the module FSDP2 shards, or None."""
    name = sharded_module_name(_named_raw(net, net._modules))  # pylint: disable=protected-access
    return None if name is None else (name, raw(net, name))


def shards_in_place(net: NeuralNet) -> None:
    """Under FSDP2, make the sharded module's parameters its shards, those the
    optimizer holds: after a forward pass FSDP2 leaves the root's gathered
    parameters in place, which a callback (``Freezer``) or a new optimizer
    would otherwise take for the module's own."""
    if sharded(net.accelerator):
        named = sharded_module(net)
        if named is not None:
            reshard(named[1])


def check_sharding(net: NeuralNet) -> None:
    """Under FSDP2, refuse modules and criteria with parameters besides the one sharded."""
    if sharded(net.accelerator):
        # pylint: disable=protected-access
        check_shardable(_named_raw(net, net._modules), _named_raw(net, net._criteria))


def net_modules(net: NeuralNet) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every raw module and criterion that is a ``torch.nn.Module``."""
    for name in net._modules + net._criteria:  # pylint: disable=protected-access
        module = raw(net, name)
        if isinstance(module, torch.nn.Module):
            yield name, module


@contextmanager
def bare_modules(net: NeuralNet) -> Iterator[None]:
    """Within the block the net's module and criterion attributes hold the raw
    objects (a sharded module its shards)."""
    shards_in_place(net)
    swapped = []
    for name in net._modules + net._criteria:  # pylint: disable=protected-access
        current = getattr(net, name + "_", None)
        bare = raw(net, name)
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


def check_optimizers(net: NeuralNet) -> None:
    """Refuse optimizers that need a closure where accelerate cannot give one."""
    if takes_closures(net.accelerator):
        return
    for name in net._optimizers:  # pylint: disable=protected-access
        optimizer = raw(net, name)
        if optimizer is not None and requires_closure(optimizer):
            raise ValueError(
                f"The optimizer {name}_ ({type(optimizer).__name__}) needs a "
                "closure to step, which accelerate's gradient scaling and "
                "accumulation do not support; with mixed precision fp16 or "
                "gradient_accumulation_steps > 1, choose an optimizer whose step() "
                "works without arguments (e.g. torch.optim.Adam)."
            )


def prepare_retrainable_modules(net: NeuralNet) -> None:
    """Give a new DDP wrapper to the modules whose trainable parameters changed
    (``Freezer``, ``requires_grad_``) on any rank; one small all-reduce."""
    accelerator = net.accelerator
    if accelerator.distributed_type == DistributedType.NO or sharded(accelerator):
        return  # no DDP, so nothing to rebuild
    prepared = process_state(net).prepared
    keys = prepared.module_keys()
    if not keys:
        return
    changed = prepared.trainability_changed()
    flags = torch.tensor(
        [key in changed for key in keys], dtype=torch.int64, device=accelerator.device
    )
    flags = accelerator.reduce(flags, reduction="sum")
    refresh = {key for key, flag in zip(keys, flags.tolist()) if flag}
    if refresh:
        prepared.prepare(accelerator, slots(net), refresh=refresh)


def check_net_replicas(net: NeuralNet, when: str) -> None:
    """``check_replicas`` on every parameter of the net's modules and criteria
    that each rank holds whole: a sharded one (FSDP2) is no replica."""
    modules = ((name + "_", module) for name, module in net_modules(net))
    check_replicas(net.accelerator, replicated(named_parameters(modules)), when)
