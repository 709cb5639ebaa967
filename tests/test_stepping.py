"""Stepper does what accelerate's calls do, in the plain case and otherwise.

Every configuration its plain path covers is trained through it and through
accelerate's calls, which must give the same weights bit for bit (in one
process here, in two through ``launched/stepping_check.py``); every
configuration it does not cover must send each call through accelerate.
"""

import contextlib
import copy
import functools

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from common import MLP, AcceleratedNet
from harness import run_processes
from skorch.callbacks import Callback, GradientNormClipping
from stepping_check import CONFIGURATIONS, compare

from accel_mixin.stepping import COVERED_TYPES, Stepper

ACCELERATOR_CALLS = ("accumulate", "autocast", "backward")
OPTIMIZER_CALLS = ("step", "zero_grad")
# each call of a training step, in order, where all go through accelerate;
# zero_grad skips accelerate's in every configuration (stepping.py says why)
THROUGH_ACCELERATE = [*ACCELERATOR_CALLS, "step"]


def model_and_optimizer(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


def test_without_accumulation_every_step_syncs():
    accelerator = Accelerator(cpu=True)
    accelerator.gradient_state._set_sync_gradients(False)
    stepper = Stepper(accelerator)
    assert stepper.plain and stepper.sync_gradients
    with stepper.accumulate(lambda: pytest.fail("modules are not needed")):
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
    torch.testing.assert_close(model.state_dict()["weight"], before["weight"])


def test_autocast_follows_the_precision():
    stepper = Stepper(Accelerator(cpu=True, mixed_precision="bf16"))
    with stepper.autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
    from conftest import reset_accelerate

    reset_accelerate()
    with Stepper(Accelerator(cpu=True)).autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32


def test_zero_grad_passes_set_to_none():
    accelerator = Accelerator(cpu=True)
    model, optimizer = model_and_optimizer(accelerator)
    stepper = Stepper(accelerator)
    model(torch.ones(1, 4)).sum().backward()
    stepper.zero_grad(optimizer, set_to_none=False)
    assert torch.equal(model.weight.grad, torch.zeros_like(model.weight))
    stepper.zero_grad(optimizer)
    assert model.weight.grad is None


@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])  # fp16: no scaler on the CPU
@pytest.mark.parametrize(
    "plugin",
    [
        dict(num_steps=1),
        dict(num_steps=3),
        dict(num_steps=3, sync_with_dataloader=False),
    ],
    ids=["accum1", "accum3", "accum3-no_sync_with_dataloader"],
)
def test_one_process_matches_accelerate_bit_for_bit(mixed_precision, plugin):
    result = compare(mixed_precision=mixed_precision, **plugin)
    assert result["plain"] and result["moved"]
    assert result["equal"], result["max_difference"]


@pytest.fixture(scope="module")
def two_processes():
    """One launch for every 2-process configuration: each costs seconds to start."""
    return run_processes("stepping_check.py", timeout=120).check()


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_two_processes_match_accelerate_bit_for_bit(two_processes, name):
    results = [rank["configurations"][name] for rank in two_processes]
    expected_type = CONFIGURATIONS[name]["relabel"] or DistributedType.MULTI_CPU
    for result in results:
        assert result["plain"] and result["moved"]
        assert result["distributed_type"] == expected_type.value
        assert result["equal"], result["max_difference"]
    assert results[0]["digest"] == results[1]["digest"]  # DDP kept the ranks in step


@pytest.fixture
def accelerate_calls(monkeypatch):
    """accelerate's per-batch methods, replaced on their classes by recorders
    of their names. On the classes, so that the Stepper still sees them as
    accelerate's own."""
    return recorded_calls(monkeypatch, make_them=False)


@pytest.fixture
def accelerate_calls_made(monkeypatch):
    """The names of accelerate's per-batch methods called, in order; unlike
    ``accelerate_calls``, each call is then made."""
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


def one_step(stepper, model, optimizer):
    """A training step, as the mixin makes it."""
    with stepper.accumulate(lambda: [model]):
        with stepper.autocast():
            loss = model(torch.ones(1, 4)).sum()
        stepper.backward(loss)
        stepper.step_all([optimizer])
        stepper.zero_grad(optimizer)


def fallback_calls(accelerator, calls, after_prepare=lambda: None):
    """The calls one step made through accelerate; fails if the Stepper is plain."""
    model, optimizer = model_and_optimizer(accelerator)
    after_prepare()
    stepper = Stepper(accelerator)
    assert not stepper.plain
    one_step(stepper, model, optimizer)
    return calls


def test_the_plain_path_makes_none_of_the_calls(accelerate_calls):
    accelerator = Accelerator(cpu=True)
    model, optimizer = model_and_optimizer(accelerator)
    stepper = Stepper(accelerator)
    assert stepper.plain
    one_step(stepper, model, optimizer)
    assert accelerate_calls == []


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
    # the Stepper leaves the scaler to accelerate's calls
    assert accelerate_calls_made == THROUGH_ACCELERATE
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


@pytest.mark.parametrize("distributed_type", sorted(set(DistributedType) - COVERED_TYPES))
def test_an_uncovered_distributed_type_falls_back(accelerate_calls, monkeypatch, distributed_type):
    accelerator = Accelerator(cpu=True)

    def relabel():  # after prepare, which would prepare for that type
        for state in (PartialState(), accelerator.state):
            monkeypatch.setattr(state, "distributed_type", distributed_type)

    assert fallback_calls(accelerator, accelerate_calls, relabel) == THROUGH_ACCELERATE


def test_fp8_falls_back(accelerate_calls, monkeypatch):
    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(accelerator.state, "_mixed_precision", "fp8")
    assert fallback_calls(accelerator, accelerate_calls) == THROUGH_ACCELERATE


def test_a_lomo_optimizer_falls_back(accelerate_calls, monkeypatch):
    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(accelerator, "has_lomo_optimizer", True)  # as prepare sets it
    assert fallback_calls(accelerator, accelerate_calls) == THROUGH_ACCELERATE


@pytest.mark.parametrize("name", ACCELERATOR_CALLS)
def test_an_accelerator_subclass_overriding_a_call_falls_back(accelerate_calls, name):
    def override(self, *args, **kwargs):
        return getattr(Accelerator, name)(self, *args, **kwargs)

    accelerator = type("CustomAccelerator", (Accelerator,), {name: override})(cpu=True)
    assert fallback_calls(accelerator, accelerate_calls) == THROUGH_ACCELERATE


@pytest.mark.parametrize("name", ACCELERATOR_CALLS)
def test_a_call_replaced_on_the_accelerator_falls_back(accelerate_calls, monkeypatch, name):
    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(
        accelerator, name, functools.partial(getattr(Accelerator, name), accelerator)
    )
    assert fallback_calls(accelerator, accelerate_calls) == THROUGH_ACCELERATE


@pytest.mark.parametrize("name", OPTIMIZER_CALLS)
def test_an_optimizer_call_replaced_on_the_instance_is_made(accelerate_calls, monkeypatch, name):
    accelerator = Accelerator(cpu=True)
    model, optimizer = model_and_optimizer(accelerator)
    monkeypatch.setattr(
        optimizer, name, functools.partial(getattr(AcceleratedOptimizer, name), optimizer)
    )
    stepper = Stepper(accelerator)
    assert stepper.plain  # the other optimizers keep the plain path
    one_step(stepper, model, optimizer)
    assert accelerate_calls == [name]  # the replaced call, made; the other skipped


def test_a_zero_grad_of_its_own_gets_skorchs_arguments_as_in_plain_skorch():
    class KeepsGradients(torch.optim.SGD):
        def zero_grad(self, set_to_none=False):
            super().zero_grad(set_to_none=set_to_none)

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, KeepsGradients(model.parameters(), lr=0.1))
    model(torch.ones(1, 4)).sum().backward()
    Stepper(accelerator).zero_grad(optimizer)
    # the optimizer's own default, as optimizer.zero_grad() in plain skorch;
    # accelerate's zero_grad would pass set_to_none=True
    assert torch.equal(model.weight.grad, torch.zeros_like(model.weight))
