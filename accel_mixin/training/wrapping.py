"""Prepare once; afterwards unwrap and rewrap by swapping references.

``accelerator.prepare`` wraps modules in DDP (which broadcasts every
parameter), wraps optimizers and schedulers, and patches ``forward`` of the raw
module for autocast. Doing that again after every save or load is slow, and
since accelerate 1.14 it silently does nothing for an object it already marked
as prepared. So each slot of the net (``module_``, ``optimizer_``, a
callback's ``lr_scheduler_``, ...) keeps its raw object and what accelerate
made of it; unwrapping and rewrapping only swap references, stash or restore
the forward patch, and keep the accelerator's lists holding exactly what is
wrapped now.
"""

import gc
import inspect
import weakref
from collections import namedtuple

import torch
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType
from torch.optim.lr_scheduler import ReduceLROnPlateau

from accel_mixin.internals import check_accelerator, check_dataloader, check_prepared_module

__all__ = ["PreparedObjects", "Slot", "prepare_dataloader", "requires_closure"]

Slot = namedtuple("Slot", ["key", "owner", "attr", "kind", "step_once"], defaults=[False])
Slot.__doc__ = """Where a preparable object lives.

key : str
  Unique name of the slot, e.g. ``'module_'``.
owner, attr
  The object lives at ``getattr(owner, attr)``.
kind : str
  One of ``'module'``, ``'criterion'``, ``'optimizer'``, ``'scheduler'``.
step_once : bool
  Schedulers only: step once per call, whatever the number of processes.
"""

# accelerate's marks on a raw module: the autocast patch of ``forward`` and
# the flag that makes ``prepare`` return the module untouched.
_ACCELERATE_MARKS = ("forward", "_original_forward", "_is_accelerate_prepared")

# where accelerate wraps a trainable module in DDP (names of older releases
# may be missing)
_DDP_TYPES = frozenset(
    getattr(DistributedType, name)
    for name in (
        "MULTI_CPU",
        "MULTI_GPU",
        "MULTI_NPU",
        "MULTI_MLU",
        "MULTI_XPU",
        "MULTI_MUSA",
        "MULTI_SDAA",
        "MULTI_HPU",
        "MULTI_NEURON",
    )
    if hasattr(DistributedType, name)
)

_LIST_OF_KIND = {
    "module": "_models",
    "criterion": "_models",
    "optimizer": "_optimizers",
    "scheduler": "_schedulers",
}

_TYPE_OF_KIND = {
    "module": torch.nn.Module,
    "criterion": torch.nn.Module,
    "optimizer": torch.optim.Optimizer,
    "scheduler": (torch.optim.lr_scheduler.LRScheduler, ReduceLROnPlateau),
}


def requires_closure(optimizer):
    """Whether ``optimizer.step`` cannot be called without a closure (LBFGS)."""
    try:
        param = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


def prepare_dataloader(accelerator, dataloader, training):
    """``accelerator.prepare_data_loader(dataloader)``, left off the
    accelerator's list: skorch builds dataloaders anew for every fit and
    predict, which would pile up in the accelerator and in every pickle of
    it. A training dataloader's shuffling is part of a training state."""
    prepared = accelerator.prepare_data_loader(dataloader)
    dataloaders = accelerator._dataloaders  # pylint: disable=protected-access
    dataloaders[:] = [dl for dl in dataloaders if dl is not prepared]
    if training:
        check_dataloader(prepared)
    return prepared


def _pop_marks(obj):
    """Remove accelerate's marks from a raw module; return them for restoring.

    A compiled module keeps part of them on its ``_orig_mod``.
    """
    targets = [obj] + [t for t in (vars(obj).get("_modules", {}).get("_orig_mod"),) if t]
    patched = any("_original_forward" in vars(t) for t in targets)
    # only the forward that accelerate patched is ours to remove
    keys = _ACCELERATE_MARKS if patched else ("_is_accelerate_prepared",)
    marks = [(t, {k: vars(t).pop(k) for k in keys if k in vars(t)}) for t in targets]
    original = next((m["_original_forward"] for _, m in marks if "_original_forward" in m), None)
    if original is not None and getattr(original, "__func__", None) is not type(obj).forward:
        # the forward accelerate replaced was the instance's own (torch.compile's)
        vars(obj)["forward"] = original
    return marks


def _put_marks(marks):
    for target, attrs in marks:
        vars(target).update(attrs)


def _release(held):
    """Take every registered object off the accelerator's lists."""
    for container, obj in held.values():
        container[:] = [item for item in container if item is not obj]
    held.clear()


def trainability(obj):
    """Which parameters of a module require grad: what DDP was built for."""
    return tuple(param.requires_grad for param in obj.parameters())


class _Entry:
    __slots__ = ("marks", "prepared", "raw", "registered", "slot", "trainable")

    def __init__(self, slot, raw, prepared, registered, trainable=None):
        self.slot = slot
        self.raw = raw
        self.prepared = prepared
        # what accelerate put in its list: the raw module for DDP, the
        # wrapper for optimizers and schedulers
        self.registered = registered
        self.marks = []
        self.trainable = trainable

    def holds(self, owner, obj):
        return (
            owner is self.slot.owner
            and obj is not None
            and (obj is self.raw or obj is self.prepared)
        )


class PreparedObjects:
    """The raw and prepared objects of a net, and which of them are in use.

    ``prepare`` is the only method that calls accelerate's ``prepare``, and
    only for objects it has not seen; ``wrap`` and ``unwrap`` just swap.
    The accelerator's lists hold exactly the objects wrapped now, and lose
    them when this registry is garbage collected with its net.

    """

    def __init__(self):
        self._entries = {}
        # key -> (accelerator list, object); also read by the finalizer,
        # which must not reference the entries: they reference the net.
        self._held = {}
        weakref.finalize(self, _release, self._held)
        self.wrapped = False

    def __len__(self):
        return len(self._entries)

    def raw_or_current(self, key, owner, attr):
        """The raw object at ``owner.attr``, or the current one if unknown."""
        current = getattr(owner, attr, None)
        entry = self._entries.get(key)
        if entry is not None and entry.holds(owner, current):
            return entry.raw
        return current

    def module_keys(self):
        """The keys of the prepared modules and criteria, in slot order."""
        return [key for key, entry in self._entries.items() if entry.trainable is not None]

    def trainability_changed(self):
        """The keys of the modules whose trainable parameters changed since
        they were prepared."""
        return {
            key
            for key, entry in self._entries.items()
            if entry.trainable is not None and trainability(entry.raw) != entry.trainable
        }

    def prepare(self, accelerator, slots, refresh=()):
        """Prepare the objects not seen before, then wrap all of them.

        Slots must come in the order modules, criteria, optimizers,
        schedulers: a scheduler is matched to an already prepared optimizer.
        The modules whose keys are in ``refresh`` are prepared again (a new
        DDP wrapper); every rank must pass the same keys.

        """
        check_accelerator(accelerator)
        slots = list(slots)
        live = {slot.key for slot in slots}
        for key in [key for key in self._entries if key not in live]:
            self._forget(key)

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
            # the old DDP wrapper's reducer holds hooks on the parameters
            # until it is collected
            gc.collect()

    def wrap(self, accelerator):
        """Put back what was prepared before; never prepares.

        A slot that was emptied or refilled meanwhile (``trim_for_prediction``,
        a re-initialized module) keeps its new value and loses its entry.

        """
        for key, entry in list(self._entries.items()):
            slot = entry.slot
            if entry.holds(slot.owner, getattr(slot.owner, slot.attr, None)):
                self._wrap_entry(accelerator, entry)
            else:
                self._forget(key)
        self.wrapped = True

    def unwrap(self):
        """Put the raw objects in place and take them off the accelerator."""
        for entry in self._entries.values():
            slot = entry.slot
            if getattr(slot.owner, slot.attr, None) is entry.prepared:
                setattr(slot.owner, slot.attr, entry.raw)
            if slot.kind in ("module", "criterion") and not entry.marks:
                entry.marks = _pop_marks(entry.raw)
        _release(self._held)
        self.wrapped = False

    def _wrap_entry(self, accelerator, entry):
        slot = entry.slot
        _put_marks(entry.marks)
        entry.marks = []
        if getattr(slot.owner, slot.attr, None) is not entry.prepared:
            setattr(slot.owner, slot.attr, entry.prepared)
        container = _container(accelerator, slot)
        if not any(item is entry.registered for item in container):
            container.append(entry.registered)
        self._held[slot.key] = (container, entry.registered)

    def _forget(self, key):
        del self._entries[key]
        held = self._held.pop(key, None)
        if held is not None:
            _release({key: held})


def _container(accelerator, slot):
    return getattr(accelerator, _LIST_OF_KIND[slot.kind])


def _prepare_entry(accelerator, obj, slot):
    container = _container(accelerator, slot)
    before = list(container)
    trainable = trainability(obj) if slot.kind in ("module", "criterion") else None
    prepared = _prepare_one(accelerator, obj, slot)
    added = [item for item in container if not any(item is b for b in before)]
    registered = added[0] if added else prepared
    return _Entry(slot, obj, prepared, registered, trainable)


def _prepare_one(accelerator, obj, slot):
    if slot.kind in ("module", "criterion"):
        # Marks left by another net or a pickled copy would make accelerate
        # skip DDP and autocast for this module.
        _pop_marks(obj)
        # DDP refuses a module without trainable parameters (NLLLoss, ...);
        # evaluation mode still places it on the device and adds autocast.
        trainable = any(trainability(obj))
        prepared = accelerator.prepare_model(obj, evaluation_mode=not trainable)
        # the marks unwrapping relies on, and a DDP wrapper where one is due
        check_prepared_module(
            prepared,
            obj,
            accelerator,
            wrapped=trainable and accelerator.distributed_type in _DDP_TYPES,
        )
        return prepared
    if slot.kind == "optimizer":
        return accelerator.prepare_optimizer(obj)
    prepared = accelerator.prepare_scheduler(obj)
    if isinstance(obj, ReduceLROnPlateau):
        prepared.__class__ = AcceleratedPlateauScheduler
    if slot.step_once or isinstance(obj, ReduceLROnPlateau):
        # accelerate steps a scheduler once per process per call, which
        # suits per-batch schedules; per-epoch schedules and plateau
        # detection count epochs, which every process shares.
        prepared.split_batches = True
    return prepared


class AcceleratedPlateauScheduler(AcceleratedScheduler, ReduceLROnPlateau):
    """accelerate's scheduler wrapper that still passes for ReduceLROnPlateau.

    skorch's ``LRScheduler`` steps a ``ReduceLROnPlateau`` with the monitored
    score and finds it with ``isinstance``; all behaviour is
    ``AcceleratedScheduler``'s, which passes the score on.
    """

    __init__ = AcceleratedScheduler.__init__
    step = AcceleratedScheduler.step
