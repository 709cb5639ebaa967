"""Streams (``IterableDataset``) on several processes (``training/streams.py``).

On 2 real processes (``launched/streams_run.py``) every kind of stream
trains as one process does on the same samples with the global batch, at a
size that divides into global batches and at one that leaves a rank a batch
short, with and without gradient accumulation; the history counts the
batches one process counts; each rank reads what its kind says. The pieces
are tested on one process below.
"""

import math
import random
import re

import numpy as np
import pytest
import torch
from accelerate.state import GradientState
from common import fresh_state, make_accelerator, make_data
from harness import check_values, run_plain, run_processes
from streams_run import BATCH, CASES, SIZES, Plain, Positioned, Stop, StopAt, net_for, outcomes

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint
from accel_mixin.training.shares import counts_as_batch
from accel_mixin.training.streams import _EMPTY, _first_sample_print, _kind, fingerprint

FP32 = 1e-6  # measured: at most 9e-8

KINDS = ["plain", "plain-each-reads", "plain-each-reads-split-batches", "split", "split-fsdp2"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    dirname = tmp_path_factory.mktemp("streams")
    ranks = run_processes("streams_run.py", dirname, nproc=2, timeout=600).check()
    alone = run_plain("streams_run.py", "alone", timeout=600).check()[0]
    return ranks, alone


def _rows(rank, n):
    """The samples of ``streams_run.BlockSplit`` on ``rank`` of 2."""
    return sum(1 for i in range(n) if (i // BATCH) % 2 == rank)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES)
def test_every_kind_of_stream_trains_as_one_process_on_the_same_samples(launched, kind, case):
    ranks, alone = launched
    ours = check_values(ranks, f"{kind}-{case}")
    expected = alone[f"alone-{case}"]["value"]
    for rank in ours:  # one truth on every rank
        for got, want in zip(rank["weights"], expected["weights"]):
            np.testing.assert_allclose(got, want, rtol=0, atol=FP32)
        np.testing.assert_allclose(rank["train_loss"], expected["train_loss"], rtol=0, atol=FP32)
    n = SIZES[case.split("-")[0]]
    # the batches of the data: one process's with the batch size the net was given
    batch = 2 * BATCH if "split-batches" in kind else BATCH
    assert ours[0]["train_batch_count"] == [math.ceil(n / batch)] * 2
    yielded = [rank["yielded"] for rank in ours]
    if kind == "plain":  # accelerate's default: the main process reads, and sends
        assert yielded == [n, 0]
    elif kind.startswith("split"):  # each rank reads its own share, once
        assert yielded == [_rows(0, n), _rows(1, n)]
    else:  # dispatch_batches=False: every rank reads the whole stream
        assert yielded == [n, n]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "check, message",
    [
        ("split_predict", "splits itself by rank .* no defined order"),
        (
            "split_dispatched",
            r"DataLoaderConfiguration\(dispatch_batches=True\) would share it again",
        ),
        ("split_empty_rank", "gave 1 of 2 ranks no batch in this epoch"),
    ],
)
def test_what_a_stream_that_splits_itself_cannot_do_is_refused_on_every_rank(
    launched, check, message
):
    ranks, _ = launched
    for rank in ranks:
        assert not rank[check]["ok"] or rank[check]["value"], rank[check]
        error = rank[check]["value"] if rank[check]["ok"] else rank[check]["error"]
        assert error.startswith("ValueError") and re.search(message, error)
    # and every rank went on in step
    assert check_values(ranks, "fit_after_refusals") == [[7, 7], [7, 7]]


@pytest.mark.multiprocess
def test_a_plain_stream_every_rank_reads_is_read_in_one_order(launched):
    ranks, _ = launched
    first, second = check_values(ranks, "shuffled_read_by_every_rank")
    assert first == second  # each epoch's order, alike on both ranks
    assert first[0] != first[1]  # drawn anew each epoch


def _read_after_resume(kind, rank):
    """What rank ``rank``'s stream yields in the resumed fit of
    ``streams_run.resumes``: from where the state saved after step 2 of epoch
    2 left it, then epoch 3 (the sample the kind is seen by is read from a
    copy of the stream)."""
    n = SIZES["partial"]
    if kind == "split":  # its own share, from its third batch on
        return _rows(rank, n) - 2 * BATCH + _rows(rank, n)
    if kind == "uneven":  # rank 0: 45 rows, 4 batches done; rank 1: its one batch again
        return [45 - 4 * BATCH + 45, 2 * BATCH][rank]
    if kind == "plain":  # the whole stream, after its second batch: 2 + rank
        return n - (2 + rank + 1) * BATCH + n
    return n - 2 * 2 * BATCH + n  # parts: two global batches read


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["plain", "split", "parts", "uneven"])
def test_a_stream_that_keeps_its_position_resumes_inside_an_epoch_exactly_reading_on(
    launched, kind
):
    ranks, _ = launched
    for rank, got in enumerate(check_values(ranks, f"resumed-{kind}")):
        assert got["resumed"] == got["uninterrupted"]  # bit for bit: weights, losses, counts
        # nothing read again: each rank's stream went on from where it stopped
        assert got["yielded"] == _read_after_resume(kind, rank)


@pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")  # torchdata on torch 2.13
@pytest.mark.parametrize("loader", ["DataLoader", "StatefulDataLoader"])
def test_on_one_process_a_stream_resumes_inside_an_epoch_exactly_reading_on(tmp_path, loader):
    """The stream keeps its position; the net reads it through torchdata's
    StatefulDataLoader, or the user's own (``iterator_train``)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    X, y = make_data(SIZES["partial"], seed=4)

    def fit(stream, folder, *callbacks):
        fresh_state()
        net = net_for(make_accelerator(cpu=True))
        checkpoint = TrainingCheckpoint(tmp_path / folder, every_n_batches=2)
        net.set_params(max_epochs=3, callbacks=[checkpoint, *callbacks])
        if loader == "StatefulDataLoader":
            net.set_params(iterator_train=StatefulDataLoader)
        return outcomes(net.fit(stream, None))

    uninterrupted = fit(Positioned(X, y), "uninterrupted")
    with pytest.raises(Stop):
        fit(Positioned(X, y), "stopped", StopAt(2, 3))
    stream = Positioned(X, y)
    resumed = fit(stream, "stopped", ResumeTraining(tmp_path / "stopped"))
    assert resumed == uninterrupted
    # the rest of epoch 2 after the state saved at its batch 2, then epoch 3
    assert stream.yielded == len(X) - 2 * BATCH + len(X)


def test_a_state_from_inside_an_epoch_of_a_dataset_does_not_resume_a_stream(tmp_path):
    X, y = make_data(SIZES["partial"], seed=4)
    fresh_state()
    saved = net_for(make_accelerator(cpu=True))
    inside = TrainingCheckpoint(tmp_path, every_n_batches=2)
    saved.set_params(max_epochs=3, callbacks=[inside, StopAt(2, 3)])
    with pytest.raises(Stop):
        saved.fit(X, y)  # a Dataset: saved inside epoch 2
    (state,) = tmp_path.glob("run-*/training-state-000001-batch-*")
    fresh_state()
    resumed = net_for(make_accelerator(cpu=True))
    # ResumeTraining would start afresh: other data make another run
    resumed.set_params(
        max_epochs=3, callbacks=[TrainingCheckpoint(tmp_path / "b", every_n_batches=2)]
    )
    resumed.initialize().load_state(state)
    with pytest.raises(ValueError, match="recorded no stream position"):
        resumed.partial_fit(Positioned(X, y), None)


@pytest.mark.multiprocess
def test_saves_inside_epochs_of_a_dispatched_stream_are_refused_on_every_rank(launched):
    ranks, _ = launched
    for rank in ranks:
        assert (
            "dispatch_batches=True) the main process reads it ahead"
            in rank["resume_dispatched"]["value"]
        )


def test_a_stream_is_plain_where_every_rank_agrees_and_split_where_each_differs():
    assert _kind([5, 5, 5]) == "plain"
    assert _kind([1, 2, 3]) == "split"
    assert _kind([1, _EMPTY]) == "split"  # a share without samples
    assert _kind([_EMPTY, _EMPTY]) == "plain"  # nothing anywhere
    assert _kind([1, 1, 2]) is None  # two ranks would train on the same samples
    assert _kind([1, 1, _EMPTY]) is None


class _Opaque:
    """A sample type without a value repr, as PIL's Image is."""

    def __init__(self, data):
        self.data = data


def test_fingerprints_follow_values_not_objects():
    # an object's repr names its address, a set's order its process's hash seed
    assert fingerprint(_Opaque([1, 2])) == fingerprint(_Opaque([1, 2]))
    assert fingerprint(_Opaque([1, 2])) != fingerprint(_Opaque([2, 1]))
    assert fingerprint({"b", "a"}) == fingerprint({"a", "b"})
    with pytest.raises(TypeError, match="neither pickles"):
        fingerprint(lambda: None)
    sample = (torch.arange(4.0), np.int64(3), {"mask": torch.ones(2, dtype=torch.bool)})
    same = (torch.arange(4.0), np.int64(3), {"mask": torch.ones(2, dtype=torch.bool)})
    assert fingerprint(sample) == fingerprint(same)
    assert fingerprint(torch.arange(4.0)) != fingerprint(torch.arange(1.0, 5.0))
    assert fingerprint(torch.zeros(2, 2)) != fingerprint(torch.zeros(4))  # the shape counts
    assert fingerprint(torch.zeros(2, dtype=torch.bfloat16)) == fingerprint(
        torch.zeros(2, dtype=torch.bfloat16)
    )


class _Augmenting(torch.utils.data.IterableDataset):
    """Draws from every global generator, and keeps a position."""

    def __init__(self):
        self.position = 7

    def __iter__(self):
        self.position += 1
        yield torch.rand(2), np.random.rand(), random.random()

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_the_first_sample_is_drawn_alike_and_leaves_every_state_as_it_was():
    stream = _Augmenting()
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    torch.manual_seed(1)
    first = _first_sample_print(stream)
    torch.manual_seed(2)  # another rank's generators
    assert _first_sample_print(stream) == first  # augmentation draws alike
    assert stream.position == 7  # its state_dict was put back
    torch.set_rng_state(before[0])
    assert torch.equal(torch.get_rng_state(), before[0])
    np.testing.assert_array_equal(np.random.get_state()[1], before[1])
    assert random.getstate() == before[2]
    assert _first_sample_print(iter_of([])) == _EMPTY


def test_the_first_sample_is_read_from_a_copy_of_a_stream_without_state_dict():
    stream = Plain(*make_data(40))  # counts what it yields, on itself
    _first_sample_print(stream)
    assert stream.yielded == 0  # the count went to the copy


def iter_of(items):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(items)

    return Stream()


class _Ended:
    """A GradientState at an epoch's last global batch of ``remainder`` samples."""

    def __init__(self, remainder):
        self.end_of_dataloader, self.remainder = True, remainder


@pytest.mark.parametrize(
    "processes, sizes, data_batch, remainder, counted",
    [
        # dispatched stream, 2 ranks, batches of 120: a last batch of 40 split 20/20
        (2, [(20, 20), (20, 20)], 120, 40, [True, False]),
        # its last two batches of the data, 200 samples, split 100/100
        (2, [(100, 100), (100, 100)], 120, 200, [True, True]),
        # split_batches, a global batch of 16: each rank holds 8 of one batch
        (2, [(8, 8), (8, 8)], 16, None, [True, False]),
        # map-style, padded: the second rank holds padding only
        (2, [(8, 5), (8, 0)], 8, 5, [True, False]),
        (3, [(8, 8), (8, 8), (8, 8)], 8, None, [True, True, True]),
    ],
)
def test_the_history_counts_the_batches_of_the_data(
    processes, sizes, data_batch, remainder, counted
):
    state = _Ended(remainder) if remainder is not None else GradientState()
    got = [
        counts_as_batch(state, processes, rank, size, data_batch) for rank, size in enumerate(sizes)
    ]
    assert got == counted
