"""skorch's DistributedHistory: accepted, set aside, and the same as a plain
History, on one process and on two (launched/history_checks.py)."""

import pickle
import warnings

import pytest
import torch
from accelerate import Accelerator
from common import MLP, AcceleratedNet
from harness import check_values as values
from harness import free_port, run_processes
from sklearn.base import clone
from skorch import NeuralNetClassifier
from skorch.history import DistributedHistory, History
from torch.distributed import TCPStore

from accel_mixin.distributed.history_sync import NOTICE


@pytest.fixture(scope="module")
def store():
    return TCPStore("127.0.0.1", free_port(), world_size=1, is_master=True)


def make_net(history=None, **kwargs):
    torch.manual_seed(0)
    return AcceleratedNet(
        MLP, accelerator=Accelerator(), max_epochs=2, verbose=0, history=history, **kwargs
    )


def untimed(history):
    return [{k: v for k, v in row.items() if k != "dur"} for row in history]


def notices(caught):
    return [w for w in caught if str(w.message) == NOTICE]


# --- one process ------------------------------------------------------------


def test_a_distributed_history_trains_as_a_plain_history(store, data):
    dist_history = DistributedHistory(store=store, rank=0, world_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = make_net(dist_history).fit(*data)
        net.fit(*data)  # the net says it once
        net.set_params(max_epochs=2)
    plain = make_net().fit(*data)
    plain.fit(*data)
    assert len(notices(caught)) == 1 and "\n" not in NOTICE
    assert type(net.history) is History
    assert untimed(net.history) == untimed(plain.history)
    assert untimed(dist_history) == untimed(plain.history)  # the user's view
    for ours, theirs in zip(net.module_.parameters(), plain.module_.parameters()):
        assert torch.equal(ours, theirs)
    store.set("after fit", "the user's")  # never closed, never cleared
    assert store.get("after fit") == b"the user's"
    assert len(pickle.loads(pickle.dumps(net)).history) == 2


def test_clone_and_get_params_as_in_skorch(store, data):
    def made(cls, **kwargs):
        return cls(MLP, history=DistributedHistory(store=store, rank=0, world_size=1), **kwargs)

    ours, theirs = made(AcceleratedNet, accelerator=Accelerator()), made(NeuralNetClassifier)
    # the history is no parameter: a clone starts with a plain History, as in skorch
    assert "history" not in ours.get_params() and "history" not in theirs.get_params()
    for net in (ours, clone(ours)):
        assert clone(net).history_ is None is clone(theirs).history_
    ours.set_params(max_epochs=1, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours.fit(*data)
    fitted_clone = clone(ours).fit(*data)
    assert type(fitted_clone.history) is History and len(fitted_clone.history) == 1


def test_the_notice_is_the_main_process_s(store, monkeypatch):
    net = make_net().initialize()
    monkeypatch.setattr(type(net.accelerator), "is_main_process", property(lambda self: False))
    # set_params of a module's parameter checks the parameters again,
    # outside initialize()'s silence
    net.history = DistributedHistory(store=store, rank=1, world_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.set_params(module__hidden=16)
    assert notices(caught) == [] and type(net.history) is History


# --- two processes ----------------------------------------------------------


@pytest.fixture(scope="module")
def launch():
    return run_processes("history_checks.py", free_port(), timeout=240)


@pytest.fixture(scope="module")
def ranks(launch):
    return [r["checks"] for r in launch.check()]


@pytest.mark.multiprocess
def test_rows_and_weights_equal_a_plain_history_on_every_rank(ranks):
    per_rank = values(ranks, "same_as_plain_history")
    for value in per_rank:
        assert value["rows_on_every_rank"] and value["weights_on_every_rank"]
        assert value["rows"] == value["plain_rows"] == value["users_view"]
        assert value["weights"] == value["plain_weights"]
        assert value["history_type"] == "History"
        assert not value["through_store"]  # nothing recorded twice
        assert value["store_after_fit"] == "still mine"
        batches = [len(row["batches"]) for row in value["rows"]]
        # 200 samples to train, 50 to validate, batches of 16: 13 + 4 a row
        assert batches == [17, 17, 17], batches
    assert per_rank[0]["rows"] == per_rank[1]["rows"]


@pytest.mark.multiprocess
def test_load_best_and_load_init_state_with_a_distributed_history(ranks):
    for check in ("load_best", "load_init_state"):
        per_rank = values(ranks, check)
        for value in per_rank:
            assert value["rows"] == value["plain_rows"], check
            assert value["equal_weights"] and value["rows_on_every_rank"], check
        assert per_rank[0]["rows"] == per_rank[1]["rows"], check
    for value in values(ranks, "load_init_state"):
        assert value["epochs"] == 4 and value["weights_on_every_rank"]


@pytest.mark.multiprocess
def test_the_notice_is_one_line_on_rank_0_only(launch):
    (out0, err0), (out1, err1) = launch.rank_outputs
    lines = [line for line in (out0 + err0).splitlines() if NOTICE in line]
    # three nets were given a DistributedHistory; each says it at most once
    assert 1 <= len(lines) <= 3, out0 + err0
    assert all(line.endswith(NOTICE) for line in lines)
    assert NOTICE not in out1 + err1
    assert "DistributedHistory" not in out1 + err1
