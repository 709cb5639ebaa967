"""The DCP folder of one training state, on one process: a round trip of
tensors and plain values, the rename that commits it, what killed saves
leave and their removal, asynchronous saves, and loading that runs no
pickled code (neither in plain values nor in DCP's ``.metadata``)."""

import os
import pickle

import pytest
import torch

from accel_mixin.checkpoint import dcp_folder
from accel_mixin.checkpoint.dcp_folder import (
    load_folder,
    partial_folder,
    plain,
    remove_partial_folders,
    save_folder,
    unplain,
)


class Called(Exception):
    pass


def _called():
    raise Called("a pickled call ran")


class Evil:
    def __reduce__(self):
        return (_called, ())


def _trained():
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return module, optimizer


def _state(module, optimizer, history):
    return {
        "module": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "history": plain(history),
        "rng.rank-0": plain(torch.get_rng_state()),
    }


def _empty():
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # DCP fills tensors in place: the state must exist
    return module, optimizer


def test_a_state_round_trips_and_nothing_but_the_folder_is_left(tmp_path):
    module, optimizer = _trained()
    history = [{"epoch": 1, "loss": 0.5, "tensor": torch.tensor([1.0, 2.0])}]
    save_folder(_state(module, optimizer, history), tmp_path / "state")
    assert sorted(os.listdir(tmp_path)) == ["state"]
    assert dcp_folder.is_state_folder(tmp_path / "state")
    other, other_optimizer = _empty()
    target = {
        "module": other.state_dict(),
        "optimizer": other_optimizer.state_dict(),
        "history": None,
        "rng.rank-0": None,
    }
    load_folder(target, tmp_path / "state")
    for key, value in module.state_dict().items():
        assert torch.equal(target["module"][key], value)
    exp_avg = target["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, optimizer.state_dict()["state"][0]["exp_avg"])
    loaded = unplain(target["history"])
    assert loaded[0]["loss"] == 0.5 and torch.equal(loaded[0]["tensor"], history[0]["tensor"])
    assert unplain(target["rng.rank-0"]).dtype == torch.uint8


def test_a_second_save_replaces_the_first_whole(tmp_path):
    module, optimizer = _trained()
    save_folder(_state(module, optimizer, [1]), tmp_path / "state")
    save_folder(_state(module, optimizer, [1, 2]), tmp_path / "state")
    assert sorted(os.listdir(tmp_path)) == ["state"]
    target = load_folder({"history": None}, tmp_path / "state", partial=True)
    assert unplain(target["history"]) == [1, 2]


def test_a_commit_that_fails_leaves_the_previous_state(tmp_path, monkeypatch):
    module, optimizer = _trained()
    save_folder(_state(module, optimizer, [1]), tmp_path / "state")
    rename = os.rename

    def failing(src, dst):
        if os.path.basename(os.fspath(src)).startswith(".state" + dcp_folder.PARTIAL):
            raise OSError("no space left on device")
        rename(src, dst)

    monkeypatch.setattr(dcp_folder.os, "rename", failing)
    with pytest.raises(OSError, match="no space"):
        save_folder(_state(module, optimizer, [1, 2]), tmp_path / "state")
    monkeypatch.undo()
    # the previous state, back under its name
    target = load_folder({"history": None}, tmp_path / "state", partial=True)
    assert unplain(target["history"]) == [1]


def test_a_killed_save_leaves_a_partial_folder_only_and_it_is_removed(tmp_path):
    import torch.distributed.checkpoint as dcp

    module, optimizer = _trained()
    save_folder(_state(module, optimizer, [1]), tmp_path / "state")
    # what a save killed before its commit leaves: DCP's folder, not renamed
    killed = partial_folder(tmp_path / "state", "0123456789ab")
    with pytest.warns(UserWarning):
        dcp.save(_state(module, optimizer, [1, 2]), checkpoint_id=killed, no_dist=True)
    target = load_folder({"history": None}, tmp_path / "state", partial=True)
    assert unplain(target["history"]) == [1]  # the committed one
    remove_partial_folders(str(tmp_path), "state")
    assert sorted(os.listdir(tmp_path)) == ["state"]


def test_an_asynchronous_save_commits_when_its_future_ends(tmp_path):
    module, optimizer = _trained()
    committed = []
    future = save_folder(
        _state(module, optimizer, [3]),
        tmp_path / "state",
        asynchronous=True,
        on_committed=lambda: committed.append(True),
    )
    future.result()
    assert committed == [True]
    assert sorted(os.listdir(tmp_path)) == ["state"]
    target = load_folder({"history": None}, tmp_path / "state", partial=True)
    assert unplain(target["history"]) == [3]


def test_plain_values_that_would_run_code_are_refused(tmp_path):
    save_folder({"callbacks": plain({"mine": Evil()})}, tmp_path / "state")
    with pytest.raises(BaseException, match=r"weights_only|Unsupported global|allowed global"):
        load_folder({"callbacks": None}, tmp_path / "state")
    with pytest.raises(BaseException, match="a pickled call ran"):
        load_folder(
            {"callbacks": None}, tmp_path / "state", torch_load_kwargs={"weights_only": False}
        )


def test_a_metadata_file_that_would_run_code_is_refused(tmp_path):
    module, optimizer = _trained()
    save_folder(_state(module, optimizer, [1]), tmp_path / "state")
    with open(tmp_path / "state" / ".metadata", "wb") as file:
        pickle.dump(Evil(), file)
    with pytest.raises(BaseException, match=r"not what a DCP \.metadata holds"):
        load_folder({"history": None}, tmp_path / "state", partial=True)


@pytest.mark.multiprocess
def test_two_processes_save_one_folder_that_loads_on_each_and_on_one(tmp_path):
    from harness import CheckedRanks, run_plain, run_processes
    from harness import check_values as values

    saved = CheckedRanks(run_processes("dcp_folder_checks.py", "save", tmp_path, nproc=2))
    for check in ("synchronous", "asynchronous"):
        for value in values(saved, check):
            assert value["module"] and value["rng"]  # each rank its own generators
            assert value["history"] == [{"epoch": 1}]
            assert value["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
            assert all(not name.startswith(".") for name in value["beside"])
    (value,) = values(
        CheckedRanks(run_plain("dcp_folder_checks.py", "load", tmp_path)), "on_one_process"
    )
    assert value["keys"] == {"history": ["history"], "rng": ["rng.rank-0", "rng.rank-1"]}
    assert value["module"] and value["rank_1"]


def test_read_full_gives_back_the_nested_entries_whole(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    history = [{"epoch": 1, "loss": 0.25}]
    save_folder(
        {"modules": {"module": module.state_dict()}, "history": plain(history)}, tmp_path / "s"
    )
    read = dcp_folder.read_full(tmp_path / "s")
    assert sorted(read) == ["history", "modules"]
    assert unplain(read["history"]) == history
    saved = module.state_dict()
    assert sorted(read["modules"]["module"]) == sorted(saved)  # dotted names kept whole
    assert all(torch.equal(read["modules"]["module"][k], v) for k, v in saved.items())
    assert sorted(dcp_folder.read_full(tmp_path / "s", keys={"history"})) == ["history"]
