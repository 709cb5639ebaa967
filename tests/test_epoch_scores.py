"""Epoch scores from cached predictions, on the main process: the message
format on its own, then three real processes (launched/epoch_scores_checks.py)."""

import pickle

import pytest
import torch
from harness import check_values as values
from harness import run_processes
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, Checkpoint, EpochScoring
from skorch.callbacks.scoring import ScoringBase
from skorch.toy import make_classifier

from accel_mixin.distributed import epoch_scores
from accel_mixin.distributed.epoch_scores import everywhere, notify_scored


def nested():
    """Batch items as models return them: nested, of several dtypes, with a
    0-d tensor, a view that is not contiguous and values that are no tensors."""
    wide = torch.arange(24.0).reshape(4, 6)
    return [
        (
            torch.randn(5, 3),
            {"half": torch.ones(5, 2, dtype=torch.bfloat16), "flag": torch.rand(5) > 0.5},
        ),
        (
            wide[:, ::2],
            {"half": torch.zeros(0, 2, dtype=torch.bfloat16), "flag": torch.tensor(True)},
        ),
        ["a string", 3, None, torch.tensor(7, dtype=torch.int64)],
    ]


def assert_same(got, expected):
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype
        assert got.shape == expected.shape and torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert type(got) is type(expected) and got.keys() == expected.keys()
        for key in expected:
            assert_same(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for a, b in zip(got, expected):
            assert_same(a, b)
    else:
        assert got == expected


def test_a_layout_and_its_bytes_give_back_the_items():
    items = nested()
    layout, pairs, end = epoch_scores._layout(items)
    layout = pickle.loads(pickle.dumps(layout))  # as it travels
    slots = epoch_scores._slots(layout)
    assert [(s.start, s.nbytes) for s in slots] == [(p.start, p.nbytes) for _, p in pairs]
    assert all(s.start % 16 == 0 for s in slots) and end % 16 == 0
    data = torch.zeros(end, dtype=torch.uint8)
    for tensor, placed in pairs:
        data[placed.start : placed.start + placed.nbytes] = epoch_scores._bytes(tensor)
    assert_same(epoch_scores._filled(layout, data), items)


def test_small_tensors_travel_together_and_large_ones_alone(monkeypatch):
    monkeypatch.setattr(epoch_scores, "_CHUNK", 100)
    sizes = [40, 40, 40, 250, 8, 0, 8]
    _, pairs, _ = epoch_scores._layout([torch.zeros(n, dtype=torch.uint8) for n in sizes])
    runs = epoch_scores._runs([placed for _, placed in pairs])
    # starts are aligned to 16 bytes: 0, 48, 96, 144, 400, 416, 416
    assert runs == [[0, 88, [0, 1]], [96, 136, [2]], [144, 394, [3]], [400, 424, [4, 5, 6]]]


class OwnEnd(EpochScoring):
    def on_epoch_end(self, net, **kwargs):
        super().on_epoch_end(net, **kwargs)


def test_which_scorers_need_the_whole_predictions_on_every_rank():
    assert not everywhere(EpochScoring("accuracy"))
    assert everywhere(OwnEnd("accuracy"))  # it may read them its own way
    said = EpochScoring("accuracy")
    said.predictions_on_every_rank = True
    assert everywhere(said)
    denied = OwnEnd("accuracy")
    denied.predictions_on_every_rank = False
    assert not everywhere(denied)


class Looks(Callback):
    """At its turn: whether EpochScoring scores as skorch wrote it."""

    def on_epoch_end(self, net, **kwargs):
        self.skorch_scoring_ = EpochScoring._scoring is ScoringBase._scoring


class Bare(NeuralNetClassifier):
    def get_default_callbacks(self):
        return []


def test_scores_recorded_at_their_turn_leave_the_callbacks_and_their_class_alone(tmp_path):
    net = Bare(
        make_classifier(input_units=4),
        callbacks=[
            ("acc", EpochScoring("accuracy", name="acc", lower_is_better=False)),
            ("f1", EpochScoring("f1", name="f1", lower_is_better=False)),
            ("checkpoint", Checkpoint(monitor="acc_best", dirname=tmp_path, f_pickle="net.pkl")),
            ("looks", Looks()),
        ],
    ).initialize()
    net.history.new_epoch()
    net.history.new_batch()
    notify_scored(net, {"acc": (0.75, None), "f1": (None, None)})
    callbacks = dict(net.callbacks_)
    assert net.history[-1, "acc"] == 0.75 and net.history[-1, "acc_best"]
    assert callbacks["acc"].best_score_ == 0.75
    assert "f1" not in net.history[-1]  # no data: nothing recorded, as skorch does
    assert net.history[-1, "event_cp"]  # Checkpoint saw the score at its turn
    assert callbacks["looks"].skorch_scoring_
    with open(tmp_path / "net.pkl", "rb") as f:
        pickled = dict(pickle.load(f).callbacks_)["acc"]
    fresh = EpochScoring("accuracy", name="acc", lower_is_better=False).initialize()
    assert type(pickled) is EpochScoring and sorted(vars(pickled)) == sorted(vars(fresh))
    net.history.new_epoch()
    with pytest.raises(ValueError, match="bad scorer"):
        notify_scored(net, {"acc": (None, ValueError("bad scorer"))})


@pytest.fixture(scope="module")
def ranks():
    launch = run_processes("epoch_scores_checks.py", nproc=3, timeout=240)
    return [r["checks"] for r in launch.check()]


@pytest.mark.multiprocess
def test_cached_predictions_are_scored_once_on_the_main_process(ranks):
    results = values(ranks, "scored_once_on_main")
    main, others = results[0], results[1:]
    # 310 validation samples, batches of 16 over 3 ranks: 112, 102 and 96
    assert main["rows"] == {"on_main": 310, "everywhere": 310, "own": 310, "net_caches": 310}
    assert [r["rows"]["on_main"] for r in others] == [102, 96]
    assert [r["rows"]["net_caches"] for r in others] == [102, 96]
    for result in others:
        assert result["rows"]["everywhere"] == result["rows"]["own"] == 310
    # two epochs; the main process scores on_main and net_caches, every rank the others
    assert sorted(map(tuple, main["calls"])) == sorted(
        [(name, 310) for name in ("on_main", "net_caches", "everywhere", "own")] * 2
    )
    for result in others:
        assert sorted(map(tuple, result["calls"])) == sorted(
            [("everywhere", 310), ("own", 310)] * 2
        )
    assert main["cached_is_predict_proba"] and main["cached_targets_in_order"]


@pytest.mark.multiprocess
def test_recorded_scores_leave_the_callbacks_and_their_class_alone(ranks):
    results = values(ranks, "nothing_replaced_to_record_scores")
    for result in results:  # at the epoch's end, after the scorers and Checkpoint
        assert result["skorch_scoring"] == [True, True]
    # Checkpoint's f_pickle, written mid-epoch-end, holds the scorer as it is
    assert results[0]["pickled"] == results[0]["skorch_s"]


@pytest.mark.multiprocess
def test_every_rank_records_one_process_s_scores(ranks):
    results = values(ranks, "scored_once_on_main")
    for result in results:
        assert set(result["scores"].values()) == {result["accuracy"]}
        assert result["best"] == results[0]["best"]
    assert len({r["accuracy"] for r in results}) == 1


@pytest.mark.multiprocess
def test_nested_outputs_of_any_dtype_reach_the_main_process(ranks):
    results = values(ranks, "nested_outputs")
    for result in results:
        assert result["kinds"] == ["tuple", "torch.bfloat16", "torch.bool"]
        assert result["score"] == result["accuracy"]
        assert result["halves_match"]
    # the main process holds one process's 20 batches: the batch of padding
    # alone is not sent; rank 2 keeps its own
    assert [len(r["sizes"]) for r in results] == [20, 7, 7]


@pytest.mark.multiprocess
def test_batches_larger_than_a_chunk_arrive_in_order(ranks):
    results = values(ranks, "wide_outputs")
    assert results[0]["batch_bytes"] > epoch_scores._CHUNK
    assert all(r["inputs_in_order"] for r in results)
    assert len({r["score"] for r in results}) == 1


@pytest.mark.multiprocess
def test_a_scorer_s_error_on_the_main_process_reaches_every_rank_at_once(ranks):
    results = values(ranks, "scorer_error_reaches_every_rank")
    assert results[0]["error"] == "ValueError: bad scorer"
    for result in results[1:]:
        assert (
            result["error"]
            == "DistributedError: on_epoch_end failed on rank 0: ValueError: bad scorer"
        )
    # the process group gives up after 30 s
    assert max(r["seconds"] for r in results) < 20
    # every rank raises at the scorer's turn, none runs the callbacks after it
    assert [r["went_on"] for r in results] == [False] * len(results)
