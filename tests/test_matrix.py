"""The invariant matrix: precision x gradient accumulation x training feature,
in two real processes (``launched/matrix.py``).

One launch per precision fits every case of ``matrix.CASES`` with
accumulation 1 and 2; one more launch, of one process with twice the batch,
is the fp32 reference. The tests are parametrized over the matrix, so that
every failure names its precision, accumulation and case.

Invariants
----------
1. Every case fits without error on every rank.
2. After fit, every parameter is bitwise identical on both ranks.
3. In fp32, 2 processes with batch b equal 1 process with batch 2 b (to
   rounding) in every parameter and every epoch's train loss, except where an
   LR schedule steps per batch (see ``matrix.PER_BATCH_SCHEDULES``).
4. fp16 as emulated here (a GradScaler on an fp32 accelerator) equals fp32:
   the scale is a power of two, so scaling the loss and unscaling the
   gradients are exact, and whatever the scaler changes beyond that (a
   callback that sees scaled gradients) shows.
"""

import numpy as np
import pytest
from harness import run_processes
from matrix import ACCUMULATION, CASES, PER_BATCH_SCHEDULES, PRECISIONS

pytestmark = pytest.mark.multiprocess

BATCH_SIZE = 8
# Each launch takes about 30 s here; the margin is for a machine shared with
# other work and for a case that hangs in a collective (30 s timeout each).
LAUNCH_TIMEOUT = 300
# launch name -> (precision, processes, batch size per process)
LAUNCHES = {precision: (precision, 2, BATCH_SIZE) for precision in PRECISIONS}
LAUNCHES["reference"] = ("fp32", 1, 2 * BATCH_SIZE)


def matrix(precisions=PRECISIONS, cases=CASES):
    return [
        pytest.param(precision, accumulation, case, id=f"{precision}-accum{accumulation}-{case}")
        for precision in precisions
        for accumulation in ACCUMULATION
        for case in cases
    ]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Each launch runs once per module, and only if a selected test needs it."""
    done = {}

    def get(name):
        if name not in done:
            precision, nproc, batch_size = LAUNCHES[name]
            dirname = tmp_path_factory.mktemp(f"matrix_{name}")
            done[name] = run_processes(
                "matrix.py", precision, batch_size, dirname, nproc=nproc, timeout=LAUNCH_TIMEOUT
            )
        return done[name]

    return get


@pytest.fixture
def results(launched):
    """``results(launch, accumulation, case)``: the case's result on every rank."""

    def get(name, accumulation, case):
        ranks = launched(name).check()
        return [rank["cases"][f"accum{accumulation}/{case}"] for rank in ranks]

    return get


def fitted(ranks, what):
    """The values of a case on every rank; fails the test if fit raised."""
    for rank, result in enumerate(ranks):
        if not result["ok"]:
            # test_fits_on_every_rank shows the whole error
            first_line = result["error"].splitlines()[0]
            pytest.fail(f"no {what}: fit raised on rank {rank}: {first_line}", pytrace=False)
    return [result["value"] for result in ranks]


def assert_close(actual, expected, what):
    # rtol alone fails on weights near zero, where rounding leaves an absolute
    # difference of a few ulps of the larger weights (up to 6e-8 here)
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7, err_msg=what)


# --- 1 -------------------------------------------------------------------------


@pytest.mark.parametrize("precision, accumulation, case", matrix())
def test_fits_on_every_rank(results, precision, accumulation, case):
    errors = [
        f"rank {rank}: {result['error']}"
        for rank, result in enumerate(results(precision, accumulation, case))
        if not result["ok"]
    ]
    assert not errors, "\n".join(errors)


# --- 2 -------------------------------------------------------------------------


@pytest.mark.parametrize("precision, accumulation, case", matrix())
def test_parameters_are_identical_on_every_rank(results, precision, accumulation, case):
    first, *others = fitted(results(precision, accumulation, case), "parameters to compare")
    for other in others:
        differ = [
            name
            for (name, mine), (_, theirs) in zip(first["digest"], other["digest"])
            if mine != theirs
        ]
        assert not differ, f"parameters that differ between the ranks: {differ}"
        assert [name for name, _ in other["digest"]] == [name for name, _ in first["digest"]]


# --- 3 -------------------------------------------------------------------------

# Per-batch schedules are left out by design: accelerate steps a prepared
# per-batch scheduler once per process per call, so on 2 processes the LR
# advances twice per optimizer step, as for a run on the whole data's batches.
EQUIVALENT = [case for case in CASES if case not in PER_BATCH_SCHEDULES]


@pytest.mark.parametrize("precision, accumulation, case", matrix(["fp32"], EQUIVALENT))
def test_two_processes_equal_one_process_with_twice_the_batch(
    results, precision, accumulation, case
):
    two = fitted(results(precision, accumulation, case), "parameters")[0]
    (one,) = fitted(results("reference", accumulation, case), "reference parameters")
    assert two["epochs"] == one["epochs"]
    assert_close(two["train_loss"], one["train_loss"], "train_loss per epoch")
    assert list(two["params"]) == list(one["params"])
    for name, values in two["params"].items():
        assert_close(values, one["params"][name], name)


# --- 4 -------------------------------------------------------------------------


@pytest.mark.parametrize("precision, accumulation, case", matrix(["fp16"]))
def test_emulated_fp16_equals_fp32(results, precision, accumulation, case):
    fp16 = fitted(results(precision, accumulation, case), "parameters")[0]
    fp32 = fitted(results("fp32", accumulation, case), "fp32 parameters")[0]
    assert_close(fp16["train_loss"], fp32["train_loss"], "train_loss per epoch")
    for name, values in fp16["params"].items():
        assert_close(values, fp32["params"][name], name)


def test_each_launch_trains_as_configured(launched):
    for name, (precision, nproc, batch_size) in LAUNCHES.items():
        for rank in launched(name).check():
            assert (rank["num_processes"], rank["batch_size"]) == (nproc, batch_size)
            assert rank["mixed_precision"] == ("bf16" if precision == "bf16" else "no")
