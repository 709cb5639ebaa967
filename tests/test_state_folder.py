"""A training state as the keys of one DCP folder, on one process: what
``folder_state`` lays out, saved and read back whole, holds what the
single-file state holds, its tensors under parameter names."""

import concurrent.futures
import os
import threading
import time

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from common import MLP, AcceleratedNet
from skorch.callbacks import Callback, EarlyStopping, LRScheduler

from accel_mixin import CheckpointError
from accel_mixin.checkpoint.dcp_folder import (
    is_state_folder,
    read_full,
    save_folder,
    saved_keys,
    unplain,
)
from accel_mixin.checkpoint.state_saves import SaveInFlight, StateSaves
from accel_mixin.checkpoint.weights import clean_state_dict
from accel_mixin.errors import Stalled
from accel_mixin.resume.contents import BEST_WEIGHTS, partial_epoch, shared_state
from accel_mixin.resume.state_folder import FOLDER_VERSION, as_single_file, folder_state
from accel_mixin.training.rng import rng_state


def collect_state(net, objects, train_iterator_state, stopped=False, position=None, epoch_rng=None):
    """The reference: a state as the single file of version 1 laid it out,
    which reading a folder (``as_single_file``) must give back. The training
    state of ``net`` (``objects``: its objects, a
    ``training.net_objects.NetObjects``); every rank calls it (for the RNGs).

    ``train_iterator_state`` decides the next epoch's order (inside an epoch,
    that epoch's); ``stopped`` says that training ends here
    (``EarlyStopping``); ``position`` is ``(batches, batch_count)`` inside an
    epoch: the batches done, and how many of them held real samples, and
    ``epoch_rng`` this rank's generators as that epoch began.
    """
    accelerator = net.accelerator
    mine = {"rng": rng_state()}
    if position is not None:
        mine["partial"] = partial_epoch(net, position[1], epoch_rng)
    everyone = gather_object([mine]) if accelerator.num_processes > 1 else [mine]
    state = shared_state(net, objects, train_iterator_state, stopped=stopped, position=position)
    state["modules"] = {name: clean_state_dict(module) for name, module in objects.named_modules()}
    state["optimizers"] = {
        name: optimizer.state_dict() for name, optimizer in objects.raw_optimizers().items()
    }
    state["rng"] = [item["rng"] for item in everyone]
    state["loop"]["partial_epoch"] = (
        [item["partial"] for item in everyone] if position is not None else None
    )
    return state


def _net(**kwargs):
    params = dict(
        max_epochs=3,
        lr=0.1,
        batch_size=32,
        verbose=0,
        optimizer=torch.optim.Adam,
        callbacks=[
            # a threshold no epoch meets: the best stays epoch 1's, not the current
            ("stop", EarlyStopping(patience=5, threshold=10.0, load_best=True)),
            ("sched", LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1)),
        ],
    )
    params.update(kwargs)
    return AcceleratedNet(MLP, accelerator=Accelerator(cpu=True), **params)


def _fitted(data):
    torch.manual_seed(0)
    return _net().fit(*data)


SHUFFLING = {"generators": [], "iteration": None}


def test_a_folder_holds_the_single_file_state_under_parameter_names(data, tmp_path):
    net = _fitted(data)
    state = folder_state(net, net._objects, SHUFFLING)
    save_folder(state, tmp_path / "state")
    keys = saved_keys(tmp_path / "state")
    assert {"meta", "modules", "optimizers", "best_weights", "rng", "history", "loop"} <= set(keys)
    assert keys["rng"] == ["rng.rank-0"]  # each rank its own key
    assert "partial" not in keys  # saved between epochs

    read = read_full(tmp_path / "state")
    single = collect_state(net, net._objects, SHUFFLING)
    meta = unplain(read["meta"])
    assert meta["version"] == FOLDER_VERSION and meta["epoch"] == 3
    for key in ("history", "loop", "schedulers", "scaler"):
        expected = dict(single[key], partial_epoch=None) if key == "loop" else single[key]
        got = unplain(read[key])
        assert (dict(got, partial_epoch=None) if key == "loop" else got) == expected, key
    # the module's tensors, by name
    module = single["modules"]["module"]
    assert sorted(read["modules"]["module"]) == sorted(module)
    assert all(torch.equal(read["modules"]["module"][k], v) for k, v in module.items())
    # Adam's moments keyed by parameter names, not positions
    moments = read["optimizers"]["optimizer"]["state"]
    assert sorted(moments) == sorted(name for name, _ in net.module_.named_parameters())
    by_position = single["optimizers"]["optimizer"]["state"]
    for position, (name, _) in enumerate(net.module_.named_parameters()):
        assert torch.equal(moments[name]["exp_avg"], by_position[position]["exp_avg"])
    # EarlyStopping's best weights as tensors of their own, its counters plain
    stop = single["callbacks"]["stop"]
    assert stop[BEST_WEIGHTS] is not None  # epoch 1's, not the current ones
    best = read["best_weights"]["stop"]
    assert all(torch.equal(best[k], v) for k, v in stop[BEST_WEIGHTS].items())
    assert unplain(read["callbacks"])["stop"] == {
        k: v for k, v in stop.items() if k != BEST_WEIGHTS
    }
    assert unplain(read["rng.rank-0"])["torch"].dtype == torch.uint8


def test_a_state_inside_an_epoch_holds_this_ranks_part(data, tmp_path):
    net = _fitted(data)
    net.history.new_epoch()
    net.history.record("epoch", 4)
    state = folder_state(net, net._objects, SHUFFLING, position=(2, 2))
    save_folder(state, tmp_path / "state")
    read = read_full(tmp_path / "state", keys={"partial", "loop"})
    partial = unplain(read["partial.rank-0"])
    assert partial["batch_count"] == 2 and partial["row"]["epoch"] == 4
    assert unplain(read["loop"])["batches"] == 2


# --- saving through save_state's path (_save_state_folder) ------------------


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_commits_one_folder_and_then_says_so(data, tmp_path, asynchronous):
    net = _fitted(data)
    written = []
    path = tmp_path / "state"
    net.save_state(path, asynchronous=asynchronous, on_written=lambda: written.append(1))
    net.wait_for_saves()
    assert written == [1]
    assert is_state_folder(path)
    assert sorted(os.listdir(tmp_path)) == ["state"]  # no partial folder left
    read = read_full(path, keys={"modules", "history"})
    assert unplain(read["history"]) == list(net.history)
    weights = net.module_.state_dict()
    assert all(torch.equal(read["modules"]["module"][k], v) for k, v in weights.items())


def test_an_asynchronous_save_keeps_the_state_of_its_call(data, tmp_path):
    net = _fitted(data)
    before = {k: v.clone() for k, v in net.module_.state_dict().items()}
    net.save_state(tmp_path / "state", asynchronous=True)
    net.partial_fit(*data)  # trains on while the save is in flight
    net.wait_for_saves()
    read = read_full(tmp_path / "state", keys={"modules", "history"})
    assert len(unplain(read["history"])) == 3
    assert all(torch.equal(read["modules"]["module"][k], v) for k, v in before.items())


def test_asynchronous_saves_copy_into_the_kept_copy_and_each_keeps_its_call(data, tmp_path):
    net = _fitted(data)
    copies, states = [], []
    for name in ("one", "two", "three"):
        states.append({k: v.clone() for k, v in net.module_.state_dict().items()})
        net.save_state(tmp_path / name, asynchronous=True)
        stager = net._local.saves.kept  # pylint: disable=protected-access
        if stager is not None:
            # each parameter's storage maps to its CPU copy, the same one each save
            kept = stager._state_dict_stager._cached_storage_mapping  # pylint: disable=protected-access
            copies.append([id(kept[p.untyped_storage()]) for p in net.module_.parameters()])
        net.partial_fit(*data)  # trains on while the save is in flight
    net.wait_for_saves()
    assert copies == [] or copies[0] == copies[1] == copies[2]
    for name, before in zip(("one", "two", "three"), states):
        read = read_full(tmp_path / name, keys={"modules"})
        assert all(torch.equal(read["modules"]["module"][k], v) for k, v in before.items())
    # training went on between the saves: each holds the state of its own call
    assert any(not torch.equal(states[0][k], states[2][k]) for k in states[0])


def test_a_stalled_save_keeps_the_copy_it_writes_from():
    saves = StateSaves(kept=object())  # a stager whose copy the save writes from
    saves.in_flight = SaveInFlight("state", concurrent.futures.Future())  # never ends
    with pytest.raises(Stalled):
        saves.wait(io_timeout=0.01)
    # the next save stages into a copy of its own
    assert saves.kept is None
    done = concurrent.futures.Future()
    done.set_result(None)
    kept = saves.kept = object()
    saves.in_flight = SaveInFlight("state", done)  # a save that ended keeps it
    saves.wait(io_timeout=0.01)
    assert saves.kept is kept


def test_a_failed_save_names_the_state_and_leaves_the_previous_one(data, tmp_path):
    net = _fitted(data)
    path = tmp_path / "state"
    net.save_state(path)
    net.partial_fit(*data)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "rename", _refused)  # the commit fails: the disk is full
        with pytest.raises(CheckpointError, match=r"Cannot save the training state .*state: "):
            net.save_state(path)
    assert sorted(os.listdir(tmp_path)) == ["state"]  # its partial folder removed
    assert len(unplain(read_full(path, keys={"history"})["history"])) == 3  # the previous one


def _refused(*args):
    raise OSError(28, "No space left on device")


def test_a_stalled_asynchronous_save_ends_within_io_timeout():
    never = concurrent.futures.Future()
    with pytest.raises(Stalled, match=r"state-7 did not end within io_timeout=0.1 s"):
        SaveInFlight("state-7", never).wait(0.1)


def test_a_load_waits_for_its_own_net_s_save_not_for_another_s(data, tmp_path):
    writing, loading = _fitted(data), _fitted(data)
    loading.save_state(tmp_path / "loaded")
    loading.io_timeout = 30.0  # what a load waited for another net's stalled save
    committed = threading.Event()
    writing.save_state(tmp_path / "stuck", asynchronous=True, on_written=committed.wait)
    in_flight = writing._local.saves.in_flight  # pylint: disable=protected-access
    try:
        began = time.monotonic()
        loading.load_state(tmp_path / "loaded")  # while the other net's storage stalls
        assert time.monotonic() - began < 10.0
        assert not in_flight.future.done()
    finally:
        threading.Timer(1.0, committed.set).start()
    writing.load_state(tmp_path / "stuck")  # its own: waited for
    assert in_flight.future.done()


def test_a_fit_that_raises_finishes_its_save_in_flight_first(data, tmp_path):
    committed = threading.Event()

    def slowly_committed():
        time.sleep(1.0)  # the storage is slow
        committed.set()

    class SaveThenFail(Callback):
        def on_epoch_end(self, net, **kwargs):
            net.save_state(tmp_path / "state", asynchronous=True, on_written=slowly_committed)
            raise RuntimeError("boom")

    net = _net(max_epochs=1, callbacks=[SaveThenFail()])
    with pytest.raises(RuntimeError, match="boom"):
        net.fit(*data)
    # the fit's error comes once the save it left is committed, not before
    assert committed.is_set()
    assert net._local.saves.in_flight is None  # pylint: disable=protected-access


def test_load_state_resumes_from_a_folder_as_from_the_single_file(data, tmp_path):
    net = _fitted(data)
    net.save_state(tmp_path / "folder")
    net.save_state(tmp_path / "file.pt")
    resumed = []
    for source in ("folder", "file.pt"):
        other = _net(max_epochs=5)
        other.initialize()
        other.load_state(tmp_path / source)
        other.fit(*data)
        resumed.append(other)
    by_folder, by_file = resumed
    assert len(by_folder.history) == 5
    assert by_folder.history[:, "train_loss"] == by_file.history[:, "train_loss"]
    for (name, a), (_, b) in zip(
        by_folder.module_.named_parameters(), by_file.module_.named_parameters()
    ):
        assert torch.equal(a, b), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_on_two_processes_each_rank_writes_its_part_of_one_folder(tmp_path, layout):
    from harness import CheckedRanks, run_processes
    from harness import check_values as values

    ranks = CheckedRanks(
        run_processes("state_folder_checks.py", layout, tmp_path, nproc=2, timeout=300)
    )
    for check, epochs in (("synchronous", 2), ("asynchronous", 2)):
        for value in values(ranks, check):
            assert value["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
            assert value["beside"] == []  # no partial folder left
            assert value["rng"] == ["rng.rank-0", "rng.rank-1"]
            assert value["weights"]  # full weights, whatever the layout
            assert value["epochs"] == epochs  # the async save's state is its call's
            assert all(not key.isdigit() for key in value["moments"])  # parameter names
    rank0, rank1 = values(ranks, "commit_fails_on_rank_0")
    assert "CheckpointError: Cannot save the training state" in rank0["error"]
    assert "No space left on device" in rank0["error"]
    assert "Cannot save the training state" in rank1["error"]  # every rank raises
    for value in (rank0, rank1):
        assert value["epochs"] == 2 and value["beside"] == []  # the previous state


@pytest.mark.parametrize("position", [None, (2, 2)])
def test_a_folder_read_whole_is_the_single_file_state(data, tmp_path, position):
    net = _fitted(data)
    if position is not None:  # inside epoch 4
        net.history.new_epoch()
        net.history.record("epoch", 4)
    save_folder(folder_state(net, net._objects, SHUFFLING, position=position), tmp_path / "state")
    single = collect_state(net, net._objects, SHUFFLING, position=position)
    got = as_single_file(read_full(tmp_path / "state"))
    assert _differences(got, single) == []


def _differences(a, b, where=""):
    """Where ``a`` and ``b`` differ (tensors bitwise), as paths."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if sorted(map(str, a)) != sorted(map(str, b)):
            return [f"{where} keys"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}/{i}")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def test_a_state_left_aside_by_a_crash_between_the_renames_is_named(data, tmp_path):
    net = _fitted(data)
    path = tmp_path / "state"
    net.save_state(path)
    # what a crash between commit_folder's two renames leaves: no folder under the name
    aside = tmp_path / ".state.old-0123456789ab"
    os.rename(path, aside)
    with pytest.raises(CheckpointError) as info:
        net.load_state(path)
    assert f"{path} is missing, but {aside} holds the state saved there before" in str(info.value)
    assert f"Rename that folder to {path} to load it" in str(info.value)
