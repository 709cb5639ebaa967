"""A user's own net class under the mixin: its overrides run, on one and
two real processes (``launched/overrides.py``)."""

import pytest
from harness import run_processes

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=[1, 2], ids=["1 process", "2 processes"])
def ranks(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"overrides{request.param}")
    results = run_processes("overrides.py", str(tmp), nproc=request.param, timeout=240).check()
    for rank in results:
        failed = {name: r["error"] for name, r in rank.items() if not r["ok"]}
        assert not failed, failed
    return [{name: r["value"] for name, r in rank.items()} for rank in results]


def expected(enumerated, rank):
    # skorch's save_params (and an override of it) writes, on the main
    # process only; every rank calls the mixin's
    return set(enumerated) - (set() if rank == 0 else {"save_params"})


def test_every_method_the_mixin_defines_reaches_the_users_override(ranks):
    for index, rank in enumerate(ranks):
        found = rank["every_override_runs"]
        # the enumeration is the classes' own: it cannot come out empty
        assert {"train_step", "notify", "save_params", "load_params"} <= set(found["enumerated"])
        assert expected(found["enumerated"], index) <= set(found["called"])


def test_with_accumulation_all_but_train_step_single_run_and_that_one_is_refused(ranks):
    for index, rank in enumerate(ranks):
        enumerated = expected(rank["every_override_runs"]["enumerated"], index)
        called = set(rank["every_other_override_runs_with_accumulation"])
        assert enumerated - {"train_step_single"} <= called
        message = rank["train_step_single_with_accumulation"]
        assert message is not None
        assert "OwnSingleStep.train_step_single" in message
        assert "self.accelerator.backward(loss)" in message


def test_get_all_learnable_params_decides_what_trains(ranks):
    for rank in ranks:
        result = rank["last_layer_only"]
        assert result["optimizer_params"] == 2  # out.weight, out.bias
        assert result["out_changed"] and not result["hidden_changed"]


def test_run_single_epoch_override_runs_for_training_and_validation(ranks):
    for rank in ranks:
        assert rank["run_single_epoch_override"]["rows"] == [[True, True], [True, True]]


def test_a_gan_like_train_step_below_the_mixin_trains_as_on_the_final_class(ranks):
    for rank in ranks:
        below, top = rank["gan_below_and_on_top"]["below"], rank["gan_below_and_on_top"]["top"]
        assert below == top  # bit for bit: weights, losses, loss_d
        assert all(len(epoch) > 0 for epoch in below["loss_d"])
    assert all(rank["gan_below_and_on_top"] == ranks[0]["gan_below_and_on_top"] for rank in ranks)
