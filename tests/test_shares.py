"""N processes train as one with N times the batch at every data size
(``launched/shares_run.py``): the last, partial global batch trains on its
real samples only, each rank's loss weighted by its share of them, and every
epoch's shuffled order is the one one process draws."""

import math

import numpy as np
import pytest
from harness import check_values, run_plain, run_processes
from shares_run import CASES, SIZES

pytestmark = pytest.mark.multiprocess

BATCH = 8  # per process
FP32 = 1e-6  # measured: at most 1.2e-7, in fp32 and emulated fp16
# bf16 rounds to 3 significant digits, in other places for other batch
# shapes; measured: train losses at most 2.3e-3 apart (the padding that
# trained before moved them by 2e-2 to 7e-1)
BF16_LOSS = 5e-3


# (processes, precision) of the tests that compare N processes with one
COMPARED = [(2, "fp32"), (3, "fp32"), (2, "fp16")]


def needed(item):
    """The ``(processes, precision, alone)`` a collected test of this module reads."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "processes" in params:
        return {
            (params["processes"], params["precision"], False),
            (params["processes"], "fp32", True),
        }
    if "case" in params:  # bf16
        return {(2, "bf16", False), (2, "bf16", True)}
    return {(2, "fp32", False)}


@pytest.fixture(scope="module")
def launched(request):
    """``launched(processes, precision, alone=False)``: every rank's results
    of ``processes`` processes, or (``alone``) of one process with their
    global batch.

    One launch of N processes fits every precision the selected tests of
    this module read, and one plain process every global batch and precision
    they compare with: three launches in all, once per module.
    """
    selected = set()
    for item in request.session.items:
        if item.module is request.module:
            selected |= needed(item)
    done = {}

    def get(processes, precision, alone=False):
        key = processes, precision, alone
        group = processes if not alone else "alone"
        if group not in done:
            configs = sorted(
                f"{BATCH * n}:{p}"
                for n, p, a in selected | {key}
                if (n if not a else "alone") == group
            )
            if alone:
                launch = run_plain("shares_run.py", *configs, timeout=600)
            else:
                launch = run_processes("shares_run.py", *configs, nproc=processes, timeout=600)
            done[group] = launch
        return [rank[f"{BATCH * processes}:{precision}"] for rank in done[group].check()]

    return get


def outcome(ranks, case):
    values = check_values(ranks, case)
    assert all(rank == values[0] for rank in values[1:])  # one truth on every rank
    return values[0]


def counted(case, processes):
    """Batches of the batch size with a real sample, as one process with it counts."""
    whole, extra = SIZES[case.split("-")[0]]
    samples = whole * BATCH * processes + extra if whole else extra
    if "-drop-" in case:
        return samples // (BATCH * processes) * processes
    return math.ceil(samples / BATCH)


@pytest.mark.parametrize("processes, precision", COMPARED)
@pytest.mark.parametrize("case", CASES)
def test_n_processes_train_as_one_with_n_times_the_batch(launched, processes, precision, case):
    ours = outcome(launched(processes, precision), case)
    # emulated fp16 scales exactly (a power of two): it equals fp32, as in the matrix
    expected = outcome(launched(processes, "fp32", alone=True), case)
    np.testing.assert_allclose(ours["weights"], expected["weights"], rtol=0, atol=FP32)
    np.testing.assert_allclose(ours["train_loss"], expected["train_loss"], rtol=0, atol=FP32)
    assert ours["train_batch_count"] == [counted(case, processes)] * 3


@pytest.mark.parametrize("case", CASES)
def test_in_bf16_the_losses_follow_one_process_within_bf16_rounding(launched, case):
    ours = outcome(launched(2, "bf16"), case)
    expected = outcome(launched(2, "bf16", alone=True), case)
    np.testing.assert_allclose(ours["train_loss"], expected["train_loss"], rtol=0, atol=BF16_LOSS)
    assert ours["train_batch_count"] == [counted(case, 2)] * 3


def test_a_loss_that_is_not_a_mean_trains_the_padding_and_says_so_once(launched):
    warned = check_values(launched(2, "fp32"), "sum_loss")
    padding = [[w for w in rank if "reduction='sum'" in w] for rank in warned]
    assert len(padding[0]) == 1 and "iterator_train__drop_last" in padding[0][0]
    assert padding[1] == []  # output belongs to the main process
