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
   LR schedule steps per batch (see ``matrix.PER_BATCH_SCHEDULES``); so do 2
   and 3 processes where the data does not split into whole global batches
   (``UNEVEN`` samples: the last one is partial).
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
# 86 samples: ValidSplit(5) keeps 68 for training, which leaves a partial
# last global batch for 2 and 3 processes, with accumulation 1 and 2
UNEVEN = 86
# launch name -> (precision, processes, batch size per process, samples)
LAUNCHES = {precision: (precision, 2, BATCH_SIZE, 80) for precision in PRECISIONS}
LAUNCHES["reference"] = ("fp32", 1, 2 * BATCH_SIZE, 80)
for processes in (2, 3):
    LAUNCHES[f"fp32, {processes} processes, uneven"] = ("fp32", processes, BATCH_SIZE, UNEVEN)
    LAUNCHES[f"reference, {processes} x batch, uneven"] = (
        "fp32",
        1,
        processes * BATCH_SIZE,
        UNEVEN,
    )
# the launches of N processes and of one with N times the batch
EQUAL = [
    ("fp32", "reference"),
    *((f"fp32, {n} processes, uneven", f"reference, {n} x batch, uneven") for n in (2, 3)),
]


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
            precision, nproc, batch_size, samples = LAUNCHES[name]
            dirname = tmp_path_factory.mktemp("matrix")
            args = precision, batch_size, dirname, samples
            done[name] = run_processes("matrix.py", *args, nproc=nproc, timeout=LAUNCH_TIMEOUT)
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


@pytest.mark.parametrize("launch, reference", EQUAL)
@pytest.mark.parametrize("accumulation", ACCUMULATION)
@pytest.mark.parametrize("case", EQUIVALENT)
def test_n_processes_equal_one_process_with_n_times_the_batch(
    results, launch, reference, accumulation, case
):
    ranks = fitted(results(launch, accumulation, case), "parameters")
    assert all(rank["digest"] == ranks[0]["digest"] for rank in ranks[1:])
    many = ranks[0]
    (one,) = fitted(results(reference, accumulation, case), "reference parameters")
    assert many["epochs"] == one["epochs"]
    assert_close(many["train_loss"], one["train_loss"], "train_loss per epoch")
    assert list(many["params"]) == list(one["params"])
    for name, values in many["params"].items():
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
    for name, (precision, nproc, batch_size, samples) in LAUNCHES.items():
        for rank in launched(name).check():
            assert (rank["num_processes"], rank["batch_size"]) == (nproc, batch_size)
            assert rank["n_samples"] == samples
            assert rank["mixed_precision"] == ("bf16" if precision == "bf16" else "no")
