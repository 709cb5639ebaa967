"""No silent divergence: gradients seen as the optimizers step with them,
trainable sets that change, data that differ between ranks, and the replica
check, in one process here and in two real processes."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from common import MLP, AcceleratedNet
from harness import CheckedRanks, run_processes
from harness import check_values as values
from skorch.callbacks import Callback, GradientNormClipping

from accel_mixin import AccelerateMixin
from accel_mixin.distributed.replicas import (
    _length,
    _sample_digest,
    check_same_steps,
    fingerprints,
)


class GradNorms(Callback):
    """Records the norm of the gradients that on_grad_computed shows."""

    def initialize(self):
        self.norms_ = []
        return self

    def on_grad_computed(self, net, named_parameters, **kwargs):
        grads = [p.grad.detach().flatten() for _, p in named_parameters if p.grad is not None]
        self.norms_.append(float(torch.cat(grads).norm()))


def fit_net(data, scaler=False, accumulation=1, batch_size=16, clip=None, epochs=3):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    if scaler:
        # accelerate builds a GradScaler for fp16 on GPUs only; torch's CPU
        # GradScaler takes the same paths through accelerate and the net
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    callbacks = [GradNorms()]
    if clip is not None:
        callbacks.append(GradientNormClipping(gradient_clip_value=clip))
    torch.manual_seed(0)
    net = AcceleratedNet(
        MLP,
        accelerator=accelerator,
        max_epochs=epochs,
        lr=0.5,
        batch_size=batch_size,
        verbose=0,
        train_split=None,
        callbacks=callbacks,
    )
    start = [p.detach().clone() for p in net.initialize().module_.parameters()]
    net.fit(*data)
    return net, start


def weights(net):
    return torch.cat([p.detach().flatten() for p in net.module_.parameters()])


def test_gradient_clipping_under_a_gradient_scaler_clips_the_true_gradients(data):
    plain, start = fit_net(data, clip=1.0)
    scaled, _ = fit_net(data, scaler=True, clip=1.0)
    # scaling by a power of two and unscaling is exact here
    torch.testing.assert_close(weights(scaled), weights(plain), rtol=1e-6, atol=1e-7)
    moved = float((weights(scaled) - torch.cat([p.flatten() for p in start])).norm())
    assert moved > 0.1  # scaled gradients clipped to 1.0 would hardly move it
    norms = dict(scaled.callbacks_)["GradNorms"].norms_
    assert norms == pytest.approx(dict(plain.callbacks_)["GradNorms"].norms_, rel=1e-5)


@pytest.mark.parametrize("scaler", [False, True], ids=["fp32", "scaler"])
def test_gradient_callbacks_see_the_accumulated_gradients(data, scaler):
    # two micro-batches of 16 step like one batch of 32; clipping at 0.05
    # clips every step, so clipping a micro-batch's share would show. 192
    # samples: no incomplete accumulation window at the end of an epoch
    data = data[0][:192], data[1][:192]
    whole, _ = fit_net(data, scaler=scaler, batch_size=32, clip=0.05)
    accumulated, _ = fit_net(data, scaler=scaler, accumulation=2, batch_size=16, clip=0.05)
    torch.testing.assert_close(weights(accumulated), weights(whole), rtol=1e-5, atol=1e-6)
    # notified once per optimizer step, with the gradients it steps with
    norms = dict(accumulated.callbacks_)["GradNorms"].norms_
    assert norms == pytest.approx(dict(whole.callbacks_)["GradNorms"].norms_, rel=1e-4)
    assert max(norms) > 0.05


def test_without_accumulation_gradient_callbacks_run_on_every_batch(data):
    net, _ = fit_net(data, batch_size=16, epochs=2)
    batches = sum(len(row["batches"]) for row in net.history)
    assert len(dict(net.callbacks_)["GradNorms"].norms_) == batches == 2 * 13


def test_fingerprints_are_exact_and_order_free():
    base = [
        torch.randn(1000, 37),
        torch.randn(3, dtype=torch.float16),
        torch.randn(5, dtype=torch.bfloat16),
        torch.randn(4, dtype=torch.float64),
    ]
    prints = fingerprints(base)
    for i in range(len(base)):
        nudged = [t.clone() for t in base]
        flat = nudged[i].view(-1)
        flat[-1] = torch.nextafter(flat[-1], flat[-1] + 1)  # one bit of one element
        assert (fingerprints(nudged) != prints).tolist() == [j == i for j in range(len(base))]
    # the same values laid out otherwise give the same fingerprint
    assert fingerprints([base[0].t().contiguous().t()]) == fingerprints([base[0]])


def test_fingerprints_of_complex_and_integer_tensors():
    number = torch.tensor([1.0 + 2.0j, -0.5j])
    # a complex tensor is its real and imaginary parts
    assert fingerprints([number]) == fingerprints([torch.view_as_real(number)])
    assert fingerprints([number]) != fingerprints([torch.tensor([1.0 + 2.5j, -0.5j])])
    # integers are summed as they are, wrapping around at 2**32
    assert fingerprints([torch.tensor([1, 2, 3]), torch.tensor([2**31 - 1, 1])]).tolist() == [
        6,
        -(2**31),
    ]


def test_data_without_a_length_or_rows_to_compare_is_compared_by_length_only():
    assert _length(np.zeros((5, 2))) == 5
    assert _length(None) == -1
    assert _length(iter([1, 2])) == -1  # an iterable
    assert _length({"a": np.zeros(3), "b": np.zeros(4)}) == -1  # inconsistent lengths
    X = np.arange(20.0).reshape(10, 2)
    assert _sample_digest(X, None, 10) == _sample_digest(X.copy(), None, 10) >= 0
    assert _sample_digest(X, None, 10) != _sample_digest(X + 1, None, 10)
    assert _sample_digest(X, None, 0) == -1  # no rows
    assert _sample_digest(np.array([1, "a"], dtype=object), None, 2) == -1  # no bytes to hash
    assert _sample_digest(object(), None, 3) == -1  # nothing skorch can index


def test_without_even_batches_a_loader_without_a_length_is_not_counted():
    gathered = []

    def everyone(site, values):
        gathered.append(values)
        return [values]

    accelerator = SimpleNamespace(even_batches=False)
    check_same_steps(accelerator, iter([1, 2, 3]), everyone)  # an iterable: nothing to compare
    assert gathered == []
    check_same_steps(accelerator, [1, 2, 3], everyone)
    assert gathered == [[3]]


def test_replica_check_every_must_be_a_whole_number(data):
    net = AcceleratedNet(MLP, accelerator=Accelerator(cpu=True), replica_check_every=-1)
    with pytest.raises(ValueError, match="replica_check_every must be a whole number"):
        net.initialize()


def test_replica_check_is_a_parameter(data):
    net = AcceleratedNet(MLP, accelerator=Accelerator(cpu=True), replica_check_every=5)
    assert net.get_params()["replica_check_every"] == 5
    assert AccelerateMixin.__init__.__kwdefaults__["replica_check_every"] == 1


# --- two real processes -------------------------------------------------------


@pytest.fixture(scope="module")
def divergence():
    # read in each test: a launch that crashed fails every test reading it
    return CheckedRanks(run_processes("divergence_checks.py", timeout=300))


def same_on_every_rank(checks, name):
    found = values(checks, name)
    assert all(value["digest"] == found[0]["digest"] for value in found), found
    return found


@pytest.mark.multiprocess
def test_freezer_after_prepare_trains_one_model(divergence):
    for value in same_on_every_rank(divergence, "freezer_after_prepare"):
        assert value["changed"] == ["out.bias", "out.weight"]  # hidden stayed frozen


@pytest.mark.multiprocess
def test_unfreezer_trains_one_model(divergence):
    for value in same_on_every_rank(divergence, "unfreezer_after_freezer"):
        assert value["hidden_grad"]


@pytest.mark.multiprocess
def test_a_module_frozen_at_initialize_trains_in_sync_once_unfrozen(divergence):
    for value in same_on_every_rank(divergence, "module_frozen_at_initialize_then_unfrozen"):
        assert value["changed"] == ["bias", "weight"]


@pytest.mark.multiprocess
def test_requires_grad_changed_between_fits(divergence):
    for value in same_on_every_rank(divergence, "requires_grad_between_fits"):
        assert value["changed_while_frozen"] == ["out.bias", "out.weight"]
        assert value["changed_after"] == ["hidden.bias", "hidden.weight", "out.bias", "out.weight"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("check", "error"),
    [
        (
            "data_of_other_lengths",
            "The ranks fit on data of different lengths (rank 0: 200 samples, rank 1: 150 samples)",
        ),
        (
            "data_of_other_values",  # as tokenizers trained on each rank give
            "The ranks fit on different data: the same rows of X or y hold other values on "
            "rank(s) 1 than on rank 0",
        ),
    ],
)
def test_other_data_on_one_rank_raises_on_every_rank_at_once(divergence, check, error):
    for value in values(divergence, check):
        assert value["error"].startswith(f"DistributedError: {error}"), value
        assert value["seconds"] < 25  # not the 30 s collective timeout


@pytest.mark.multiprocess
def test_replica_check_raises_on_every_rank_naming_the_parameter_and_epoch(divergence):
    for value in values(divergence, "replica_check_catches_a_divergence"):
        assert value["error"].startswith(
            "DistributedError: Replica check after epoch 2: parameter 'module_.out.bias' "
            "differs between ranks (rank(s) [1] differ from rank 0"
        )
        assert value["epochs"] == 2
    for value in values(divergence, "replica_check_spaced_out"):
        assert value["error"].startswith("DistributedError: Replica check after epoch 3")
    for value in values(divergence, "replica_check_catches_a_bypassing_train_step"):
        assert value["error"].startswith("DistributedError: Replica check after epoch 1")


@pytest.mark.multiprocess
def test_ranks_that_built_other_models_are_named_with_their_parameter_counts(divergence):
    for value in values(divergence, "other_architectures_on_some_ranks"):
        assert value["error"] == (
            "DistributedError: Replica check when training begins: the ranks hold different "
            "numbers of parameters (rank 0: 4, rank 1: 6); every rank must build the same model."
        )


@pytest.mark.multiprocess
def test_without_the_replica_check_the_divergence_goes_unnoticed(divergence):
    rank0, rank1 = values(divergence, "replica_check_off")
    assert rank0["error"] is rank1["error"] is None
    assert rank0["digest"]["module.out.bias"] != rank1["digest"]["module.out.bias"]


@pytest.mark.multiprocess
def test_private_names_exist_under_several_processes(divergence):
    assert values(divergence, "private_names_present") == [[], []]


@pytest.mark.multiprocess
def test_a_load_that_failed_on_some_ranks_only_fails_on_every_rank(divergence):
    # LoadInitState swallows rank 1's FileNotFoundError; rank 0 learns of
    # it in load_params, and rank 1 from rank 0 when training begins
    for value in values(divergence, "load_init_state_on_some_ranks_only"):
        assert value["error"].startswith(
            "DistributedError: load_params failed on rank 1: FileNotFoundError: No checkpoint "
            "at init_rank1/"
        )
        assert value["seconds"] < 25  # not the 30 s collective timeout


@pytest.mark.multiprocess
def test_weights_changed_on_some_ranks_only_fail_when_training_begins(divergence):
    for value in values(divergence, "weights_changed_on_some_ranks_at_train_begin"):
        assert value["error"].startswith(
            "DistributedError: Replica check when training begins: parameter 'module_.out.bias' "
            "differs between ranks"
        )
        assert value["seconds"] < 25
