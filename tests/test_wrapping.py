"""PreparedObjects on its own: prepare once, swap, keep the lists exact."""

import gc
import pickle
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from accel_mixin.training.wrapping import PreparedObjects, Slot, requires_closure


def make_owner():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2))
    criterion = torch.nn.NLLLoss()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    owner = SimpleNamespace(module_=module, criterion_=criterion, optimizer_=optimizer)
    callback = SimpleNamespace(lr_scheduler_=scheduler)
    slots = [
        Slot("module_", owner, "module_", "module"),
        Slot("criterion_", owner, "criterion_", "criterion"),
        Slot("optimizer_", owner, "optimizer_", "optimizer"),
        Slot("cb__lr_scheduler_", callback, "lr_scheduler_", "scheduler", step_once=True),
    ]
    return owner, callback, slots


def lengths(accelerator):
    return (len(accelerator._models), len(accelerator._optimizers), len(accelerator._schedulers))


def test_prepare_wraps_every_kind():
    accelerator = Accelerator(cpu=True)
    owner, callback, slots = make_owner()
    raw_optimizer = owner.optimizer_
    prepared = PreparedObjects()
    prepared.prepare(accelerator, slots)

    assert isinstance(owner.optimizer_, AcceleratedOptimizer)
    assert owner.optimizer_.optimizer is raw_optimizer
    assert isinstance(callback.lr_scheduler_, AcceleratedScheduler)
    assert prepared.wrapped
    assert lengths(accelerator) == (2, 1, 1)


def test_prepare_twice_prepares_once(monkeypatch):
    accelerator = Accelerator(cpu=True)
    owner, callback, slots = make_owner()
    calls = []
    for name in ("prepare_model", "prepare_optimizer", "prepare_scheduler"):
        original = getattr(accelerator, name)
        monkeypatch.setattr(
            accelerator,
            name,
            lambda *a, _orig=original, _name=name, **kw: calls.append(_name) or _orig(*a, **kw),
        )
    prepared = PreparedObjects()
    prepared.prepare(accelerator, slots)
    first = (owner.module_, owner.optimizer_, callback.lr_scheduler_)
    assert len(calls) == 4

    prepared.unwrap()
    prepared.prepare(accelerator, slots)
    prepared.prepare(accelerator, slots)
    assert len(calls) == 4
    assert (owner.module_, owner.optimizer_, callback.lr_scheduler_) == first
    assert lengths(accelerator) == (2, 1, 1)


def test_unwrap_and_wrap_only_swap():
    accelerator = Accelerator(cpu=True)
    owner, callback, slots = make_owner()
    raw = (owner.module_, owner.optimizer_, callback.lr_scheduler_)
    prepared = PreparedObjects()
    prepared.prepare(accelerator, slots)
    wrapped = (owner.module_, owner.optimizer_, callback.lr_scheduler_)

    for _ in range(3):
        prepared.unwrap()
        assert (owner.module_, owner.optimizer_, callback.lr_scheduler_) == raw
        assert lengths(accelerator) == (0, 0, 0)
        prepared.wrap(accelerator)
        assert all(
            a is b
            for a, b in zip((owner.module_, owner.optimizer_, callback.lr_scheduler_), wrapped)
        )
        assert lengths(accelerator) == (2, 1, 1)


def test_autocast_patch_is_stashed_while_unwrapped():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    owner, _, slots = make_owner()
    prepared = PreparedObjects()
    prepared.prepare(accelerator, slots)
    module = owner.module_
    x = torch.randn(4, 3)
    assert "_original_forward" in vars(module)
    assert module(x).dtype == torch.float32  # autocast, then back to fp32

    prepared.unwrap()
    assert "forward" not in vars(module)
    pickle.dumps(module)  # the patch is a closure that cannot be pickled

    prepared.wrap(accelerator)
    assert "_original_forward" in vars(module)
    seen = []
    hook = module[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    module(x)
    hook.remove()
    assert seen == [torch.bfloat16]


def test_a_new_object_replaces_its_slot():
    accelerator = Accelerator(cpu=True)
    owner, _, slots = make_owner()
    prepared = PreparedObjects()
    prepared.prepare(accelerator, slots)
    old_optimizer = owner.optimizer_

    owner.module_ = torch.nn.Linear(3, 2)
    owner.optimizer_ = torch.optim.SGD(owner.module_.parameters(), lr=0.1)
    prepared.prepare(accelerator, slots)

    assert owner.optimizer_ is not old_optimizer
    assert not any(o is old_optimizer for o in accelerator._optimizers)
    assert lengths(accelerator) == (2, 1, 1)


def test_slots_that_disappear_are_released():
    accelerator = Accelerator(cpu=True)
    _, _, slots = make_owner()
    prepared = PreparedObjects()
    prepared.prepare(accelerator, slots)
    prepared.prepare(accelerator, slots[:3])
    assert lengths(accelerator) == (2, 1, 0)


def test_garbage_collected_registry_releases_the_lists():
    accelerator = Accelerator(cpu=True)
    _, _, slots = make_owner()
    prepared = PreparedObjects()
    prepared.prepare(accelerator, slots)
    assert lengths(accelerator) == (2, 1, 1)
    del prepared, slots
    gc.collect()
    assert lengths(accelerator) == (0, 0, 0)


def test_module_without_trainable_parameters_skips_ddp(monkeypatch):
    accelerator = Accelerator(cpu=True)
    _, _, slots = make_owner()
    modes = {}
    original = accelerator.prepare_model

    def recording(model, *args, evaluation_mode=False, **kwargs):
        modes[type(model).__name__] = evaluation_mode
        return original(model, *args, evaluation_mode=evaluation_mode, **kwargs)

    monkeypatch.setattr(accelerator, "prepare_model", recording)
    PreparedObjects().prepare(accelerator, slots)
    assert modes == {"Sequential": False, "NLLLoss": True}


def test_stale_marks_do_not_skip_preparation():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    owner, _, slots = make_owner()
    # e.g. a module copied from another net while it was prepared
    owner.module_._is_accelerate_prepared = True
    PreparedObjects().prepare(accelerator, slots[:1])
    assert "_original_forward" in vars(owner.module_)


@pytest.mark.filterwarnings("ignore:Detected call of .lr_scheduler.step")
@pytest.mark.parametrize("step_once", [True, False])
def test_schedulers_step_once_per_call_when_asked(step_once):
    """An epoch's scheduler steps once per call, also where the optimizers
    did not step (inside a window of accumulation); a batch's waits for
    them. What this does in several processes: test_multiprocess.py."""
    accelerator = Accelerator(cpu=True)
    _, callback, slots = make_owner()
    slots[3] = slots[3]._replace(step_once=step_once)
    PreparedObjects().prepare(accelerator, slots)
    scheduler = callback.lr_scheduler_
    accelerator.gradient_state._set_sync_gradients(False)  # pylint: disable=protected-access
    try:
        before = scheduler.scheduler.last_epoch
        scheduler.step()
        assert scheduler.scheduler.last_epoch == before + step_once
    finally:
        accelerator.gradient_state._set_sync_gradients(True)  # pylint: disable=protected-access


def test_plateau_scheduler_still_passes_for_one():
    accelerator = Accelerator(cpu=True)
    owner, callback, slots = make_owner()
    callback.lr_scheduler_ = torch.optim.lr_scheduler.ReduceLROnPlateau(
        owner.optimizer_, patience=0, factor=0.5
    )
    slots[3] = slots[3]._replace(step_once=False)
    prepared = PreparedObjects()
    prepared.prepare(accelerator, slots)
    scheduler = callback.lr_scheduler_
    assert isinstance(scheduler, AcceleratedScheduler)
    assert isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    # the accelerator saves and rewraps the scheduler the net steps
    assert accelerator._schedulers == [scheduler]
    prepared.unwrap()
    prepared.wrap(accelerator)
    assert callback.lr_scheduler_ is scheduler
    assert accelerator._schedulers == [scheduler]
    for _ in range(3):
        scheduler.step(1.0)  # no improvement after the first
    assert owner.optimizer_.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_wrap_leaves_emptied_slots_alone():
    accelerator = Accelerator(cpu=True)
    owner, _, slots = make_owner()
    prepared = PreparedObjects()
    prepared.prepare(accelerator, slots)
    prepared.unwrap()
    owner.optimizer_ = None  # as trim_for_prediction does
    prepared.wrap(accelerator)
    assert owner.optimizer_ is None
    assert lengths(accelerator) == (2, 0, 1)


def test_compiled_module_is_stripped_of_every_mark():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    owner, _, slots = make_owner()
    owner.module_ = torch.compile(owner.module_, backend="eager")
    compiled_forward = vars(owner.module_)["forward"]  # torch.compile's own
    prepared = PreparedObjects()
    prepared.prepare(accelerator, slots[:1])
    assert vars(owner.module_)["forward"] is not compiled_forward
    prepared.unwrap()
    assert vars(owner.module_)["forward"] is compiled_forward
    for target in (owner.module_, owner.module_._orig_mod):
        assert not set(vars(target)) & {"_original_forward", "_is_accelerate_prepared"}
    assert "forward" not in vars(owner.module_._orig_mod)
    pickle.dumps(owner.module_)
    prepared.wrap(accelerator)
    assert vars(owner.module_)["forward"] is not compiled_forward


def test_requires_closure():
    params = [torch.nn.Parameter(torch.zeros(1))]
    assert requires_closure(torch.optim.LBFGS(params))
    assert not requires_closure(torch.optim.SGD(params, lr=0.1))
    assert not requires_closure(torch.optim.Adam(params))
