"""The folder of shards of an earlier release's training state, in one
process: what a load reads back, the errors that name the file and the
folder, and which folders the removals keep.

Without a process group DCP reads and writes as one process, and a module
that is not sharded stands for one that is: the files are DCP's either way
(``tests/test_fsdp_resume.py`` runs the sharded layouts on several
processes).
"""

import os
import warnings

import pytest
import torch

from accel_mixin.checkpoint.v1_shards import (
    SHARDED,
    is_sharded_entry,
    load_sharded_best_weights,
    load_sharded_module,
    load_sharded_optimizer,
    remove_training_state,
)
from accel_mixin.errors import CheckpointError


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _trained(seed=0):
    module = _model(seed)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    for _ in range(2):
        module(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return module, optimizer


def save_shards(path, module, optimizers, best_weights):
    """The folder of shards an earlier release's save_state wrote beside
    ``path`` (its write side is gone; its folders still load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as api

    folder = f"{os.path.basename(path)}.shards-0123456789ab"
    state = {
        "module": api.get_model_state_dict(module),
        "optimizers": {
            name: api.get_optimizer_state_dict(module, optimizer)
            for name, optimizer in optimizers.items()
        },
        "best": best_weights,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # one process, without a group
        dcp.save(state, checkpoint_id=os.path.join(os.path.dirname(path), folder), no_dist=True)
    return folder


def _entry(folder, **more):
    return {SHARDED: folder, **more}


def test_a_round_trip_restores_weights_optimizer_and_best_weights(tmp_path):
    module, optimizer = _trained()
    best = {key: value + 1 for key, value in module.state_dict().items()}
    path = tmp_path / "state.pt"
    folder = save_shards(path, module, {"optimizer": optimizer}, {"stopping": best})
    assert folder.startswith("state.pt.shards-") and (tmp_path / folder / ".metadata").is_file()

    loaded, fresh = _model(1), None
    fresh = torch.optim.Adam(loaded.parameters(), lr=0.5)
    groups = [dict(group, params=[]) for group in optimizer.state_dict()["param_groups"]]
    load_sharded_module(loaded, path, _entry(folder), "module_")
    load_sharded_optimizer(
        loaded, fresh, path, _entry(folder, name="optimizer", param_groups=groups), "optimizer_"
    )
    for key, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    saved, restored = optimizer.state_dict(), fresh.state_dict()
    assert restored["param_groups"][0]["lr"] == 0.01
    for index, state in saved["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(restored["state"][index][name]), value)
    weights = load_sharded_best_weights(loaded, path, _entry(folder, name="stopping"), "best")
    assert all(torch.equal(weights[key], value) for key, value in best.items())


def test_a_missing_folder_is_named_with_the_file_and_the_fix(tmp_path):
    path = tmp_path / "state.pt"
    with pytest.raises(CheckpointError) as info:
        load_sharded_module(_model(0), path, _entry("state.pt.shards-abc"), "module_")
    message = str(info.value)
    assert str(path) in message and "state.pt.shards-abc" in message and "module_" in message
    assert "rank 0 finds no" in message and "filesystem every machine shares" in message
    assert "is damaged or unreadable (it is missing;" in message


def test_shards_of_another_model_are_refused_naming_the_file(tmp_path):
    module, _ = _trained()
    path = tmp_path / "state.pt"
    folder = save_shards(path, module, {}, {})
    other = torch.nn.Sequential(torch.nn.Linear(4, 2))
    with pytest.raises(CheckpointError) as info:
        load_sharded_module(other, path, _entry(folder), "module_")
    message = str(info.value)
    assert f"{path} does not fit module_" in message and folder in message
    assert "rank 0: ValueError: Size mismatch" in message and "module.0.weight" in message
    assert "initialize the net as it was when it was saved" in message


def test_markers_and_folder_names():
    assert is_sharded_entry({SHARDED: "x"}) and not is_sharded_entry({"weight": 1})
    assert not is_sharded_entry(None)


def _folders(directory):
    return sorted(name for name in os.listdir(directory) if ".shards-" in name)


def _make(directory, *names):
    for name in names:
        if ".shards-" in name:
            (directory / name).mkdir()
            (directory / name / ".metadata").write_bytes(b"")
        else:
            (directory / name).write_bytes(b"")


def test_removing_a_file_removes_its_folders_only(tmp_path):
    _make(tmp_path, "a.pt", "a.pt.shards-01", "a.pt.shards-02", "ab.pt.shards-03", "b.pt.shards-04")
    remove_training_state(tmp_path / "a.pt")
    # another file's folders stay, even one whose name begins alike
    assert _folders(tmp_path) == ["ab.pt.shards-03", "b.pt.shards-04"]


def test_rotation_removes_a_file_with_its_folders_and_a_state_folder(tmp_path):
    _make(tmp_path, "a.pt", "a.pt.shards-01", "b.pt", "b.pt.shards-02")
    remove_training_state(tmp_path / "a.pt")
    assert not (tmp_path / "a.pt").exists()
    assert _folders(tmp_path) == ["b.pt.shards-02"]
    (tmp_path / "training-state-000001").mkdir()
    (tmp_path / "training-state-000001" / ".metadata").write_bytes(b"")
    remove_training_state(tmp_path / "training-state-000001")
    assert sorted(os.listdir(tmp_path)) == ["b.pt", "b.pt.shards-02"]  # nothing set aside left
    remove_training_state(tmp_path / "gone.pt")  # nothing to remove: no error
