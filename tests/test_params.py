"""Checkpoint files users can trust, in one process: prefixes, clean keys,
atomic writes, safe loading, clear errors. The same in several processes:
test_files.py."""

import errno
import io
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from common import MLP, AcceleratedNet
from harness import ROOT
from skorch import NeuralNetClassifier

from accel_mixin import CheckpointError, SafeParamsMixin, strip_wrapper_prefixes
from accel_mixin.checkpoint.weights import (
    clean_state_dict,
    describe_content,
    history_error,
    load_module_state,
    read_error,
    read_state,
    unwrap_module,
)


class SafeNet(SafeParamsMixin, NeuralNetClassifier):
    """A plain skorch net with our save_params and load_params."""


class ScaledNLLLoss(torch.nn.NLLLoss):
    """A criterion with a parameter, saved with f_criterion."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, y_pred, y_true):
        return super().forward(y_pred, y_true) * self.scale


def nets():
    """Our nets, wrapped and not, and a plain skorch net with our loading."""
    wrapped = AcceleratedNet(MLP, accelerator=Accelerator(cpu=True), criterion=ScaledNLLLoss)
    unwrapped = AcceleratedNet(MLP, accelerator=Accelerator(cpu=True), criterion=ScaledNLLLoss)
    plain = SafeNet(MLP, criterion=ScaledNLLLoss)
    return {
        "accelerated, wrapped": wrapped.initialize(),
        "accelerated, unwrapped": unwrapped.initialize()._unwrap_accelerator(),
        "plain skorch": plain.initialize(),
    }


def reference_state():
    torch.manual_seed(1)
    return MLP().state_dict()


def prefixed(state, prefix):
    return OrderedDict((prefix + k, v) for k, v in state.items())


# --- 1. prefixes --------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix", ["module.", "module.module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."]
)
def test_strip_wrapper_prefixes(prefix):
    state = reference_state()
    wrapped = prefixed(state, prefix)
    stripped = strip_wrapper_prefixes(wrapped)
    assert list(stripped) == list(state)
    assert next(iter(wrapped)).startswith(prefix)  # the argument is left alone


def test_partial_prefix_is_left_alone():
    state = reference_state()
    mixed = OrderedDict((("module." + k) if "hidden" in k else k, v) for k, v in state.items())
    assert list(strip_wrapper_prefixes(mixed)) == list(mixed)


def test_prefixes_of_a_real_ddp_and_compiled_module_with_buffers():
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    holder = torch.nn.Module()
    holder.module = torch.compile(module, backend="eager")  # what DDP(compiled) saves
    state = holder.state_dict()
    assert all(k.startswith("module._orig_mod.") for k in state)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    fresh.load_state_dict(strip_wrapper_prefixes(state))


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
@pytest.mark.parametrize("name", ["accelerated, wrapped", "accelerated, unwrapped", "plain skorch"])
def test_prefixed_files_load_into_every_net(name, prefix, tmp_path):
    state = reference_state()
    criterion = {"scale": torch.tensor([2.5])}
    torch.save(prefixed(state, prefix), tmp_path / "params.pt")
    torch.save(prefixed(criterion, prefix), tmp_path / "criterion.pt")
    net = nets()[name]
    net.load_params(f_params=tmp_path / "params.pt", f_criterion=tmp_path / "criterion.pt")
    loaded = (
        net.accelerator.unwrap_model(net.module_) if hasattr(net, "accelerator") else net.module_
    )
    for key, value in state.items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    assert net.criterion_.scale.item() == 2.5


def test_partial_prefix_is_reported_with_the_keys_and_the_fix(tmp_path):
    state = reference_state()
    extra = OrderedDict(("encoder." + k, v) for k, v in state.items())
    torch.save(extra, tmp_path / "params.pt")
    net = nets()["accelerated, wrapped"]
    with pytest.raises(CheckpointError) as exc:
        net.load_params(f_params=tmp_path / "params.pt")
    msg = str(exc.value)
    assert str(tmp_path / "params.pt") in msg and "module_" in msg
    assert "missing keys (4): 'hidden.bias'" in msg
    assert "unexpected keys (4): 'encoder.hidden.bias'" in msg
    assert "prefix 'encoder.'" in msg


def test_long_key_lists_are_shortened(tmp_path):
    torch.save({f"layer{i}.weight": torch.zeros(1) for i in range(20)}, tmp_path / "params.pt")
    with pytest.raises(CheckpointError, match=r"unexpected keys \(20\): .* and 15 more"):
        nets()["plain skorch"].load_params(f_params=tmp_path / "params.pt")


# --- 2. clean keys ---------------------------------------------------------------


def test_compiled_net_saves_clean_keys_that_plain_nets_load(data, tmp_path):
    net = AcceleratedNet(
        MLP,
        accelerator=Accelerator(cpu=True),
        compile=True,
        compile__backend="eager",
        max_epochs=1,
        verbose=0,
    )
    net.fit(*data)
    net.save_params(f_params=tmp_path / "params.pt")
    keys = list(torch.load(tmp_path / "params.pt", weights_only=True))
    assert keys == ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
    plain = NeuralNetClassifier(MLP).initialize()  # skorch's own load_params
    plain.load_params(f_params=tmp_path / "params.pt")
    np.testing.assert_allclose(plain.predict_proba(data[0]), net.predict_proba(data[0]), rtol=1e-6)


def test_a_data_parallel_module_saves_and_loads_under_clean_keys():
    inner = MLP()
    wrapped = torch.nn.DataParallel(inner)  # without GPUs, it holds the module as it is
    assert unwrap_module(wrapped) is inner
    state = clean_state_dict(wrapped)
    assert list(state) == ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
    load_module_state(wrapped, prefixed(reference_state(), "module."), source="f", name="module_")
    torch.testing.assert_close(inner.state_dict(), reference_state())


# --- 3. atomic writes ---------------------------------------------------------------


def stray_files(directory):
    return [name for name in os.listdir(directory) if "accel_mixin-tmp" in name]


def test_saves_leave_no_temporary_files_and_usual_permissions(tmp_path):
    net = nets()["accelerated, wrapped"]
    for _ in range(3):
        net.save_params(f_params=tmp_path / "params.pt")
    deadline = time.monotonic() + 10  # the replaced file is deleted in the background
    while stray_files(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stray_files(tmp_path) == []
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "params.pt").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("mode", [0o600, 0o666, 0o640])
def test_a_replaced_file_keeps_its_mode(tmp_path, mode):
    (tmp_path / "params.pt").write_bytes(b"old")
    os.chmod(tmp_path / "params.pt", mode)
    nets()["accelerated, wrapped"].save_params(f_params=tmp_path / "params.pt")
    assert (tmp_path / "params.pt").stat().st_mode & 0o777 == mode


def test_any_name_the_filesystem_admits_saves(tmp_path):
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    net = nets()["accelerated, wrapped"]
    files = {
        "f_params": tmp_path / ("p" * (name_max - 3) + ".pt"),
        "f_optimizer": tmp_path / ("o" * (name_max - 3) + ".pt"),
        "f_history": tmp_path / ("h" * (name_max - 5) + ".json"),
    }
    net.save_params(**files)
    assert all(len(f.name) >= name_max - 1 for f in files.values())
    fresh = nets()["plain skorch"]
    fresh.load_params(**files)
    assert stray_files(tmp_path) == []


def test_temporary_names_are_short_and_each_saves_own(tmp_path):
    from accel_mixin.checkpoint import atomic_files as files

    names = set()
    for _ in range(3):
        fd, tmp = files._create_temporary(tmp_path / ("x" * 200))  # pylint: disable=protected-access
        os.close(fd)
        names.add(os.path.basename(tmp))
        assert len(os.path.basename(tmp)) < 50
    # one target's prefix, one name per save; each closed one is a leftover
    # that the next save of the target removes
    assert len(names) == 3 and len({name.rsplit("-", 1)[0] for name in names}) == 1
    assert len(stray_files(tmp_path)) == 1


def test_a_killed_saves_temporary_is_removed_by_the_next_save_and_by_rotation(tmp_path):
    from accel_mixin.checkpoint.atomic_files import atomic_write, remove_temporaries

    atomic_write(tmp_path / "params.pt", lambda f: f.write(b"whole"))
    assert stray_files(tmp_path) == []

    def killed(f):
        f.write(b"half")
        raise KeyboardInterrupt  # the cleanup of a killed process never runs

    unlink = os.unlink
    try:
        os.unlink = lambda path: None
        with pytest.raises(KeyboardInterrupt):
            atomic_write(tmp_path / "params.pt", killed)
        with pytest.raises(KeyboardInterrupt):
            atomic_write(tmp_path / "state-3.pt", killed)
    finally:
        os.unlink = unlink
    assert (tmp_path / "params.pt").read_bytes() == b"whole"  # the previous target survives
    assert len(stray_files(tmp_path)) == 2
    atomic_write(tmp_path / "params.pt", lambda f: f.write(b"again"))
    assert (tmp_path / "params.pt").read_bytes() == b"again"
    assert len(stray_files(tmp_path)) == 1  # another target's, whose name changes every save
    remove_temporaries(tmp_path)
    assert stray_files(tmp_path) == []


def test_concurrent_saves_of_the_same_file_never_tear_it_nor_take_each_others_file(tmp_path):
    from accel_mixin.checkpoint.atomic_files import atomic_files, remove_temporaries

    target = tmp_path / "params.pt"
    target.write_bytes(b"before")
    with atomic_files([target]) as (first,):
        with open(first, "wb") as f:
            f.write(b"first")
        remove_temporaries(tmp_path)  # a rotation meanwhile: the live save's file stays
        with atomic_files([target]) as (second,):  # the first is live: not a leftover
            assert second != first and os.path.exists(first)
            with open(second, "wb") as f:
                f.write(b"second")
        assert target.read_bytes() == b"second"
    assert target.read_bytes() == b"first"  # whole, whichever renamed last
    assert stray_files(tmp_path) == []


def test_a_save_whose_temporary_was_replaced_fails_and_leaves_the_target(tmp_path):
    # where nothing locks (or in the instant before a lock), another save may
    # still replace the file: the save notices and renames nothing
    from accel_mixin.checkpoint.atomic_files import atomic_files

    target = tmp_path / "params.pt"
    target.write_bytes(b"before")
    with pytest.raises(FileExistsError, match="replaced this save's temporary file"):
        with atomic_files([target]) as (first,):
            os.unlink(first)
            with open(first, "wb") as f:
                f.write(b"another save's half")
    assert target.read_bytes() == b"before"


def test_a_save_whose_temporary_was_removed_fails_and_leaves_the_target(tmp_path):
    from accel_mixin.checkpoint.atomic_files import atomic_files

    target = tmp_path / "params.pt"
    target.write_bytes(b"before")
    with pytest.raises(FileExistsError, match="replaced this save's temporary file"):
        with atomic_files([target]) as (first,):
            with open(first, "wb") as f:
                f.write(b"half")
            os.unlink(first)  # another save's rotation, where nothing locks
    assert target.read_bytes() == b"before"


def test_without_locks_saves_still_save_and_leftovers_stay(tmp_path, monkeypatch):
    from accel_mixin.checkpoint import atomic_files as files

    monkeypatch.setattr(files, "fcntl", None)  # Windows, or a filesystem without flock
    fd, leftover = files._create_temporary(tmp_path / "params.pt")  # pylint: disable=protected-access
    os.close(fd)  # as a killed save leaves it
    files.atomic_write(tmp_path / "params.pt", lambda f: f.write(b"saved"))
    assert (tmp_path / "params.pt").read_bytes() == b"saved"
    files.remove_temporaries(tmp_path)  # a live save's file cannot be told from it
    assert stray_files(tmp_path) == [os.path.basename(leftover)]


def test_a_leftover_that_cannot_be_opened_is_left_alone(tmp_path):
    from accel_mixin.checkpoint.atomic_files import remove_temporaries

    dangling = tmp_path / ".accel_mixin-tmp-0123456789abcdef-01234567.tmp"
    dangling.symlink_to(tmp_path / "gone")
    remove_temporaries(tmp_path)
    assert dangling.is_symlink()


def test_a_failing_save_leaves_the_previous_file(tmp_path, monkeypatch):
    net = nets()["accelerated, wrapped"]
    target = tmp_path / "params.pt"
    net.save_params(f_params=target)
    before = target.read_bytes()

    def broken_save(obj, f, *args, **kwargs):
        with open(f, "wb") as fh:  # torch.save is given the temporary file's name
            fh.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        net.save_params(f_params=target)
    assert target.read_bytes() == before
    assert stray_files(tmp_path) == []


def test_the_content_is_on_disk_before_the_rename(tmp_path, monkeypatch):
    # A crash of the machine (not of the process) after a rename of data still
    # in the page cache can leave the new name on an empty file: the content
    # is fsynced before the rename. The directory is not fsynced after it (as
    # DCP's commit does not): the name then holds the previous file or the new
    # one, each whole.
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src, dst):
        events.append(("replace", os.fspath(src)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    nets()["accelerated, wrapped"].save_params(f_params=tmp_path / "params.pt")
    monkeypatch.undo()
    ((_, temporary),) = [event for event in events if event[0] == "replace"]
    assert events == [
        ("fsync", temporary),
        ("replace", temporary),
    ]


WRITER = """
import sys, torch
path = sys.argv[1]
torch.save({'weight': torch.full((4,), 1.0)}, path)
print('first save done', flush=True)
from accel_mixin.checkpoint.atomic_files import atomic_write
big = {f'w{i}': torch.randn(1000, 1000) for i in range(100)}  # 400 MB
atomic_write(path, lambda tmp: torch.save(big, tmp), by_name=True)
print('second save done', flush=True)
"""


def test_a_writer_killed_mid_save_leaves_the_previous_file(tmp_path):
    target = tmp_path / "params.pt"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout.readline().strip() == "first save done"
        before = target.read_bytes()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill once the big write is under way
            temps = stray_files(tmp_path)
            if temps and os.path.getsize(tmp_path / temps[0]) > 10 * 2**20:
                break
            time.sleep(0.005)
        else:
            pytest.fail("the second save never started")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    assert target.read_bytes() == before
    assert torch.load(target, weights_only=True)["weight"].tolist() == [1.0] * 4
    assert stray_files(tmp_path)  # the killed writer's, until the next save
    nets()["plain skorch"].save_params(f_params=target)
    assert stray_files(tmp_path) == []


# --- 4. safe loading ---------------------------------------------------------------


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_file_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "code_ran"
    torch.save({"weight": Payload(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"Refused to load .*evil.pt.*weights_only"):
        nets()["accelerated, wrapped"].load_params(f_params=tmp_path / "evil.pt")
    assert not marker.exists()


def test_torch_load_kwargs_are_honoured(tmp_path, monkeypatch):
    seen = {}
    original = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: seen.update(kw) or original(*a, **kw))
    net = SafeNet(MLP, torch_load_kwargs={"weights_only": False}).initialize()
    net.save_params(f_params=tmp_path / "params.pt")
    net.load_params(f_params=tmp_path / "params.pt")
    assert seen["weights_only"] is False
    seen.clear()
    nets()["plain skorch"].load_params(f_params=tmp_path / "params.pt")
    assert seen["weights_only"] is True and seen["mmap"] is True


def test_safetensors_for_modules_and_criteria(tmp_path):
    net = nets()["accelerated, wrapped"]
    net.save_params(
        f_params=tmp_path / "p.safetensors",
        f_criterion=tmp_path / "c.safetensors",
        use_safetensors=True,
    )
    fresh = nets()["plain skorch"]
    fresh.load_params(
        f_params=tmp_path / "p.safetensors",
        f_criterion=tmp_path / "c.safetensors",
        use_safetensors=True,
    )
    for key, value in net.accelerator.unwrap_model(net.module_).state_dict().items():
        torch.testing.assert_close(fresh.module_.state_dict()[key], value)


def test_safetensors_refuses_optimizers_clearly(tmp_path):
    with pytest.raises(ValueError, match="safetensors stores tensors only"):
        nets()["accelerated, wrapped"].save_params(
            f_optimizer=tmp_path / "o.safetensors", use_safetensors=True
        )
    assert not (tmp_path / "o.safetensors").exists()


# --- 5. bad input -----------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    net = nets()["accelerated, wrapped"]
    net.save_params(
        f_params=tmp_path / "params.pt",
        f_optimizer=tmp_path / "opt.pt",
        f_history=tmp_path / "history.json",
    )
    return tmp_path


def test_missing_file(saved):
    with pytest.raises(FileNotFoundError, match=r"No checkpoint at .*nope.pt"):
        nets()["accelerated, wrapped"].load_params(f_params=saved / "nope.pt")


def test_truncated_file(saved):
    data = (saved / "params.pt").read_bytes()
    (saved / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut.pt is not a complete torch file"):
        nets()["accelerated, wrapped"].load_params(f_params=saved / "cut.pt")


def test_garbage_file(saved):
    # garbage makes torch's unpickler fail in many ways; every one of them
    # must come out as the same clear error
    net = nets()["plain skorch"]
    rng = np.random.default_rng(0)
    for _ in range(300):
        (saved / "noise.pt").write_bytes(rng.bytes(int(rng.integers(1, 2000))))
        with pytest.raises(CheckpointError, match=r"noise.pt is not a"):
            net.load_params(f_params=saved / "noise.pt")


def test_another_architecture_names_the_key_and_both_shapes(saved):
    wider = AcceleratedNet(MLP, module__hidden=64, accelerator=Accelerator(cpu=True)).initialize()
    with pytest.raises(CheckpointError) as exc:
        wider.load_params(f_params=saved / "params.pt")
    assert "'hidden.weight' has shape (32, 20) in the file but (64, 20) in the module" in str(
        exc.value
    )


def test_optimizer_of_another_model(saved):
    other = AcceleratedNet(
        torch.nn.Linear,
        module__in_features=20,
        module__out_features=2,
        accelerator=Accelerator(cpu=True),
    ).initialize()
    with pytest.raises(CheckpointError, match=r"opt.pt does not fit optimizer_"):
        other.load_params(f_optimizer=saved / "opt.pt")


def test_a_directory_where_a_file_is_expected(saved):
    with pytest.raises(IsADirectoryError, match="is a directory"):
        nets()["accelerated, wrapped"].load_params(f_params=saved)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        nets()["accelerated, wrapped"].save_params(f_params=saved)


def test_corrupt_history(saved):
    (saved / "history.json").write_text('{"epoch": ')
    with pytest.raises(CheckpointError, match=r"history\.json is not a history file"):
        nets()["accelerated, wrapped"].load_params(f_history=saved / "history.json")


def test_save_into_a_missing_directory(saved):
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        nets()["accelerated, wrapped"].save_params(f_params=saved / "missing" / "params.pt")


def immutable(path, on):
    out = subprocess.run(
        ["chattr", "+i" if on else "-i", str(path)], capture_output=True, check=False
    )
    return out.returncode == 0


def test_unwritable_target_keeps_the_previous_file(saved):
    before = (saved / "params.pt").read_bytes()
    if not immutable(saved, True):
        pytest.skip("chattr +i is not available: nothing here can make a file unwritable for root")
    try:
        with pytest.raises(PermissionError):
            nets()["accelerated, wrapped"].save_params(f_params=saved / "params.pt")
    finally:
        immutable(saved, False)
    assert (saved / "params.pt").read_bytes() == before
    assert stray_files(saved) == []


def test_files_of_plain_skorch_load(saved, data):
    """Files of skorch's own save_params load, and ours load into skorch."""
    plain = NeuralNetClassifier(MLP).initialize()
    plain.save_params(f_params=saved / "skorch.pt")
    ours = nets()["accelerated, wrapped"]
    ours.load_params(f_params=saved / "skorch.pt")
    np.testing.assert_array_equal(ours.predict_proba(data[0]), plain.predict_proba(data[0]))
    plain.load_params(f_params=saved / "params.pt")


def test_pickled_objects_in_history_are_not_needed(saved):
    """History files are JSON: nothing to unpickle."""
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads((saved / "history.json").read_bytes())


def test_a_safetensors_file_read_as_torch_gets_a_pointer(tmp_path):
    # torch 2.13 reads safetensors files itself; older releases fail, and
    # the error then points to use_safetensors=True
    from safetensors.torch import save_file

    from accel_mixin.checkpoint.weights import _safetensors_hint

    save_file({"w": torch.zeros(2)}, tmp_path / "p.safetensors")
    torch.save({"w": torch.zeros(2)}, tmp_path / "p.pt")
    assert "use_safetensors=True" in _safetensors_hint(tmp_path / "p.safetensors")
    assert _safetensors_hint(tmp_path / "p.pt") == ""
    assert _safetensors_hint(tmp_path / "missing") == ""


def test_a_truncated_safetensors_file_is_named(tmp_path):
    net = nets()["plain skorch"]
    net.save_params(f_params=tmp_path / "p.safetensors", use_safetensors=True)
    data = (tmp_path / "p.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=r"cut.safetensors is not a complete safetensors file"
    ):
        net.load_params(f_params=tmp_path / "cut.safetensors", use_safetensors=True)


def test_a_file_object_that_is_no_torch_file_is_a_clear_error():
    with pytest.raises(
        CheckpointError, match=r"is not a readable torch file \(corrupt\?\): "
    ) as exc:
        read_state(io.BytesIO(b"garbage"))
    assert "safetensors" not in str(exc.value)
    with pytest.raises(CheckpointError, match="is not a complete torch file"):
        read_state(io.BytesIO(b""))


def test_an_error_of_the_environment_is_raised_as_it_is(tmp_path, monkeypatch):
    torch.save({"w": torch.ones(1)}, tmp_path / "params.pt")

    def failing_disk(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(torch, "load", failing_disk)
    with pytest.raises(OSError, match="Input/output error") as exc:
        read_state(tmp_path / "params.pt")
    assert not isinstance(exc.value, CheckpointError)
    assert read_error("p.pt", MemoryError(), weights_only=True, use_safetensors=True) is None
    assert history_error("history.json", OSError(errno.EIO, "Input/output error")) is None
    error = CheckpointError("p.pt is bad")
    assert read_error("p.pt", error, weights_only=True) is error  # said already


def open_descriptors():
    return len(os.listdir("/proc/self/fd"))


def test_a_filesystem_that_refuses_chmod_still_saves_without_leaking(tmp_path, monkeypatch):
    # vfat, exFAT, some SMB and FUSE mounts: files have the mount's mode
    net = nets()["accelerated, wrapped"]

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    (tmp_path / "params.pt").write_bytes(b"")
    os.chmod(tmp_path / "params.pt", 0o666)  # a mode the umask would not give: a chmod is tried
    monkeypatch.setattr(os, "chmod", refuse)
    monkeypatch.setattr(os, "fchmod", refuse)
    before = open_descriptors()
    for _ in range(3):
        net.save_params(f_params=tmp_path / "params.pt")
    assert open_descriptors() == before
    fresh = nets()["plain skorch"]
    fresh.load_params(f_params=tmp_path / "params.pt")


def test_a_symlinked_target_keeps_its_link_and_updates_the_file(tmp_path):
    net = nets()["accelerated, wrapped"]
    (tmp_path / "store").mkdir()
    real = tmp_path / "store" / "params-v1.pt"
    real.write_bytes(b"old")
    link = tmp_path / "params.pt"
    link.symlink_to(real)
    net.save_params(f_params=link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes() != b"old"
    nets()["plain skorch"].load_params(f_params=link)


def write_as_another_user(path, umask):
    """An atomic torch.save in a forked child that runs as nobody with ``umask``;
    returns the child's exit status and the file's mode."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on
        status = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.umask(umask)
            from accel_mixin.checkpoint.atomic_files import atomic_write

            atomic_write(path, lambda tmp: torch.save({"w": torch.ones(2)}, tmp), by_name=True)
            status = 0
        finally:
            os._exit(status)  # pylint: disable=protected-access
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), os.stat(path).st_mode & 0o777


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to write as another user"
)
@pytest.mark.parametrize(
    "existing, umask, expected",
    [
        (0o444, 0o022, 0o444),  # a read-only target is replaced and stays read-only
        (None, 0o277, 0o400),  # a umask that removes the owner's write bit
        (0o644, 0o077, 0o644),  # a replaced file keeps its mode, whatever the umask
    ],
)
def test_modes_that_forbid_writing_by_name_still_save(existing, umask, expected):
    # root may write anything: the writer runs as another user, as users do
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="accel_mixin-modes-")  # a folder nobody can reach
    try:
        os.chmod(folder, 0o777)
        target = os.path.join(folder, "params.pt")
        if existing is not None:
            with open(target, "wb") as f:
                f.write(b"old")
            os.chown(target, 65534, 65534)
            os.chmod(target, existing)
        assert write_as_another_user(target, umask) == (0, expected)
        assert torch.equal(torch.load(target)["w"], torch.ones(2))
    finally:
        shutil.rmtree(folder)


# --- bad files and failed writes: errors that name the file and the cause -----


class RunsCode:
    """A pickle that calls ``function(*args)`` when loaded: the payloads users meet."""

    def __init__(self, function, *args):
        self.call = (function, args)

    def __reduce__(self):
        return self.call


@pytest.mark.parametrize(
    "payload",
    [
        (os.system, "true"),
        (subprocess.call, ["true"]),
        (eval, "1"),
        (exec, "x = 1"),
    ],
    ids=["os.system", "subprocess", "eval", "builtins.exec"],
)
def test_every_payload_that_would_run_code_is_refused_as_such(tmp_path, payload):
    torch.save({"weight": RunsCode(*payload)}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"Refused to load .*evil.pt: it holds objects whose"):
        nets()["accelerated, wrapped"].load_params(f_params=tmp_path / "evil.pt")


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize(
    "payload",
    [(os.system, "true"), (eval, "1")],
    ids=["os.system", "builtins.eval"],
)
def test_a_plain_pickle_that_would_run_code_is_refused_as_such(tmp_path, payload, protocol):
    # pickle.dump, not torch.save: torch refuses protocols 4 and 5 before it
    # reaches the call, which must still be named for what it is
    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump({"weight": RunsCode(*payload)}, f, protocol=protocol)
    refused = r"Refused to load .*evil.pkl: it holds objects whose unpickling would run code"
    with pytest.raises(CheckpointError, match=refused):
        nets()["accelerated, wrapped"].load_params(f_params=tmp_path / "evil.pkl")
    with pytest.raises(CheckpointError, match=refused):
        read_state(tmp_path / "evil.pkl")


@pytest.mark.parametrize("protocol", [0, 4])  # GLOBAL, STACK_GLOBAL
def test_a_plain_pickle_names_what_it_would_call(tmp_path, protocol):
    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump({"weight": RunsCode(os.system, "true")}, f, protocol=protocol)
    with pytest.raises(CheckpointError, match=r"would run code \(it calls posix\.system\)"):
        nets()["plain skorch"].load_params(f_params=tmp_path / "evil.pkl")


@pytest.mark.parametrize(
    ("content", "holds"),
    [
        (torch.ones(3), r"a single tensor of shape \(3,\)"),
        ([torch.ones(3)], "a list"),
        ({0: torch.ones(3)}, "keys are not names .*0 of type int"),
        (None, "None"),
    ],
    ids=["tensor", "list", "int keys", "None"],
)
def test_a_params_file_that_is_no_state_dict_says_what_it_holds(tmp_path, content, holds):
    torch.save(content, tmp_path / "params.pt")
    for net in nets().values():
        with pytest.raises(CheckpointError, match=rf"params.pt is not a state dict .*{holds}"):
            net.load_params(f_params=tmp_path / "params.pt")


def test_keys_of_another_model_are_not_taken_for_a_prefix():
    with pytest.raises(CheckpointError) as exc:
        load_module_state(
            torch.nn.Linear(2, 2),
            {"w": torch.zeros(2, 2), "b": torch.zeros(2)},
            source="other.pt",
            name="module_",
        )
    assert str(exc.value) == (
        "other.pt does not fit module_:\n"
        "  missing keys (2): 'bias', 'weight'\n"
        "  unexpected keys (2): 'b', 'w'\n"
        "  The file was saved from another architecture, or with other module parameters: "
        "initialize the net as it was when the file was saved."
    )
    assert describe_content({"b": 1, "a": 2}) == "a dict with the keys 'a', 'b'"


def test_an_optimizer_file_that_is_no_optimizer_state_says_what_it_holds(tmp_path):
    torch.save(torch.ones(3), tmp_path / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"optimizer.pt is not an optimizer state .*tensor"):
        nets()["accelerated, wrapped"].load_params(f_optimizer=tmp_path / "optimizer.pt")


def test_a_parent_path_that_is_a_file_is_named(tmp_path):
    (tmp_path / "runs").write_text("a file")
    with pytest.raises(NotADirectoryError, match=r"runs is a file, not a directory"):
        nets()["accelerated, wrapped"].save_params(f_params=tmp_path / "runs" / "p.pt")


@pytest.fixture
def small_disk(tmp_path):
    """A mount of 64 KiB, or a skip where this user cannot mount one."""
    mount = tmp_path / "small"
    mount.mkdir()

    def mounted(*options):
        command = ["mount", "-t", "tmpfs", "-o", ",".join(["size=64k", *options]), "tmpfs"]
        if subprocess.run([*command, str(mount)], capture_output=True, check=False).returncode:
            pytest.skip("mounting a small tmpfs needs root")
        return mount

    yield mounted
    # lazily: a failed torch.save may hold its file open until collected
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


class Big(torch.nn.Module):
    """A module whose file does not fit in 64 KiB."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(20, 2000)

    def forward(self, X):
        return torch.softmax(self.lin(X)[:, :2], dim=-1)


def test_a_full_disk_is_named_and_leaves_the_previous_files(small_disk):
    disk = small_disk()
    small = nets()["accelerated, wrapped"]
    files = dict(f_params=disk / "params.pt", f_history=disk / "history.json")
    small.save_params(**files)
    before = {name: f.read_bytes() for name, f in files.items()}
    big = AcceleratedNet(Big, accelerator=Accelerator(cpu=True)).initialize()
    with pytest.raises(OSError, match=r"Cannot save .*params.pt.*: no space is left on the device"):
        big.save_params(**files)
    assert {name: f.read_bytes() for name, f in files.items()} == before
    assert stray_files(disk) == []


def test_a_read_only_filesystem_is_named(small_disk):
    disk = small_disk("ro")
    with pytest.raises(
        OSError, match=r"Cannot save .*params.pt: .* is on a read-only filesystem"
    ) as raised:
        nets()["accelerated, wrapped"].save_params(f_params=disk / "params.pt")
    # the target, not the temporary file written in its place
    assert ".accel_mixin-tmp" not in str(raised.value)


def test_files_of_separate_saves_load_as_in_skorch(tmp_path):
    # skorch's load_params loads the files it is given: two calls' files
    # (params of epoch 2, optimizer of epoch 3) load together
    net = nets()["accelerated, wrapped"]
    net.save_params(f_params=tmp_path / "params_e1.pt", f_optimizer=tmp_path / "opt_e1.pt")
    net.save_params(f_params=tmp_path / "params_e2.pt")
    net.optimizer_.param_groups[0]["lr"] = 0.5  # the later save's, to see it loaded
    net.save_params(f_optimizer=tmp_path / "opt_e3.pt")
    an_epoch_ago = time.time() - 60
    os.utime(tmp_path / "params_e2.pt", (an_epoch_ago, an_epoch_ago))
    for fresh in nets().values():
        fresh.load_params(f_params=tmp_path / "params_e2.pt", f_optimizer=tmp_path / "opt_e3.pt")
        assert fresh.optimizer_.param_groups[0]["lr"] == 0.5


def test_one_file_saved_again_after_a_joint_save_loads_with_the_other(tmp_path):
    # as in a skorch Checkpoint folder: params saved alone after a joint save
    net = nets()["accelerated, wrapped"]
    files = dict(f_params=tmp_path / "params.pt", f_optimizer=tmp_path / "optimizer.pt")
    net.save_params(**files)
    with torch.no_grad():
        net.module_.hidden.weight.fill_(0.25)
    net.save_params(f_params=files["f_params"])
    fresh = nets()["accelerated, wrapped"]
    fresh.load_params(**files)
    assert bool((fresh.module_.hidden.weight == 0.25).all())


@pytest.mark.parametrize(
    "files",
    [["params.pt"], ["params.pt", "optimizer.pt", "history.json"]],
    ids=["one file", "several files"],
)
def test_save_params_writes_only_the_files_it_is_given(tmp_path, files):
    keys = {"params.pt": "f_params", "optimizer.pt": "f_optimizer", "history.json": "f_history"}
    net = nets()["accelerated, wrapped"]
    for _ in range(2):
        net.save_params(**{keys[name]: tmp_path / name for name in files})
    assert sorted(os.listdir(tmp_path)) == sorted(files)


@pytest.mark.parametrize("kind", ["directory", "garbage"])
def test_what_is_named_like_the_old_record_is_left_alone(tmp_path, kind):
    # earlier releases kept a record of saves there; what is there now is not ours
    record = tmp_path / ".accel_mixin-sets.json"
    if kind == "directory":
        record.mkdir()
    else:
        record.write_bytes(b"\x00 not json")
    files = dict(f_params=tmp_path / "params.pt", f_optimizer=tmp_path / "optimizer.pt")
    nets()["accelerated, wrapped"].save_params(**files)
    nets()["accelerated, wrapped"].save_params(f_params=files["f_params"])
    nets()["accelerated, wrapped"].load_params(**files)
    assert record.is_dir() if kind == "directory" else record.read_bytes() == b"\x00 not json"


def test_files_of_one_save_load_together(tmp_path):
    net = nets()["accelerated, wrapped"]
    files = dict(
        f_params=tmp_path / "params.pt",
        f_optimizer=tmp_path / "optimizer.pt",
        f_history=tmp_path / "history.json",
    )
    for _ in range(3):
        net.save_params(**files)
        nets()["accelerated, unwrapped"].load_params(**files)


def test_a_denied_permission_is_named(tmp_path, monkeypatch):
    # as root every directory is writable: the refusal a user gets, simulated
    import errno

    from accel_mixin.checkpoint import atomic_files as files

    def refused(path):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(files, "_create_temporary", refused)
    with pytest.raises(OSError, match=r"Cannot save .*params.pt: permission to write in .* denied"):
        nets()["accelerated, wrapped"].save_params(f_params=tmp_path / "params.pt")
