"""What the mixin adds to skorch's training step (``stepping.Stepper``).

skorch's own step runs with accelerate's optimizers; these tests check what
the Stepper adds around it: accumulation, autocast, the backward that
decides whether skorch's ``train_step_single`` can run, one gradient scaler
update for several optimizers, and a real gradient scaler through the mixin.
"""

import contextlib
import functools

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from common import MLP, AcceleratedNet
from skorch.callbacks import Callback, GradientNormClipping

from accel_mixin.training.stepping import Stepper, plain_backward

ACCELERATOR_CALLS = ("accumulate", "autocast", "backward")
OPTIMIZER_CALLS = ("step", "zero_grad")
# each call of a training step with a gradient scaler, in order: skorch's
# zeroing, accelerate's backward (which scales the loss), the step
WITH_A_SCALER = ["zero_grad", "backward", "step"]


def model_and_optimizer(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


def test_without_accumulation_the_window_is_a_no_op():
    stepper = Stepper(Accelerator(cpu=True))
    with stepper.accumulate(lambda: pytest.fail("modules are not needed")):
        pass
    with stepper.step_window(closures=False):
        assert not stepper.deferring  # skorch zeroes before the forward pass


def test_accumulation_defers_zeroing_and_skips_steps_until_sync():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = model_and_optimizer(accelerator)
    stepper = Stepper(accelerator)
    before = model.weight.detach().clone()
    with stepper.accumulate(lambda: [model]), stepper.step_window(closures=False):
        assert stepper.deferring
        accelerator.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
    assert not stepper.deferring and not stepper.sync_gradients
    assert model.weight.grad is not None  # kept for the next batch
    assert torch.equal(model.weight, before)


def test_plain_backward_only_without_accumulation_and_scaler():
    assert plain_backward(Accelerator(cpu=True))
    from conftest import reset_accelerate

    reset_accelerate()
    assert not plain_backward(Accelerator(cpu=True, gradient_accumulation_steps=2))
    reset_accelerate()
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu")
    assert not plain_backward(accelerator)


def test_autocast_follows_the_precision():
    stepper = Stepper(Accelerator(cpu=True, mixed_precision="bf16"))
    with stepper.autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
    from conftest import reset_accelerate

    reset_accelerate()
    with Stepper(Accelerator(cpu=True)).autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32


def test_several_optimizers_update_the_scaler_once():
    accelerator = Accelerator(cpu=True)
    scaler = accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    first, second, opt1, opt2 = accelerator.prepare(
        first,
        second,
        torch.optim.SGD(first.parameters(), lr=0.1),
        torch.optim.SGD(second.parameters(), lr=0.1),
    )
    accelerator.backward((first(torch.ones(1, 4)) + second(torch.ones(1, 4))).sum())
    stepper = Stepper(accelerator)
    with stepper.step_window(closures=False):
        stepper.unscale([opt1, opt2])
        stepper.unscale([opt1, opt2])  # once per step: a second call does nothing
        with stepper.one_scaler_update([opt1, opt2]):
            opt1.step()
            opt2.step()  # accelerate's update after opt1 would unscale opt2 again
    assert scaler.get_scale() == 8.0  # one update, after a finite step
    assert "update" not in vars(scaler)
    assert opt1.scaler is scaler and opt2.scaler is scaler


@pytest.fixture
def accelerate_calls_made(monkeypatch):
    """The names of accelerate's per-batch methods called, in order; each
    call is then made."""
    return recorded_calls(monkeypatch, make_them=True)


def recorded_calls(monkeypatch, make_them):
    calls = []

    def recorder(cls, name):
        method = getattr(cls, name)

        @functools.wraps(method)
        def record(*args, **kwargs):
            calls.append(name)
            return method(*args, **kwargs) if make_them else contextlib.nullcontext()

        return record

    for cls, names in ((Accelerator, ACCELERATOR_CALLS), (AcceleratedOptimizer, OPTIMIZER_CALLS)):
        for name in names:
            monkeypatch.setattr(cls, name, recorder(cls, name))
    return calls


# --- a real gradient scaler ---------------------------------------------------
# accelerate builds a GradScaler for fp16 on GPUs only; torch's CPU GradScaler
# on an fp32 accelerator takes the same paths through accelerate and the
# mixin (as in launched/matrix.py). Its scale is a power of two, so scaling
# the loss and unscaling the gradients are exact: a net with the scaler must
# step exactly as one without.

SCALE = 2.0**10
CLIP = 0.05  # below the gradients' norm: clipping scaled gradients would show


class Gradients(Callback):
    """The weights a fit starts from, and the gradients of its step: as
    backward computed them (hooks on the parameters, before anything
    unscales them) and as ``on_grad_computed`` shows them, before clipping."""

    def on_train_begin(self, net, **kwargs):
        self.start_ = [p.detach().clone() for p in net.module_.parameters()]
        self.computed_, self.notified_ = [], []
        for param in net.module_.parameters():
            param.register_hook(lambda grad: self.computed_.append(grad.clone()))

    def on_grad_computed(self, net, named_parameters, **kwargs):
        self.notified_ = [p.grad.clone() for _, p in named_parameters]


def fit_one_step(X, y, scaler=None):
    """One step on all of ``X``, clipped to ``CLIP``: the net and its ``Gradients``."""
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = scaler  # before prepare: the optimizer takes it then
    gradients = Gradients()
    torch.manual_seed(0)
    net = AcceleratedNet(
        MLP,
        accelerator=accelerator,
        max_epochs=1,
        lr=0.5,
        batch_size=len(X),
        train_split=None,
        verbose=0,
        callbacks=[gradients, GradientNormClipping(gradient_clip_value=CLIP)],
    )
    net.fit(X, y)
    return net, gradients


def test_a_gradient_scaler_scales_the_loss_and_steps_with_the_true_gradients(
    data, accelerate_calls_made
):
    X, y = data[0][:32], data[1][:32]
    fp32, fp32_gradients = fit_one_step(X, y)
    accelerate_calls_made.clear()
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
    scaled, gradients = fit_one_step(X, y, scaler)
    # skorch's calls, and accelerate's backward, which scales the loss
    assert accelerate_calls_made == WITH_A_SCALER
    # backward ran on the scaled loss ...
    assert len(gradients.computed_) == len(fp32_gradients.computed_) == 4
    for grad, true in zip(gradients.computed_, fp32_gradients.computed_):
        assert torch.equal(grad, SCALE * true)
    # ... and clipping saw, and the optimizer stepped with, the true gradients
    assert float(torch.cat([g.flatten() for g in fp32_gradients.notified_]).norm()) > 10 * CLIP
    for grad, true in zip(gradients.notified_, fp32_gradients.notified_):
        assert torch.equal(grad, true)
    for before, fp32_before in zip(gradients.start_, fp32_gradients.start_):
        assert torch.equal(before, fp32_before)
    for param, fp32_param, before in zip(
        scaled.module_.parameters(), fp32.module_.parameters(), gradients.start_
    ):
        assert torch.equal(param, fp32_param) and not torch.equal(param, before)
    assert scaler.get_scale() == 2 * SCALE  # a step without infs: the scaler updated


def test_a_gradient_scaler_skips_a_step_with_infinite_gradients_and_backs_off(data):
    X, y = data[0][:32].copy(), data[1][:32]
    X[0, 0] = float("inf")  # gradients of inf and nan, as an fp16 overflow gives
    fp32, _ = fit_one_step(X, y)
    assert all(p.isnan().any() for p in fp32.module_.parameters())  # stepped on them
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, backoff_factor=0.25)
    scaled, gradients = fit_one_step(X, y, scaler)
    assert not all(g.isfinite().all() for g in gradients.computed_)
    for param, before in zip(scaled.module_.parameters(), gradients.start_):
        assert torch.equal(param, before)  # the step was skipped
    assert scaler.get_scale() == 0.25 * SCALE
