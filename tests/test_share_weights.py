"""The helpers behind N processes training as one: each rank's real samples
and weight, the gradient scaled under an unchanged loss, which criteria are
means."""

from types import SimpleNamespace

import pytest
import torch

from accel_mixin.training.shares import criterion_is_mean, loss_weight, real_samples, scale_gradient


def state(end=True, remainder=13):
    return SimpleNamespace(end_of_dataloader=end, remainder=remainder)


@pytest.mark.parametrize(
    "gradient_state, processes, real, expected",
    [
        (state(False, 26), 2, 16, 1.0),  # not the last batch
        (state(True, -1), 2, 16, 1.0),  # drop_last: every global batch is whole
        (state(True, None), 2, 16, 1.0),
        (state(True, 0), 2, 16, 1.0),  # the data divides
        (state(True, 26), 1, 16, 1.0),
        (state(True, 26), 2, 16, 32 / 26),  # 250 samples, 2 x 16: 16 and 10 real
        (state(True, 26), 2, 10, 20 / 26),
        (state(True, 10), 3, 0, 0.0),  # padding alone
    ],
)
def test_each_rank_weighs_its_share_of_the_real_samples(gradient_state, processes, real, expected):
    assert loss_weight(gradient_state, processes, real) == pytest.approx(expected, abs=0)


def test_the_gradient_is_scaled_and_the_loss_is_not():
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    loss = (x**2).mean()
    scaled = scale_gradient(loss, 0.25)
    assert torch.equal(scaled, loss)  # what the history records
    scaled.backward()
    assert torch.allclose(x.grad, 0.25 * 2 * x.detach() / 3)


def test_a_weight_of_one_or_a_loss_without_gradient_is_left_alone():
    loss = torch.tensor(1.0, requires_grad=True) * 2
    assert scale_gradient(loss, 1.0) is loss
    constant = torch.tensor(2.0)
    assert scale_gradient(constant, 0.5) is constant


def test_criteria_that_average_over_samples():
    assert criterion_is_mean(torch.nn.NLLLoss())
    assert criterion_is_mean(SimpleNamespace(module=torch.nn.CrossEntropyLoss()))  # DDP's
    assert not criterion_is_mean(torch.nn.NLLLoss(reduction="sum"))
    assert not criterion_is_mean(torch.nn.MSELoss(reduction="none"))
    assert not criterion_is_mean(torch.nn.Linear(2, 2))  # no reduction: not known


@pytest.mark.parametrize("rank, expected", [(0, 13), (1, 0)])
def test_real_samples_of_a_short_last_step(rank, expected):
    # 333 samples, batches of 16, 2 ranks: the last step holds 13 real samples
    assert real_samples(state(remainder=333 % 32), 2, rank, 16) == expected


@pytest.mark.parametrize("rank, expected", [(0, 16), (1, 14)])
def test_real_samples_when_the_last_step_is_longer_than_a_batch(rank, expected):
    assert real_samples(state(remainder=350 % 32), 2, rank, 16) == expected


@pytest.mark.parametrize("st", [state(end=False), state(remainder=0), state(remainder=-1)])
def test_every_sample_is_real_before_the_end_or_without_remainder(st):
    assert real_samples(st, 2, 1, 16) == 16


def test_one_process_has_no_padding():
    assert real_samples(state(remainder=5), 1, 0, 16) == 16
