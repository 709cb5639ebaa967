"""AccelerateMixin in one process.

Tests parametrized with ``NETS`` also run against skorch.hf.AccelerateMixin,
marked as a strict expected failure where it has the defect in question: if
the incumbent ever passed, the test would fail.
"""

import inspect

import pytest
import torch
from accelerate import Accelerator
from common import AcceleratedNet, IncumbentNet
from skorch import NeuralNetClassifier

from accel_mixin.callbacks import TrainingCheckpoint


def incumbent(reason):
    return pytest.param(
        IncumbentNet, marks=pytest.mark.xfail(strict=True, reason=reason), id="incumbent"
    )


def ours():
    return pytest.param(AcceleratedNet, id="ours")


def make_net(Net, mlp, accelerator=None, **kwargs):
    params = dict(max_epochs=2, lr=0.1, batch_size=32, verbose=0)
    params.update(kwargs)
    return Net(mlp, accelerator=accelerator or Accelerator(cpu=True), **params)


def lengths(accelerator):
    return tuple(
        len(getattr(accelerator, name))
        for name in ("_models", "_optimizers", "_schedulers", "_dataloaders")
    )


# --- construction and initialization ---------------------------------------


def test_device_must_be_left_to_the_accelerator(mlp):
    net = AcceleratedNet(mlp, accelerator=Accelerator(cpu=True), device="cpu")
    with pytest.raises(ValueError, match="set device=None"):
        net.initialize()


@pytest.mark.parametrize("Net", [ours(), incumbent("torch's CUDA assertion, from to_device")])
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("mps")])
def test_any_device_gets_the_message_before_anything_moves(Net, device, mlp):
    """On a machine without CUDA, device='cuda' failed inside skorch's
    to_device with "Torch not compiled with CUDA enabled"."""
    net = Net(mlp, accelerator=Accelerator(cpu=True), device=device, verbose=0)
    with pytest.raises(ValueError, match=r"device=.* was given.*set device=None"):
        net.initialize()
    assert not hasattr(net, "module_")  # raised before skorch built and moved it


def test_a_device_is_taken_where_the_user_places_the_net(mlp, data):
    accelerator = Accelerator(cpu=True, device_placement=False)
    net = AcceleratedNet(mlp, accelerator=accelerator, device="cpu", max_epochs=1, verbose=0)
    assert net.fit(*data).device == "cpu"


def test_fsdp_asked_for_in_one_process_on_cpu_is_refused(mlp, monkeypatch):
    """The plugin sets ACCELERATE_USE_FSDP in the environment, put back after
    the test; accelerate selects no FSDP in one CPU process."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    # FSDP2 where this accelerate has it (1.6 and later), else FSDP: either is refused
    fields = inspect.signature(FullyShardedDataParallelPlugin).parameters
    plugin = FullyShardedDataParallelPlugin(
        **({"fsdp_version": 2} if "fsdp_version" in fields else {})
    )
    net = make_net(AcceleratedNet, mlp, accelerator=Accelerator(cpu=True, fsdp_plugin=plugin))
    with pytest.raises(
        ValueError, match=r"FSDP was asked for .* distributed_type=DistributedType.NO on 1 "
    ):
        net.initialize()


def test_closure_optimizer_trains_as_in_skorch(mlp, data):
    kwargs = dict(optimizer=torch.optim.LBFGS, lr=0.1, batch_size=-1, max_epochs=3)
    torch.manual_seed(0)
    ours = make_net(AcceleratedNet, mlp, **kwargs).fit(*data)
    torch.manual_seed(0)
    plain = NeuralNetClassifier(mlp, verbose=0, **kwargs).fit(*data)
    assert ours.history[:, "train_loss"] == pytest.approx(plain.history[:, "train_loss"], rel=1e-5)


def test_closure_optimizer_is_refused_with_accumulation(mlp):
    net = make_net(
        AcceleratedNet,
        mlp,
        optimizer=torch.optim.LBFGS,
        accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2),
    )
    with pytest.raises(ValueError, match=r"optimizer_ \(LBFGS\) needs a closure"):
        net.initialize()


def test_a_net_trimmed_for_prediction_cannot_train_as_in_skorch(mlp, data):
    from skorch.exceptions import SkorchTrainingImpossibleError

    net = make_net(AcceleratedNet, mlp).fit(*data)
    net.trim_for_prediction()
    with pytest.raises(SkorchTrainingImpossibleError, match="trimmed for prediction"):
        net.partial_fit(*data)


def test_the_optimizer_sees_the_zero_grad_calls_of_skorch(mlp, data):
    # a train_step that accumulates by hand counts its own zero_grad calls,
    # as in skorch's test_gradient_accumulation
    calls = {}
    for Net in (AcceleratedNet, NeuralNetClassifier):
        counted = []

        class Counting(Net):
            def initialize_optimizer(self, *args, **kwargs):
                super().initialize_optimizer(*args, **kwargs)
                original = self.optimizer_.zero_grad
                # the class is built and fitted within its iteration
                self.optimizer_.zero_grad = lambda *a, **k: (
                    counted.append(1),  # noqa: B023
                    original(*a, **k),
                )
                return self

            def train_step(self, batch, **fit_params):
                return self.train_step_single(batch, **fit_params)

        extra = {"accelerator": Accelerator(cpu=True)} if Net is AcceleratedNet else {}
        Counting(mlp, verbose=0, max_epochs=2, **extra).fit(*data)
        calls[Net.__name__] = len(counted)
    assert calls["AcceleratedNet"] == calls["NeuralNetClassifier"] == 0


def test_a_compiled_nll_loss_still_gets_the_classifiers_log(mlp, data):
    # skorch 1.4.0 compiles NLLLoss too; NeuralNetClassifier.get_loss then no
    # longer recognises it, skips the log and trains on -p (negative losses)
    kwargs = dict(max_epochs=2, lr=0.1, compile=True, compile__backend="eager")
    torch.manual_seed(0)
    ours = make_net(AcceleratedNet, mlp, **kwargs).fit(*data)
    torch.manual_seed(0)
    eager = NeuralNetClassifier(mlp, verbose=0, max_epochs=2, lr=0.1, batch_size=32).fit(*data)
    # compiled, as skorch's own tests require
    assert type(ours.criterion_).__name__ == "OptimizedModule"
    assert type(ours.module_).__name__ == "OptimizedModule"
    assert ours.history[:, "train_loss"] == pytest.approx(eager.history[:, "train_loss"], rel=1e-5)


def test_a_get_iterator_override_that_bypasses_the_mixin_is_named(data, mlp, tmp_path):
    # the training DataLoader never reaches the mixin: nothing prepares it, and
    # a training state could not record its order
    class Bypassing(AcceleratedNet):
        def get_iterator(self, dataset, training=False):
            return NeuralNetClassifier.get_iterator(self, dataset, training=training)

    net = make_net(Bypassing, mlp, callbacks=[TrainingCheckpoint(tmp_path, every_n_batches=2)])
    with pytest.raises(TypeError, match=r"must return super\(\)\.get_iterator"):
        net.fit(*data)
