"""The invariant matrix: precision x gradient accumulation x training feature,
in real processes (``launched/matrix.py``).

Every configuration of ``CONFIGS`` (a precision, a number of processes, a
batch size per process, a data size) fits every case of ``matrix.CASES``
with accumulation 1 and 2. One launch per number of processes fits all of
that number's configurations in turn: 2 processes in fp32, bf16 and fp16,
and in fp32 on data that leaves a partial global batch; 3 processes on that
data; and 1 process with 2 and 3 times the batch, the references. The tests
are parametrized over the matrix, so that every failure names its
precision, accumulation and case.

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
from matrix import ACCUMULATION, CASES, EQUIVALENT, PRECISIONS

pytestmark = pytest.mark.multiprocess

BATCH_SIZE = 8
# The launch of 2 processes fits 4 configurations, 150 fits of a second or
# less each; the margin is for a machine shared with other work. A case that
# hangs ends its launch within its own deadline (``Checks``), naming it.
LAUNCH_TIMEOUT = 900
# 86 samples: ValidSplit(5) keeps 68 for training, which leaves a partial
# last global batch for 2 and 3 processes, with accumulation 1 and 2
UNEVEN = 86
# configuration -> (precision, processes, batch size per process, samples)
CONFIGS = {precision: (precision, 2, BATCH_SIZE, 80) for precision in PRECISIONS}
CONFIGS["reference"] = ("fp32", 1, 2 * BATCH_SIZE, 80)
for processes in (2, 3):
    CONFIGS[f"fp32, {processes} processes, uneven"] = ("fp32", processes, BATCH_SIZE, UNEVEN)
    CONFIGS[f"reference, {processes} x batch, uneven"] = (
        "fp32",
        1,
        processes * BATCH_SIZE,
        UNEVEN,
    )
# the configurations of N processes and of one with N times the batch
EQUAL = [
    ("fp32", "reference"),
    *((f"fp32, {n} processes, uneven", f"reference, {n} x batch, uneven") for n in (2, 3)),
]
# Only the 2-process configurations named after their precision are read
# case by case (invariants 1, 2 and 4); the others are read by comparisons
# across numbers of processes, which leave out the per-batch schedules.
FITS_EVERY_CASE = PRECISIONS


def argument(name):
    """The configuration as ``matrix.py`` takes it."""
    precision, _, batch_size, samples = CONFIGS[name]
    which = "all" if name in FITS_EVERY_CASE else "equivalent"
    return f"{precision}:{batch_size}:{samples}:{which}"


def matrix(precisions=PRECISIONS, cases=CASES):
    return [
        pytest.param(precision, accumulation, case, id=f"{precision}-accum{accumulation}-{case}")
        for precision in precisions
        for accumulation in ACCUMULATION
        for case in cases
    ]


def needed(item):
    """The configurations a collected test of this module reads."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "launch" in params:
        return {params["launch"], params["reference"]}
    if "precision" in params:  # fp16's compare with fp32 (invariant 4)
        return (
            {params["precision"], "fp32"}
            if params["precision"] == "fp16"
            else {params["precision"]}
        )
    return set(CONFIGS)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """``launched(name)``: every rank's report of the configuration ``name``.

    One launch per number of processes fits the configurations of that
    number which the selected tests of this module read, once per module.
    """
    selected = set()
    for item in request.session.items:
        if item.module is request.module:
            selected |= needed(item)
    done = {}

    def get(name):
        processes = CONFIGS[name][1]
        if processes not in done:
            names = [n for n in CONFIGS if CONFIGS[n][1] == processes and n in selected | {name}]
            done[processes] = (
                names,
                run_processes(
                    "matrix.py",
                    tmp_path_factory.mktemp("matrix"),
                    *map(argument, names),
                    nproc=processes,
                    timeout=LAUNCH_TIMEOUT,
                ),
            )
        names, launch = done[processes]
        assert name in names, f"{name} was not launched: not among the selected tests' needs"
        return [rank["configs"][argument(name)] for rank in launch.check()]

    return get


@pytest.fixture
def results(launched):
    """``results(configuration, accumulation, case)``: the case's result on every rank."""

    def get(name, accumulation, case):
        return [rank["cases"][f"accum{accumulation}/{case}"] for rank in launched(name)]

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
    for name, (precision, nproc, batch_size, samples) in CONFIGS.items():
        ranks = launched(name)
        assert len(ranks) == nproc
        for rank in ranks:
            assert (rank["num_processes"], rank["batch_size"]) == (nproc, batch_size)
            assert rank["n_samples"] == samples
            assert rank["mixed_precision"] == ("bf16" if precision == "bf16" else "no")
