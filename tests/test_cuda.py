"""Twins of the suite's tests for the code paths that exist only on CUDA.

The rest of the suite runs on the CPU, where accelerate builds no gradient
scaler for fp16, bf16 autocast is the CPU's, and there is no CUDA random
number generator to save. Here the same features run on a GPU: fp16 with
accelerate's real GradScaler (gradient callbacks must see true gradients),
bf16 autocast on CUDA, exact resume with the CUDA generator and the scaler's
state, and files written on a GPU that load on the CPU.

Every test is marked ``cuda`` and skipped where torch sees no GPU;
``scripts/gpu-check`` runs them on a machine that has one. All run in the
pytest process: each builds its accelerator anew, as a fresh process would.
"""

import warnings

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import GradScalerKwargs
from common import MLP, AcceleratedNet
from conftest import reset_accelerate
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, GradientNormClipping

from accel_mixin.training.rng import restore_rng, rng_state

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = "cuda"
NET_PARAMS = dict(lr=0.1, batch_size=32, verbose=0)


class DropoutMLP(MLP):
    """On the GPU, dropout draws from the CUDA generator: an exact resume
    needs that generator's state, not only the CPU's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, X):
        return torch.softmax(self.out(self.dropout(torch.relu(self.hidden(X)))), dim=-1)


def gpu_accelerator(**kwargs):
    """A new accelerator on the GPU, over a fresh accelerate state."""
    reset_accelerate()
    accelerator = Accelerator(**kwargs)
    assert accelerator.device.type == GPU
    return accelerator


def cpu_accelerator():
    """A new accelerator on the CPU, as on a machine without a GPU."""
    reset_accelerate()
    return Accelerator(cpu=True)


def device_of(net):
    return next(net.module_.parameters()).device.type


def weights(net):
    """The module's weights, copied to the CPU, without wrapper prefixes."""
    module = net.accelerator.unwrap_model(net.module_)
    return {key: value.detach().cpu().clone() for key, value in module.state_dict().items()}


def optimizer_devices(net):
    return {
        value.device.type
        for state in net.optimizer_.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    }


def history(net):
    return [{k: v for k, v in row.items() if k != "dur"} for row in net.history]


def assert_same_weights(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


# --- fp16 with the real GradScaler ---------------------------------------

# Below the true gradient norms of this problem (about 0.5 to 0.7), so that
# clipping acts on every step of the fp32 run: a callback that saw gradients
# scaled by the GradScaler (65536 at first) would clip them 65536 times too
# hard, and the fp16 run would hardly move.
CLIP = 0.25


class GradNorms(Callback):
    """What ``on_grad_computed`` shows: the total gradient norm per batch,
    and whether the optimizer then stepped or skipped (fp16 overflow)."""

    def initialize(self):
        self.norms_, self.skipped_ = [], []
        return self

    def on_grad_computed(self, net, named_parameters, **kwargs):
        norms = [p.grad.detach().float().norm() for _, p in named_parameters if p.grad is not None]
        self.norms_.append(torch.linalg.vector_norm(torch.stack(norms)).item())

    def on_batch_end(self, net, training=None, **kwargs):
        if training:
            self.skipped_.append(net.accelerator.optimizer_step_was_skipped)


def clipped_run(data, mixed_precision):
    """Train with gradient clipping; the gradient norms the callbacks saw,
    and how far the weights moved from their initial values."""
    norms = GradNorms()
    torch.manual_seed(0)
    # the recorder comes before the clipping, to see the gradients it gets
    net = AcceleratedNet(
        MLP,
        accelerator=gpu_accelerator(mixed_precision=mixed_precision),
        max_epochs=10,
        callbacks=[norms, GradientNormClipping(gradient_clip_value=CLIP)],
        **NET_PARAMS,
    )
    net.initialize()
    start = weights(net)
    net.partial_fit(*data)  # fit would initialize again
    end = weights(net)
    moved = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(end[k] - start[k]) for k in start])
    ).item()
    return net, norms, moved


def test_fp16_gradient_callbacks_see_true_gradients(data):
    net32, norms32, moved32 = clipped_run(data, "no")
    net16, norms16, moved16 = clipped_run(data, "fp16")
    assert net32.accelerator.scaler is None
    assert net16.accelerator.scaler is not None  # accelerate's CUDA GradScaler

    steps = len(norms32.norms_)
    assert steps == len(norms16.norms_) == len(norms16.skipped_) == 50
    assert np.mean(np.array(norms32.norms_) > CLIP) > 0.9  # the clipping acts
    # an overflow skips a step, which the comparisons below do not allow for
    assert sum(norms16.skipped_) <= 1, f"{sum(norms16.skipped_)} fp16 steps overflowed"

    stepped = [n for n, skipped in zip(norms16.norms_, norms16.skipped_) if not skipped]
    ratio = np.median(stepped) / np.median(norms32.norms_)
    assert 0.8 < ratio < 1.25, (
        f"on_grad_computed saw fp16 gradient norms {ratio:.4g} times those of fp32 "
        f"(scale {net16.accelerator.scaler.get_scale()}): the gradients were not unscaled"
    )
    assert max(stepped) < 10 * max(norms32.norms_)

    assert abs(moved16 - moved32) / moved32 < 0.05, (moved16, moved32)
    loss32, loss16 = net32.history[:, "train_loss"], net16.history[:, "train_loss"]
    assert loss32[-1] < loss32[0] and loss16[-1] < loss16[0]
    assert abs(loss16[-1] - loss32[-1]) < 0.1 * loss32[-1], (loss16, loss32)


# --- bf16 autocast on CUDA ------------------------------------------------


def predict_and_watch(net, X):
    """predict_proba, and the dtypes the first Linear layer put out meanwhile."""
    seen = set()
    layer = net.accelerator.unwrap_model(net.module_).hidden
    handle = layer.register_forward_hook(lambda module, args, output: seen.add(output.dtype))
    try:
        proba = net.predict_proba(X)
    finally:
        handle.remove()
    return proba, seen


@pytest.mark.parametrize("unwrap_after_train", [True, False], ids=["unwrapped", "wrapped"])
def test_bf16_autocasts_on_the_gpu_before_and_after_save_and_load(
    data, tmp_path, unwrap_after_train
):
    X, y = data
    accelerator = gpu_accelerator(mixed_precision="bf16")

    def make():
        return AcceleratedNet(
            MLP,
            accelerator=accelerator,
            max_epochs=2,
            unwrap_after_train=unwrap_after_train,
            **NET_PARAMS,
        )

    net = make().fit(X, y)
    assert device_of(net) == GPU
    proba, dtypes = predict_and_watch(net, X)
    assert proba.dtype == np.float32 and proba.shape == (len(X), 2)
    assert dtypes == {torch.bfloat16}

    net.save_params(f_params=tmp_path / "params.pt")
    net.load_params(f_params=tmp_path / "params.pt")
    fresh = make().initialize()
    fresh.load_params(f_params=tmp_path / "params.pt")
    for loaded in (net, fresh):
        again, dtypes = predict_and_watch(loaded, X)
        assert dtypes == {torch.bfloat16}
        assert device_of(loaded) == GPU  # loaded on the CPU, copied into the GPU's weights
        np.testing.assert_allclose(again, proba, rtol=0, atol=1e-6)


# --- exact resume on CUDA -------------------------------------------------


@pytest.mark.parametrize("mixed_precision", ["no", "fp16"])
def test_resume_on_the_gpu_repeats_the_uninterrupted_run_bit_for_bit(
    data, tmp_path, mixed_precision
):
    # a scaler that grows every 3 steps has a state worth resuming
    handlers = (
        [GradScalerKwargs(init_scale=2.0**10, growth_interval=3)]
        if mixed_precision == "fp16"
        else []
    )

    def make(max_epochs):
        # a fresh accelerator (and GradScaler) for each net, as after a restart
        accelerator = gpu_accelerator(mixed_precision=mixed_precision, kwargs_handlers=handlers)
        torch.manual_seed(0)  # seeds the CUDA generator too
        return AcceleratedNet(
            DropoutMLP,
            accelerator=accelerator,
            max_epochs=max_epochs,
            iterator_train__shuffle=True,
            **NET_PARAMS,
        )

    def scaler_state(net):
        scaler = net.accelerator.scaler
        return None if scaler is None else scaler.state_dict()

    uninterrupted = make(4).fit(*data)
    assert device_of(uninterrupted) == GPU
    expected = history(uninterrupted), weights(uninterrupted), scaler_state(uninterrupted)
    if mixed_precision == "fp16":
        assert expected[2]["scale"] != 2.0**10  # it changed: there is a state to keep

    first = make(2).fit(*data)
    first.save_state(tmp_path / "state.pt")
    resumed = make(4)
    resumed.load_state(tmp_path / "state.pt")
    resumed.fit(*data)

    assert history(resumed) == expected[0]
    assert_same_weights(weights(resumed), expected[1])
    assert scaler_state(resumed) == expected[2]


def test_the_cuda_generator_round_trips():
    torch.cuda.init()  # a process that never started CUDA saves no CUDA generator
    state = rng_state()
    assert "cuda" in state
    draws = torch.rand(4, device=GPU)
    restore_rng(state)
    assert torch.equal(torch.rand(4, device=GPU), draws)


def test_cuda_generators_of_more_gpus_than_there_are_do_not_stop_a_resume():
    torch.cuda.init()
    state = rng_state()
    state["cuda"] = list(state["cuda"]) + [state["cuda"][0]]  # one GPU more than here
    draws = torch.rand(4, device=GPU)
    restore_rng(state)
    assert torch.equal(torch.rand(4, device=GPU), draws)


# --- from the GPU to the CPU ----------------------------------------------


def test_params_saved_on_the_gpu_load_on_the_cpu(data, tmp_path):
    X, y = data
    params = dict(optimizer=torch.optim.Adam, max_epochs=2, **dict(NET_PARAMS, lr=0.01))
    gpu_net = AcceleratedNet(MLP, accelerator=gpu_accelerator(), **params).fit(X, y)
    assert device_of(gpu_net) == GPU
    assert GPU in optimizer_devices(gpu_net)  # Adam's moments live on the GPU
    expected = gpu_net.predict_proba(X)
    files = dict(
        f_params=tmp_path / "params.pt",
        f_optimizer=tmp_path / "optimizer.pt",
        f_history=tmp_path / "history.json",
    )
    gpu_net.save_params(**files)

    cpu_net = AcceleratedNet(MLP, accelerator=cpu_accelerator(), **params).initialize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DeviceWarning, nor any other
        cpu_net.load_params(**files)
    assert cpu_net.device is None
    assert device_of(cpu_net) == "cpu" and optimizer_devices(cpu_net) == {"cpu"}
    assert len(cpu_net.history) == 2
    np.testing.assert_allclose(cpu_net.predict_proba(X), expected, rtol=0, atol=1e-5)
    cpu_net.partial_fit(X, y)  # training goes on from the loaded optimizer state

    plain = NeuralNetClassifier(MLP, device="cpu").initialize()
    plain.load_params(f_params=files["f_params"])
    np.testing.assert_allclose(plain.predict_proba(X), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mixed_precision", ["no", "fp16"])
@pytest.mark.parametrize("machine", ["with CUDA", "without CUDA"])
def test_a_training_state_saved_on_the_gpu_resumes_on_the_cpu(
    data, tmp_path, monkeypatch, mixed_precision, machine
):
    params = dict(optimizer=torch.optim.Adam, **dict(NET_PARAMS, lr=0.01))
    accelerator = gpu_accelerator(mixed_precision=mixed_precision)
    gpu_net = AcceleratedNet(DropoutMLP, accelerator=accelerator, max_epochs=2, **params).fit(*data)
    gpu_net.save_state(tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", map_location="cpu", weights_only=True)
    assert "cuda" in saved["rng"][0]  # there is a CUDA part to leave out
    assert (saved["scaler"] is not None) == (mixed_precision == "fp16")

    cpu_net = AcceleratedNet(DropoutMLP, accelerator=cpu_accelerator(), max_epochs=4, **params)
    if machine == "without CUDA":
        # What a machine without a GPU sees; the CUDA generator here stands
        # for one the file must not touch there.
        torch.cuda.manual_seed(1234)
        cuda_generator = torch.cuda.get_rng_state()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_net.load_state(tmp_path / "state.pt")
    cpu_net.fit(*data)
    monkeypatch.undo()

    assert device_of(cpu_net) == "cpu" and optimizer_devices(cpu_net) == {"cpu"}
    assert len(cpu_net.history) == 4
    assert history(cpu_net)[:2] == history(gpu_net)
    if machine == "without CUDA":
        assert torch.equal(torch.cuda.get_rng_state(), cuda_generator)
