"""Stepper does what accelerate's calls do, in the plain case and otherwise."""
import copy

import pytest
import torch
from accelerate import Accelerator

from accel_mixin.stepping import Stepper


def model_and_optimizer(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


def train(accelerator, use_stepper, batches):
    """Train on ``batches`` with the Stepper or with accelerate's own calls."""
    model, optimizer = model_and_optimizer(accelerator)
    stepper = Stepper(accelerator)
    for X in batches:
        context = (stepper.accumulate(lambda: [model]) if use_stepper
                   else accelerator.accumulate(model))
        with context:
            loss = model(X).pow(2).mean()
            if use_stepper:
                stepper.backward(loss)
                stepper.step(optimizer)
                stepper.zero_grad(optimizer)
            else:
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize('steps', [1, 3])
def test_training_matches_accelerate(steps):
    batches = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=steps)
    ours = train(accelerator, True, batches)
    theirs = train(accelerator, False, batches)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_without_accumulation_every_step_syncs():
    accelerator = Accelerator(cpu=True)
    accelerator.gradient_state._set_sync_gradients(False)
    stepper = Stepper(accelerator)
    assert stepper.plain and stepper.sync_gradients
    with stepper.accumulate(lambda: pytest.fail('modules are not needed')):
        pass


def test_accumulation_skips_steps_and_zeroing_until_sync():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = model_and_optimizer(accelerator)
    stepper = Stepper(accelerator)
    before = copy.deepcopy(model.state_dict())
    with stepper.accumulate(lambda: [model]):
        stepper.backward(model(torch.ones(2, 4)).sum())
        stepper.step(optimizer)
        stepper.zero_grad(optimizer)
    assert not stepper.sync_gradients
    assert model.weight.grad is not None  # kept for the next batch
    torch.testing.assert_close(model.state_dict()['weight'], before['weight'])


def test_autocast_follows_the_precision():
    stepper = Stepper(Accelerator(cpu=True, mixed_precision='bf16'))
    with stepper.autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
    from conftest import reset_accelerate

    reset_accelerate()
    with Stepper(Accelerator(cpu=True)).autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32


def test_a_gradient_scaler_sends_everything_through_accelerate(monkeypatch):
    accelerator = Accelerator(cpu=True)
    model, optimizer = model_and_optimizer(accelerator)
    calls = []
    monkeypatch.setattr(accelerator, 'scaler', object())  # as with fp16 on a GPU
    monkeypatch.setattr(accelerator, 'backward', lambda loss: calls.append('backward'))
    monkeypatch.setattr(optimizer, 'step', lambda: calls.append('step'))
    stepper = Stepper(accelerator)
    assert not stepper.plain
    stepper.backward(model(torch.ones(1, 4)).sum())
    stepper.step(optimizer)
    assert calls == ['backward', 'step']


def test_zero_grad_passes_set_to_none():
    accelerator = Accelerator(cpu=True)
    model, optimizer = model_and_optimizer(accelerator)
    stepper = Stepper(accelerator)
    model(torch.ones(1, 4)).sum().backward()
    stepper.zero_grad(optimizer, set_to_none=False)
    assert torch.equal(model.weight.grad, torch.zeros_like(model.weight))
    stepper.zero_grad(optimizer)
    assert model.weight.grad is None
