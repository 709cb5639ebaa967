"""Behaviour under two real processes (torchrun, MULTI_CPU over gloo).

One launch of ``core_checks.py`` runs every check of two processes with
ACCELERATE_USE_CPU, in parts: ours, torch.compile's, a grid search's, and
the incumbent's (skorch.hf.AccelerateMixin), which runs the same checks as
ours, and the tests named ``test_incumbent_*`` show that it has the defects
that ours fixes. One more launch checks both without ACCELERATE_USE_CPU
(``layout_check.py``), and one plain process the search with twice the batch.
"""

import itertools

import numpy as np
import pytest
from harness import check_errors as errors
from harness import check_values as values
from harness import run_plain, run_processes

pytestmark = pytest.mark.multiprocess


SEARCH_BATCH = 16  # per process


# the parts of core_checks.py, in the order they run (the incumbent last);
# each test reads those whose fixture it names
PARTS = ("ours", "compiled", "search", "incumbent")


@pytest.fixture(scope="module")
def core(request, tmp_path_factory):
    """``{part: every rank's report}`` of the launch of two processes, which
    runs the parts that the selected tests of this module read."""
    selected = {
        part
        for item in request.session.items
        if item.module is request.module
        for part in PARTS
        if part in item.fixturenames
    }
    arguments = {
        "ours": "ours",
        "compiled": f"compiled:{tmp_path_factory.mktemp('compiled')}",
        "search": f"search:{SEARCH_BATCH}",
        "incumbent": "incumbent",
    }
    parts = [arguments[part] for part in PARTS if part in selected]
    # a check that hangs ends the launch within its own deadline, naming it
    ranks = run_processes("core_checks.py", *parts, timeout=900).check()
    return {part.split(":")[0]: [rank["parts"][part] for rank in ranks] for part in parts}


@pytest.fixture(scope="module")
def ours(core):
    return core["ours"]


@pytest.fixture(scope="module")
def compiled(core):
    return core["compiled"]


@pytest.fixture(scope="module")
def search(core):
    return core["search"]


@pytest.fixture(scope="module")
def incumbent(core):
    return core["incumbent"]


# --- a. default criteria ----------------------------------------------------


def test_default_criteria_fit(ours):
    for value in values(ours, "default_criterion_fit"):
        assert value["nll"]["criterion_type"] == "NLLLoss"
        assert value["cross_entropy"]["criterion_type"] == "CrossEntropyLoss"
        for result in value.values():
            assert result["spread"] == 0.0
            assert result["train_loss"] < 0.69


def test_incumbent_fails_with_default_criteria(incumbent):
    for error in errors(incumbent, "default_criterion_fit"):
        assert "DistributedDataParallel is not needed" in error


# --- predictions and files --------------------------------------------------


def test_predict_returns_every_row_in_order(ours):
    for value in values(ours, "predict_rows"):
        for n, result in value.items():
            assert result["rows"] == result["predict_rows"] == int(n)
            assert result["max_diff"] < 1e-6


def test_save_and_load_in_all_four_combinations(ours):
    for value in values(ours, "save_load_combinations"):
        assert set(value) == {
            "wrapped->accelerated",
            "wrapped->plain",
            "unwrapped->accelerated",
            "unwrapped->plain",
        }
        assert all(diff == 0.0 for diff in value.values())


def test_only_the_main_process_writes(ours):
    writes = [value["writes"] for value in values(ours, "only_main_writes")]
    assert writes == [3, 0]


def test_file_is_complete_when_save_params_returns(ours):
    rank0, rank1 = values(ours, "file_complete_on_return")
    assert rank0["size_mb"] > 10
    assert rank1["iterations"] == 10
    assert rank1["failures"] == []


def test_incumbent_returns_before_the_file_is_written(incumbent):
    _, rank1 = values(incumbent, "file_complete_on_return")
    # rank 1 read files that rank 0 had not written yet, or not completely;
    # how torch fails on partial bytes varies with how far the write got
    assert rank1["failures"]


def test_learnable_params_keep_plain_names_under_ddp(ours):
    for value in values(ours, "learnable_param_names"):
        assert value["module_type"] == "DistributedDataParallel"
        assert value["names"] == ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]


# --- e. no growth, no second prepare ----------------------------------------


def test_lists_do_not_grow_and_nothing_is_prepared_twice(ours):
    for value in values(ours, "no_list_growth"):
        assert value["after"] == value["before"]
        assert value["new_ddp_without_refit"] == 0
        assert value["same_module"]


def test_incumbent_rewraps_with_new_ddp_wrappers(incumbent):
    for value in values(incumbent, "no_list_growth"):
        assert value["new_ddp_without_refit"] > 0
        assert value["after"]["_models"] > value["before"]["_models"]


# --- h. continued training stays in sync -------------------------------------


def test_partial_fit_and_warm_start_stay_in_sync(ours):
    for value in values(ours, "partial_fit_in_sync"):
        assert value == {"partial_fit": 0.0, "warm_start": 0.0}


def test_incumbent_diverges_after_unwrap(incumbent):
    for value in values(incumbent, "partial_fit_in_sync"):
        assert value["partial_fit"] > 1e-4
        assert value["warm_start"] > 1e-4


# --- training under DDP ---------------------------------------------------------


def test_schedulers_step_as_documented(ours):
    for value in values(ours, "schedulers"):
        # per epoch: once per epoch, whatever the number of processes
        assert value["epoch"]["lr"] == pytest.approx(0.1 * 0.5**3)
        # per batch: accelerate's convention, once per process per step,
        # which is once per batch of the whole data (the history counts them all)
        assert value["batch"]["train_batches"] == 90
        assert value["batch"]["lr"] == pytest.approx(0.1 * 0.9**90)
        # plateau: gets the score, counts epochs
        assert value["plateau"]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_early_stopping_restores_the_best_weights(ours):
    for value in values(ours, "early_stopping_load_best"):
        assert value["epochs"] == 4


def test_accumulation_covers_every_module(ours):
    for value in values(ours, "accumulation_over_two_modules"):
        assert value["max_diff"] < 1e-5
        # 256 samples, 2 ranks: 16 batches of 8 per rank accumulated in pairs,
        # or 8 batches of 16; either way 8 optimizer steps and 8 syncs per module
        assert value["syncs_accumulated"] == value["syncs_single"] == {"module_": 8, "module2_": 8}


# --- g. copies ----------------------------------------------------------------


def test_unpickled_net_predicts_every_row(ours):
    for value in values(ours, "pickle_rows"):
        assert value["rows"] == 333
        assert value["same_predictions"]
        assert value["pickle_sizes"][0] == value["pickle_sizes"][1]


def test_incumbent_unpickled_net_predicts_padded_rows(incumbent):
    for error in errors(incumbent, "pickle_rows"):
        assert error and "(333,2)" in error


def test_deepcopy_and_clone(ours):
    for value in values(ours, "copies"):
        assert value["deepcopy_rows"] == value["clone_rows"] == 333
        assert value["deepcopy_same"]
        assert value["clone_spread"] == 0.0


# --- failures reach every rank --------------------------------------------------


def test_a_failed_save_raises_on_every_rank(ours):
    rank0, rank1 = values(ours, "save_failure_reaches_every_rank")
    assert "no_such_dir" in rank0["error"]
    assert rank1["error"].startswith("DistributedError: save_params failed")
    assert "rank 0" in rank1["error"] and "no_such_dir" in rank1["error"]
    assert max(rank0["seconds"], rank1["seconds"]) < 5


def test_a_load_failing_on_one_rank_raises_on_every_rank(ours):
    rank0, rank1 = values(ours, "load_failure_on_one_rank_reaches_every_rank")
    assert rank1["error"].startswith("FileNotFoundError")
    assert rank0["error"].startswith("DistributedError: load_params failed")
    assert "rank 1" in rank0["error"] and "missing.pt" in rank0["error"]


# --- i. a group that the accelerator does not see -----------------------------


@pytest.fixture(scope="module")
def layout():
    return run_processes("layout_check.py", cpu_env=False, timeout=300).check()


def test_group_without_cpu_setting_is_refused_with_the_fix(layout):
    for error in errors(layout, "alone_refused/ours"):
        assert "WORLD_SIZE=2" in error
        assert "ACCELERATE_USE_CPU=true" in error and "Accelerator(cpu=True)" in error
    for value in values(layout, "cpu_flag_trains_together"):
        assert value == {"num_processes": 2, "spread": 0.0}


def test_incumbent_silently_trains_alone(layout):
    for value in values(layout, "alone_refused/incumbent"):
        assert value["distributed_type"] == "DistributedType.NO"


# --- optimizers that step with a closure ------------------------------------


def test_closure_optimizers_step_alike_on_every_rank(ours):
    # LBFGS and an optimizer that calls the closure three times per step, as
    # skorch's own tests do; every rank sees the same, averaged, losses
    results = values(ours, "closure_optimizers")
    for value in results:
        assert value["lbfgs_spread"] == 0.0 and value["three_calls_spread"] == 0.0
        assert value["lbfgs_valid_acc"] > 0.75
        assert len(value["three_calls_losses"]) == 3 * value["steps_per_rank"] > 0
    assert results[0]["three_calls_losses"] == results[1]["three_calls_losses"]


def test_a_collective_call_on_one_rank_only_fails_fast_naming_both_calls(ours):
    for value in values(ours, "predict_on_the_main_process_only"):
        for call in ("save_params", "fit"):
            outcome = value[call]
            assert outcome["error"].startswith("DistributedError: ")
            assert "inference (predict" in outcome["error"] and call in outcome["error"]
            assert outcome["seconds"] < 10  # the collective timeout is 30 s


# --- grid searches ------------------------------------------------------------

# 2 processes with batch b train as 1 with batch 2 b up to float32 rounding
# (launched/search_scores.py says what that takes); a difference in training
# would move the log loss by far more than this
SCORE_RTOL, SCORE_ATOL = 1e-5, 1e-6
PROBA_ATOL = 1e-5  # 2e-7 here


def test_a_search_agrees_on_every_rank_and_with_one_process_with_twice_the_batch(search):
    two = search
    one = run_plain("search_scores.py", 2 * SEARCH_BATCH, timeout=300).check()[0]
    assert [rank["num_processes"] for rank in two] == [2, 2] and one["num_processes"] == 1
    # every rank's own search: the same scores, down to the bit, so the same
    # best candidate and the same refit
    assert two[1] == two[0]
    result = two[0]
    scores = result["test_scores"]["mean_test_score"]
    assert min(abs(a - b) for a, b in itertools.combinations(scores, 2)) > 0.01
    assert result["best_score"] == max(scores)
    for key, expected in one["test_scores"].items():
        np.testing.assert_allclose(
            result["test_scores"][key], expected, rtol=SCORE_RTOL, atol=SCORE_ATOL, err_msg=key
        )
    assert result["best_params"] == one["best_params"]
    np.testing.assert_allclose(result["refit_proba"], one["refit_proba"], rtol=0, atol=PROBA_ATOL)


# --- torch.compile ------------------------------------------------------------


def test_compile_with_inductor_trains_as_eager_on_every_rank(compiled):
    ranks = compiled
    assert (
        values(ranks, "the_module_trains_in_ddp_compiled")
        == [["DistributedDataParallel", "OptimizedModule", "MLP"]] * 2
    )
    values(ranks, "training_follows_the_eager_net")
    digests = values(ranks, "weights_digest")
    assert digests[0] == digests[1]
    # the file holds the bare module's keys, without torch.compile's prefix
    keys = values(ranks, "saved_params_load_into_a_plain_net")[0]
    assert keys and not any("_orig_mod" in key for key in keys)
