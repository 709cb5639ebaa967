"""Checkpoints at fsspec URLs (``checkpoint/storage.py``, ``object_states.py``,
``remote_files.py``), against a real S3 server.

The server is moto's, run as its own process on localhost
(``python -m moto.server``), which speaks S3's HTTP API: the tests and the
launched ranks reach it over TCP through s3fs and botocore, as they would
reach AWS or MinIO, with nothing patched in-process. moto rather than MinIO:
it installs from PyPI with pip, pinned beside the other test dependencies,
where MinIO is a server binary from outside the package registries.
"""

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import numpy as np
import pytest
import torch
from common import MLP, AcceleratedNet, fresh_state, make_accelerator, make_data
from harness import check_values, free_port, run_nodes, run_plain

from accel_mixin.checkpoint import object_states, storage
from accel_mixin.checkpoint.dcp_folder import is_state_folder
from accel_mixin.errors import CheckpointError

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3():
    """The environment of an S3 server on localhost, for this process and
    the launched ones; stopped once the module's tests ran."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"the moto S3 server did not start on {endpoint}")
            time.sleep(0.2)
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def bucket(s3):
    """A new bucket's URL."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    storage.makedirs(f"s3://{name}")
    return f"s3://{name}"


def _net(**kwargs):
    fresh_state()
    torch.manual_seed(0)
    return AcceleratedNet(
        MLP, accelerator=make_accelerator(), max_epochs=1, verbose=0, batch_size=32, **kwargs
    )


def _weights(net):
    return [p.detach().clone() for p in net.module_.parameters()]


X, y = make_data(100)


@pytest.mark.parametrize("scheme", ["s3", "memory", "file"])
def test_save_params_and_load_params_take_urls(bucket, tmp_path, scheme):
    base = {
        "s3": bucket,
        "memory": f"memory://{uuid.uuid4().hex}",
        "file": f"file://{tmp_path}",
    }[scheme]
    net = _net(optimizer=torch.optim.Adam).fit(X, y)
    files = {
        "f_params": f"{base}/params.pt",
        "f_optimizer": f"{base}/optimizer.pt",
        "f_history": f"{base}/history.json",
    }
    net.save_params(**files)
    loaded = _net(optimizer=torch.optim.Adam).initialize()
    loaded.load_params(**files)
    for got, want in zip(_weights(loaded), _weights(net)):
        assert torch.equal(got, want)
    assert len(loaded.history) == 1
    assert loaded.optimizer_.state_dict()["state"]
    if scheme == "file":
        assert sorted(os.listdir(tmp_path)) == ["history.json", "optimizer.pt", "params.pt"]


def test_load_params_of_a_missing_url_names_it(bucket):
    net = _net().initialize()
    with pytest.raises(FileNotFoundError, match=f"No checkpoint at {bucket}/missing.pt"):
        net.load_params(f_params=f"{bucket}/missing.pt")


def test_a_damaged_file_at_a_url_is_named_by_its_url(bucket):
    storage.write_bytes(f"{bucket}/params.pt", b"not a checkpoint")
    net = _net().initialize()
    with pytest.raises(CheckpointError) as info:
        net.load_params(f_params=f"{bucket}/params.pt")
    assert f"{bucket}/params.pt" in str(info.value)
    assert "accel_mixin-download" not in str(info.value)


def test_an_unknown_protocol_names_the_package_to_install():
    net = _net().initialize()
    with pytest.raises(ValueError, match=r"nosuchfs://.*Install its package"):
        net.load_params(f_params="nosuchfs://bucket/params.pt")


def test_a_listing_sees_what_another_process_wrote_since(bucket):
    """fsspec caches listings per client: another rank's client (here a
    second one, as another process has) writes behind this one's back."""
    import s3fs  # pylint: disable=import-outside-toplevel

    storage.write_bytes(f"{bucket}/runs/a", b"1")
    assert storage.listdir(f"{bucket}/runs") == ["a"]
    other = s3fs.S3FileSystem(skip_instance_cache=True)
    other.pipe_file(f"{bucket.removeprefix('s3://')}/runs/b", b"2")
    assert sorted(storage.listdir(f"{bucket}/runs")) == ["a", "b"]
    assert storage.exists(f"{bucket}/runs/b")


def test_save_state_commits_a_new_version_and_removes_the_old(bucket):
    net = _net().fit(X, y)
    state = f"{bucket}/state"
    net.save_state(state)
    first = object_states.committed_version(state)
    net.partial_fit(X, y)
    net.save_state(state)
    second = object_states.committed_version(state)
    assert first != second
    # the marker and the one version it names
    assert sorted(storage.listdir(state)) == sorted(
        [object_states.MARKER, storage.split(second)[1]]
    )
    loaded = _net().initialize()
    loaded.load_state(state)
    assert len(loaded.history) == 2
    for got, want in zip(_weights(loaded), _weights(net)):
        assert torch.equal(got, want)


def test_a_state_without_a_commit_is_no_state(bucket):
    state = f"{bucket}/state"
    # what a save killed before its commit leaves of a new state
    storage.write_bytes(f"{state}/v-0123456789ab/__0_0.distcp", b"half")
    assert not is_state_folder(state)
    net = _net().initialize()
    with pytest.raises(CheckpointError, match=f"{state} has no committed.json"):
        net.load_state(state)
    object_states.remove_uncommitted(bucket)
    assert not storage.exists(state)


def test_an_edited_marker_is_named(bucket):
    state = f"{bucket}/state"
    _net().fit(X, y).save_state(state)
    storage.write_bytes(f"{state}/{object_states.MARKER}", b"{}")
    with pytest.raises(CheckpointError, match=f"{state}/committed.json is not the commit marker"):
        _net().initialize().load_state(state)


def test_a_save_killed_before_its_commit_leaves_the_previous_state(bucket, s3):
    """A real process, SIGKILLed once every byte of its second save is
    uploaded and before the commit marker: the first state loads, and the
    next save of the name removes what the killed one left."""
    launch = run_plain("object_store_run.py", "kill", bucket, env=s3, timeout=300)
    assert launch.returncode == -signal.SIGKILL, launch.describe()
    saved = launch.ranks[0]
    assert saved["killed"], launch.describe()
    after = run_plain("object_store_run.py", "killed", bucket, env=s3, timeout=300).check()[0]
    versions = [name for name in after["left"] if name.startswith("v-")]
    assert len(versions) == 2 and object_states.MARKER in after["left"]
    for got, want in zip(after["loaded"], saved["saved"]):
        np.testing.assert_array_equal(np.array(got), np.array(want))
    assert len([name for name in after["after"] if name.startswith("v-")]) == 1


@pytest.fixture(scope="module")
def machines(s3, tmp_path_factory):
    """Two machines (torchrun agents in folders of their own) whose one
    shared storage is the S3 server; then one process that loads their
    sharded state."""
    name = f"nodes-{uuid.uuid4().hex[:12]}"
    storage.makedirs(f"s3://{name}")
    ranks = run_nodes("object_store_run.py", "nodes", f"s3://{name}", env=s3, timeout=600).check()
    alone = run_plain("object_store_run.py", "load", f"s3://{name}", env=s3, timeout=300).check()[0]
    return ranks, alone


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["resumes", "resumes_asynchronous"])
def test_training_resumes_exactly_from_states_on_s3_across_machines(machines, variant):
    for rank in check_values(machines[0], variant):
        assert rank["resumed_from"] == "training-state-000002"
        assert rank["epochs"] == 4
        assert rank["furthest"] == 0.0
        # keep_last=1: the newest state, and in it one version
        assert rank["folder"] == ["manifest.json", "training-state-000004"]
        assert len(rank["newest"]) == 2 and object_states.MARKER in rank["newest"]


@pytest.mark.multiprocess
def test_training_resumes_exactly_inside_an_epoch_from_s3(machines):
    for rank in check_values(machines[0], "resumes_inside_an_epoch"):
        assert rank["resumed_from"] == "training-state-000001-batch-000004-ranks-2"
        assert rank["epochs"] == 3
        assert rank["furthest"] == 0.0


@pytest.mark.multiprocess
def test_params_files_round_trip_through_s3_on_every_rank(machines):
    for rank in check_values(machines[0], "params"):
        assert rank == {"furthest": 0.0, "history": 1, "optimizer": 4}


@pytest.mark.multiprocess
def test_a_sharded_state_on_s3_loads_on_one_process(machines):
    ranks, alone = machines
    check_values(ranks, "sharded")
    assert alone == {"furthest": 0.0, "epochs": 1}


@pytest.mark.multiprocess
def test_nothing_is_written_to_the_machines_own_folders(machines):
    assert all(check_values(machines[0], "local_files"))
