"""A user's net class under the mixin: every override of it runs.

Usage: torchrun --nproc_per_node N overrides.py (N = 1 or 2)

``class Net(AccelerateMixin, Base)``, where ``Base`` is the user's own
subclass of a skorch net: every skorch method that the mixin (or a class it
mixes in) defines is overridden on ``Base`` by a recorder that notes its
name and calls ``super()``. The methods are enumerated from the classes
themselves, so a method the mixin adds later is covered. Beside it, the
overrides users write: ``get_all_learnable_params`` (train the last layer
only), ``run_single_epoch`` (records a value), and a GAN-like ``train_step``
with two optimizers, on the base class and on the final class.
"""

import pickle
import sys

import numpy as np
import torch
from common import MLP, Checks, make_accelerator, make_data, report
from skorch import NeuralNetClassifier, NeuralNetRegressor
from skorch.dataset import unpack_data
from skorch.net import NeuralNet

from accel_mixin import AccelerateMixin


def mixin_methods():
    """The names of NeuralNet's methods that the mixin's classes define."""
    names = set()
    for cls in AccelerateMixin.__mro__:
        if cls is object:
            continue
        for name, value in vars(cls).items():
            if callable(value) and hasattr(NeuralNet, name):
                names.add(name)
    return sorted(names)


CALLS = []


def recording_class(names):
    """A user's net class whose methods ``names`` note their call in
    ``CALLS`` and call ``super()``."""
    cls = type("Recording", (NeuralNetClassifier,), {})

    def recorder(name):
        def method(self, *args, **kwargs):
            CALLS.append(name)
            return getattr(super(cls, self), name)(*args, **kwargs)

        method.__name__ = name
        return method

    for name in names:
        setattr(cls, name, recorder(name))
    return cls


Recording = recording_class(mixin_methods())


class RecordingNet(AccelerateMixin, Recording):
    pass


def workflow(Net, accelerator, tmp):
    """What users do with a net: every recorded method gets called."""
    X, y = make_data(200)
    torch.manual_seed(0)
    net = Net(MLP, accelerator=accelerator, max_epochs=2, lr=0.1, batch_size=32)
    net.fit(X, y)
    net.predict_proba(X)
    net.score(X, y)
    files = dict(f_params=f"{tmp}/p.pt", f_optimizer=f"{tmp}/o.pt", f_history=f"{tmp}/h.json")
    net.save_params(**files)
    net.load_params(**files)
    net = pickle.loads(pickle.dumps(net))
    net.partial_fit(X, y)
    return net


checks = Checks()


@checks
def every_override_runs():
    """The recorded methods called in a workflow, each once at least."""
    tmp = sys.argv[1]
    CALLS.clear()
    workflow(RecordingNet, make_accelerator(), tmp)
    return {"enumerated": mixin_methods(), "called": sorted(set(CALLS))}


# --- get_all_learnable_params: the last layer only ---------------------------


class LastLayer(NeuralNetClassifier):
    def get_all_learnable_params(self):
        for name, param in self.module_.named_parameters():
            if name.startswith("out."):
                yield name, param


class LastLayerNet(AccelerateMixin, LastLayer):
    pass


@checks
def last_layer_only():
    X, y = make_data(200)
    torch.manual_seed(0)
    net = LastLayerNet(MLP, accelerator=make_accelerator(), max_epochs=2, lr=0.5, verbose=0)
    net.initialize()
    module = getattr(net.module_, "module", net.module_)  # DDP's, on two processes
    hidden = module.hidden.weight.detach().clone()
    out = module.out.weight.detach().clone()
    net.partial_fit(X, y)
    return {
        "optimizer_params": sum(len(g["params"]) for g in net.optimizer_.param_groups),
        "hidden_changed": not torch.equal(net.module_.hidden.weight, hidden),
        "out_changed": not torch.equal(net.module_.out.weight, out),
    }


# --- run_single_epoch -----------------------------------------------------------


class CountsEpochs(NeuralNetClassifier):
    def run_single_epoch(self, iterator, training, prefix, step_fn, **fit_params):
        # what users read of the DataLoader they are given
        self.history.record(prefix + "_seen", len(iterator) > 0 and iterator.dataset is not None)
        return super().run_single_epoch(iterator, training, prefix, step_fn, **fit_params)


class CountsEpochsNet(AccelerateMixin, CountsEpochs):
    pass


@checks
def run_single_epoch_override():
    X, y = make_data(200)
    net = CountsEpochsNet(MLP, accelerator=make_accelerator(), max_epochs=2, verbose=0)
    net.fit(X, y)
    return {"rows": [[row.get("train_seen"), row.get("valid_seen")] for row in net.history]}


# --- a GAN-like train_step with two optimizers ------------------------------


class Critic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(20, 1)

    def forward(self, X):
        return self.lin(X)


def gan_step(self, batch, **fit_params):
    """Two losses, two optimizers, a record of the batch of its own."""
    self._set_training(True)
    Xi, yi = unpack_data(batch)
    self.optimizer_critic_.zero_grad()
    loss_d = torch.nn.functional.mse_loss(self.critic_(Xi).squeeze(-1), yi)
    loss_d.backward()
    self.optimizer_critic_.step()
    self.optimizer_.zero_grad()
    y_pred = self.infer(Xi)
    loss = self.get_loss(y_pred, yi, X=Xi, training=True)
    loss.backward()
    self.optimizer_.step()
    self.history.record_batch("loss_d", loss_d.item())
    return {"loss": loss, "y_pred": y_pred}


class TwoOptimizers(NeuralNetRegressor):
    def initialize_module(self):
        super().initialize_module()
        self.critic_ = Critic()
        return self

    def initialize_optimizer(self, *args, **kwargs):
        super().initialize_optimizer(*args, **kwargs)
        self.optimizer_critic_ = torch.optim.SGD(self.critic_.parameters(), lr=0.05)
        return self

    def get_all_learnable_params(self):
        return self.module_.named_parameters()


class GanBase(TwoOptimizers):
    train_step = gan_step


class GanBelowNet(AccelerateMixin, GanBase):
    """The user's train_step on their own class, under the mixin."""


class GanTopNet(AccelerateMixin, TwoOptimizers):
    """The same code on the final class, above the mixin."""

    train_step = gan_step


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(20, 1)

    def forward(self, X):
        return self.lin(X).squeeze(-1)


def fit_gan(Net):
    X, y = make_data(256)
    torch.manual_seed(0)
    net = Net(
        Regressor,
        accelerator=make_accelerator(),
        max_epochs=2,
        lr=0.05,
        batch_size=32,
        train_split=None,
        verbose=0,
    )
    net.fit(X, y.astype(np.float32))
    weights = [p.detach().numpy().tolist() for p in net.module_.parameters()]
    weights += [p.detach().numpy().tolist() for p in net.critic_.parameters()]
    loss_d = net.history[:, "batches", :, "loss_d"]
    return {"weights": weights, "loss_d": loss_d, "train_loss": net.history[:, "train_loss"]}


@checks
def gan_below_and_on_top():
    return {"below": fit_gan(GanBelowNet), "top": fit_gan(GanTopNet)}


# --- train_step_single under accumulation: refused clearly ------------------


class OwnSingleStep(NeuralNetClassifier):
    def train_step_single(self, batch, **fit_params):
        return super().train_step_single(batch, **fit_params)


class OwnSingleStepNet(AccelerateMixin, OwnSingleStep):
    pass


@checks
def train_step_single_with_accumulation():
    net = OwnSingleStepNet(MLP, accelerator=make_accelerator(gradient_accumulation_steps=2))
    try:
        net.initialize()
    except ValueError as exc:
        return str(exc)
    return None


# the recorders' workflow with accumulation: everything but train_step_single
# runs (which then goes through accelerate's backward, refused above)


class RecordingAccumulatingNet(
    AccelerateMixin,
    recording_class([name for name in mixin_methods() if name != "train_step_single"]),
):
    pass


@checks
def every_other_override_runs_with_accumulation():
    CALLS.clear()
    workflow(RecordingAccumulatingNet, make_accelerator(gradient_accumulation_steps=2), sys.argv[1])
    return sorted(set(CALLS))


report(checks.results)
