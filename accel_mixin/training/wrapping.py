"""Prepare once; afterwards unwrap and rewrap by swapping references.

``accelerator.prepare`` wraps modules in DDP (broadcasting every parameter),
wraps optimizers and schedulers and patches a module's ``forward`` for
autocast; it returns an object it already marked untouched. So each slot of
the net (``module_``, ``optimizer_``, a callback's ``lr_scheduler_``, ...) keeps
its raw object and what accelerate made of it; unwrapping and rewrapping swap
references, stash or restore the forward patch, and keep the accelerator's
lists holding exactly what is wrapped now.
"""

from __future__ import annotations

import gc
import inspect
import weakref
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader

from accel_mixin.distributed.sharding import check_on_shards, sharded, sharded_module_name
from accel_mixin.internals import (
    Marks,
    accelerator_list,
    check_accelerator,
    check_dataloader,
    check_prepared_module,
    drop_dataloader,
    pop_marks,
    put_marks,
)
from accel_mixin.training.shuffling import (
    draw_orders_as_one_process,
    keeping_global_draws,
    shuffles_without_generator,
)
from accel_mixin.training.streams import prepare_stream

if TYPE_CHECKING:
    from accelerate import Accelerator

    from accel_mixin.distributed.control import Control

__all__ = ["PreparedObjects", "Slot", "prepare_dataloader", "requires_closure"]


class Slot(NamedTuple):
    """Where ``getattr(owner, attr)`` lives an object of ``kind`` ('module',
    'criterion', 'optimizer', 'scheduler'); step_once: a scheduler that steps
    once per call, whatever the number of processes."""

    key: str
    owner: Any  # the net, or the callback that builds a scheduler
    attr: str
    kind: str
    step_once: bool = False


# what a slot holds, raw or prepared: a module, criterion, optimizer or
# scheduler, or the wrapper accelerate made of it
NetObject = Any

# key -> (the accelerator's list, the object registered there)
Held = dict[str, tuple[list[Any], NetObject]]

# where accelerate wraps a trainable module in DDP (older releases lack some names)
_DDP_TYPES = frozenset(
    getattr(DistributedType, name)
    for name in ("MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_XPU")
    + ("MULTI_MUSA", "MULTI_SDAA", "MULTI_HPU", "MULTI_NEURON")
    if hasattr(DistributedType, name)
)

_TYPE_OF_KIND: dict[str, type | tuple[type, ...]] = {
    "module": torch.nn.Module,
    "criterion": torch.nn.Module,
    "optimizer": torch.optim.Optimizer,
    "scheduler": (torch.optim.lr_scheduler.LRScheduler, ReduceLROnPlateau),
}


def requires_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` cannot be called without a closure (LBFGS)."""
    try:
        param = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


def prepare_dataloader(
    accelerator: Accelerator,
    dataloader: DataLoader,
    training: bool,
    control: Control,
    inside_epochs: bool = False,
) -> DataLoader:
    """``accelerator.prepare_data_loader``, left off the accelerator's list:
    skorch builds dataloaders for every fit and predict, which would pile up.
    A stream runs as ``streams.prepare_stream`` says (``inside_epochs``:
    training states are saved inside epochs)."""
    stream = prepare_stream(accelerator, dataloader, control, training, inside_epochs)
    if stream is not None:
        return cast(DataLoader, stream)
    own_generator = shuffles_without_generator(dataloader) and accelerator.num_processes > 1
    with keeping_global_draws(own_generator):
        prepared = accelerator.prepare_data_loader(dataloader)
    drop_dataloader(accelerator, prepared)
    if training:
        check_dataloader(prepared)
        if own_generator:
            draw_orders_as_one_process(prepared)
    return prepared


def _release(held: Held) -> None:
    """Take every registered object off the accelerator's lists."""
    for container, obj in held.values():
        container[:] = [item for item in container if item is not obj]
    held.clear()


def trainability(obj: torch.nn.Module) -> tuple[bool, ...]:
    """Which parameters of a module require grad: what DDP was built for."""
    return tuple(param.requires_grad for param in obj.parameters())


class _Entry:
    __slots__ = ("marks", "prepared", "raw", "registered", "slot", "trainable")

    def __init__(
        self,
        slot: Slot,
        raw: NetObject,
        prepared: NetObject,
        registered: NetObject,
        trainable: tuple[bool, ...] | None = None,
    ) -> None:
        self.slot, self.raw, self.prepared = slot, raw, prepared
        # what accelerate listed: the raw module for DDP, the wrapper otherwise
        self.registered = registered
        self.marks: Marks = []
        self.trainable = trainable

    def holds(self, owner: object, obj: object) -> bool:
        return (
            owner is self.slot.owner
            and obj is not None
            and (obj is self.raw or obj is self.prepared)
        )


class PreparedObjects:
    """The raw and prepared objects of a net, and which of them are in use.

    Only ``prepare`` calls accelerate, for objects it has not seen; ``wrap``
    and ``unwrap`` swap. The accelerator's lists hold exactly the objects
    wrapped now, and lose them when this registry is collected with its net.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        # key -> (accelerator list, object); the finalizer's, so no entries
        # (they reference the net)
        self._held: Held = {}
        weakref.finalize(self, _release, self._held)
        self.wrapped = False

    def __len__(self) -> int:
        return len(self._entries)

    def raw_or_current(self, key: str, owner: object, attr: str) -> NetObject:
        """The raw object at ``owner.attr``, or the current one if unknown."""
        current = getattr(owner, attr, None)
        entry = self._entries.get(key)
        if entry is not None and entry.holds(owner, current):
            return entry.raw
        return current

    def module_keys(self) -> list[str]:
        """The keys of the prepared modules and criteria, in slot order."""
        return [key for key, entry in self._entries.items() if entry.trainable is not None]

    def trainability_changed(self) -> set[str]:
        """The keys of the modules whose trainable parameters changed since prepared."""
        return {
            key
            for key, entry in self._entries.items()
            if entry.trainable is not None and trainability(entry.raw) != entry.trainable
        }

    def prepare(
        self, accelerator: Accelerator, slots: Iterable[Slot], refresh: Collection[str] = ()
    ) -> None:
        """Prepare the objects not seen before, then wrap all of them.

        Slots come in the order modules, criteria, optimizers, schedulers (a
        scheduler is matched to a prepared optimizer). The modules in
        ``refresh`` get a new DDP wrapper; every rank must pass the same keys.
        """
        check_accelerator(accelerator)
        slots = list(slots)
        live = {slot.key for slot in slots}
        for key in [key for key in self._entries if key not in live]:
            self._forget(key)

        if sharded(accelerator):
            self._prepare_sharded(accelerator, slots)
        refreshed = False
        for slot in slots:
            current = getattr(slot.owner, slot.attr, None)
            entry = self._entries.get(slot.key)
            if entry is not None and slot.key in refresh and entry.holds(slot.owner, current):
                current = entry.raw
                setattr(slot.owner, slot.attr, current)
                refreshed = True
            if entry is not None and (slot.key in refresh or not entry.holds(slot.owner, current)):
                self._forget(slot.key)
                entry = None
            if entry is None:
                if not isinstance(current, _TYPE_OF_KIND[slot.kind]):
                    continue  # e.g. a criterion that is a plain function
                entry = _prepare_entry(accelerator, current, slot)
                self._entries[slot.key] = entry
            self._wrap_entry(accelerator, entry)
        self.wrapped = True
        if refreshed:
            gc.collect()  # the old DDP reducer holds hooks on the parameters

    def _prepare_sharded(self, accelerator: Accelerator, slots: list[Slot]) -> None:
        """FSDP2: the module with parameters and the optimizers are prepared in
        one call, as accelerate requires, where either is new; the module is
        sharded in place, once (a sharded one is left as it is)."""
        modules = [slot for slot in slots if slot.kind == "module"]
        name = sharded_module_name(
            (slot.key[:-1], self.raw_or_current(slot.key, slot.owner, slot.attr))
            for slot in modules
        )
        if name is None:
            return
        slot = next(slot for slot in modules if slot.key == f"{name}_")
        optimizers = [
            s
            for s in slots
            if s.kind == "optimizer"
            and isinstance(self.raw_or_current(s.key, s.owner, s.attr), torch.optim.Optimizer)
        ]
        fresh = [s for s in optimizers if not self._holds(s)]
        if self._holds(slot):
            # a new optimizer of the sharded module was built on its shards;
            # a second prepare would remap them by address, which the empty
            # shards of small parameters share (3 ranks, 2 rows)
            module = self.raw_or_current(slot.key, slot.owner, slot.attr)
            for s in fresh:
                optimizer = getattr(s.owner, s.attr)
                check_on_shards(optimizer, module, s.key, slot.key)
                ready = accelerator.prepare_optimizer(optimizer)
                self._forget_if_known(s.key)
                self._entries[s.key] = _Entry(s, optimizer, ready, ready)
            return
        # a new module comes with new optimizers (skorch builds them after it)
        together = [slot, *optimizers]
        objects = [self.raw_or_current(s.key, s.owner, s.attr) for s in together]
        replaced = slot.key in self._entries
        for s in together:
            self._forget_if_known(s.key)
        if replaced:
            # a sharded module and its FSDP2 state reference each other: the
            # one replaced (skorch's fit builds a new one) would hold its
            # shards and gradients until the interpreter's next full collection
            gc.collect()
        pop_marks(objects[0])  # else prepare skips a module prepared before
        trainable = trainability(objects[0])
        prepared = accelerator.prepare(*objects)
        for s, obj, ready in zip(together, objects, prepared):
            # the sharded module is the raw one, changed in place
            self._entries[s.key] = _Entry(s, obj, ready, ready, trainable if s is slot else None)

    def _forget_if_known(self, key: str) -> None:
        if key in self._entries:
            self._forget(key)

    def _holds(self, slot: Slot) -> bool:
        entry = self._entries.get(slot.key)
        return entry is not None and entry.holds(slot.owner, getattr(slot.owner, slot.attr, None))

    def wrap(self, accelerator: Accelerator) -> None:
        """Put back what was prepared before; never prepares. A slot emptied or
        refilled meanwhile keeps its new value and loses its entry."""
        for key, entry in list(self._entries.items()):
            slot = entry.slot
            if entry.holds(slot.owner, getattr(slot.owner, slot.attr, None)):
                self._wrap_entry(accelerator, entry)
            else:
                self._forget(key)
        self.wrapped = True

    def unwrap(self) -> None:
        """Put the raw objects in place and take them off the accelerator."""
        for entry in self._entries.values():
            slot = entry.slot
            if getattr(slot.owner, slot.attr, None) is entry.prepared:
                setattr(slot.owner, slot.attr, entry.raw)
            if slot.kind in ("module", "criterion") and not entry.marks:
                entry.marks = pop_marks(entry.raw)
        _release(self._held)
        self.wrapped = False

    def _wrap_entry(self, accelerator: Accelerator, entry: _Entry) -> None:
        slot = entry.slot
        put_marks(entry.marks)
        entry.marks = []
        if getattr(slot.owner, slot.attr, None) is not entry.prepared:
            setattr(slot.owner, slot.attr, entry.prepared)
        container = accelerator_list(accelerator, slot.kind)
        if not any(item is entry.registered for item in container):
            container.append(entry.registered)
        self._held[slot.key] = (container, entry.registered)

    def _forget(self, key: str) -> None:
        del self._entries[key]
        held = self._held.pop(key, None)
        if held is not None:
            _release({key: held})


def _prepare_entry(accelerator: Accelerator, obj: NetObject, slot: Slot) -> _Entry:
    container = accelerator_list(accelerator, slot.kind)
    before = list(container)
    trainable = trainability(obj) if slot.kind in ("module", "criterion") else None
    prepared = _prepare_one(accelerator, obj, slot)
    added = [item for item in container if not any(item is b for b in before)]
    return _Entry(slot, obj, prepared, added[0] if added else prepared, trainable)


def _prepare_one(accelerator: Accelerator, obj: NetObject, slot: Slot) -> NetObject:
    if slot.kind in ("module", "criterion"):
        # marks left by another net or a pickled copy would make accelerate skip it
        pop_marks(obj)
        # DDP refuses a module without trainable parameters (NLLLoss, ...);
        # evaluation mode still places it on the device and adds autocast
        trainable = any(trainability(obj))
        prepared = accelerator.prepare_model(obj, evaluation_mode=not trainable)
        ddp = trainable and accelerator.distributed_type in _DDP_TYPES
        check_prepared_module(prepared, obj, accelerator, wrapped=ddp)
        return prepared
    if slot.kind == "optimizer":
        return accelerator.prepare_optimizer(obj)
    prepared = accelerator.prepare_scheduler(obj)
    plateau = isinstance(obj, ReduceLROnPlateau)
    if plateau:
        prepared = _as_plateau(accelerator, prepared)
    if slot.step_once:
        # accelerate steps once per process per call, and only where the
        # optimizers stepped: right for per-batch schedules. An epoch's
        # schedule is shared by every process and steps once per epoch, as
        # in skorch, also where the epoch ends inside a window of gradient
        # accumulation (sync_with_dataloader=False) or the scaler skipped a step
        prepared.step_with_optimizer = False
    elif plateau:
        # stepped with a score per batch: once per call, with the optimizers
        prepared.split_batches = True
    return prepared


def _as_plateau(
    accelerator: Accelerator, prepared: AcceleratedScheduler
) -> AcceleratedPlateauScheduler:
    # accelerate's wrapper is no ReduceLROnPlateau, which skorch's LRScheduler
    # checks to step with the score: the same wrapper, built as one that is,
    # takes its place in the accelerator's list
    plateau = AcceleratedPlateauScheduler(
        prepared.scheduler,
        prepared.optimizers,
        step_with_optimizer=prepared.step_with_optimizer,
        split_batches=prepared.split_batches,
    )
    schedulers = accelerator_list(accelerator, "scheduler")
    schedulers[:] = [plateau if s is prepared else s for s in schedulers]
    return plateau


class AcceleratedPlateauScheduler(AcceleratedScheduler, ReduceLROnPlateau):
    """accelerate's scheduler wrapper that still passes ``isinstance`` for
    ReduceLROnPlateau, which skorch's ``LRScheduler`` steps with the score."""

    __init__ = AcceleratedScheduler.__init__
    step = AcceleratedScheduler.step
