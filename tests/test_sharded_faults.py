"""Training states of a module sharded by FSDP2 under faults, on real CPU
processes (``launched/sharded_faults.py``): a save that fails on one rank or
on a full disk raises the same ``CheckpointError`` on every rank and leaves
no partial folder behind; a deleted, truncated or corrupted shard is named
as damaged, with the intact state beside it; a state of other parameters is
named so; a second job of a run whose folder a live job writes is refused,
naming it.

A full disk is a tmpfs of 1 MiB that the test mounts (root only: elsewhere
that test skips); a write failing on one rank only is its shard file's size
limit (``RLIMIT_FSIZE``), which any user can set, and which fails the write
with ``EFBIG`` as a quota fails it with ``EDQUOT``.
"""

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
from harness import ROOT, CheckedRanks, run_processes
from harness import check_values as values

from accel_mixin.checkpoint.folder_claim import MARKER, claim, release

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    disk = tmp_path_factory.mktemp("disk")
    command = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]
    mounted = not subprocess.run(command, capture_output=True, check=False).returncode
    try:
        launch = run_processes("sharded_faults.py", "save", disk if mounted else "none")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, check=False)
    return CheckedRanks(launch)


@pytest.fixture(scope="module")
def damaged():
    return CheckedRanks(run_processes("sharded_faults.py", "damaged"))


def _alike(per_rank):
    """The one value every rank has."""
    first, *others = per_rank
    assert all(other == first for other in others), per_rank
    return first


def test_a_write_failing_on_one_rank_raises_one_error_on_every_rank(saves):
    checks = values(saves, "a_write_failing_on_one_rank_fails_alike_everywhere")
    failed = _alike([value["failed"] for value in checks])
    assert failed.startswith("CheckpointError: Cannot save the training state "), failed
    assert "state.pt: writing it failed on rank 1: OSError: [Errno 27] File too large" in failed
    assert "(the state saved there before is intact); its partial folder is removed" in failed
    for value in checks:  # the failed save's partial folder is gone, the good state stays
        assert value["after"] == value["before"] == ["state.pt"]


def test_a_full_disk_raises_one_error_on_every_rank_and_piles_up_no_folders(saves):
    checks = values(saves, "a_full_disk_fails_alike_everywhere_and_piles_up_no_folders")
    if checks[0] is None:
        pytest.skip("mounting a small tmpfs needs root")
    attempts = _alike([value["attempts"] for value in checks])
    for attempt in attempts:  # twice: retries pile up no partial folders
        assert attempt.startswith("CheckpointError: Cannot save the training state "), attempt
        assert "OSError: [Errno 28] No space left on device (no space is left" in attempt
        assert "(the state saved there before is intact)" in attempt
        assert "is removed." in attempt
    for value in checks:
        assert value["after"] == value["before"] == ["state.pt"]
        assert value["intact"]  # the previous state loads, with its weights
        assert value["then"] is None  # and with space again, the save succeeds


@pytest.mark.parametrize("kind", ["deleted", "truncated", "corrupted"])
def test_a_damaged_shard_is_named_with_the_newest_intact_state(damaged, kind):
    checks = values(damaged, f"a_{kind}_shard_is_named_with_the_intact_state")
    error = _alike([value["error"] for value in checks])
    shards = checks[0]["shards"]
    assert error.startswith("CheckpointError: "), error
    assert f"{shards} cannot be loaded: its files are " in error
    assert "damaged or unreadable" in error
    assert "other parameters" not in error
    if kind != "corrupted":  # found by its size alone
        assert {"deleted": "__1_0.distcp is missing", "truncated": "__1_0.distcp is truncated"}[
            kind
        ] in error
    older = shards.split("/training-state-000002")[0] + "/training-state-000001"
    assert f"The newest intact state beside it is {older}: load it with " in error
    assert f"net.load_state('{older}')" in error


def test_where_no_state_beside_it_is_intact_none_is_named(damaged):
    error = _alike(values(damaged, "with_the_older_state_damaged_too_none_is_named"))
    assert "are damaged or unreadable (__1_0.distcp is truncated (10 of " in error
    assert "No other training state beside it is intact" in error
    assert "training-state-000001" not in error


def test_a_state_of_other_parameters_is_named_so_and_not_damaged(damaged):
    checks = values(damaged, "a_state_of_other_parameters_is_named_so")
    error = _alike([value["error"] for value in checks])
    assert "does not fit module_" in error and "Size mismatch" in error
    assert "saved from a net with other parameters" in error
    assert "damaged" not in error
    assert [value["intact"] for value in checks] == [None, None]  # the same net loads it


def test_a_second_job_writing_the_run_folder_is_refused_naming_the_first(tmp_path):
    # the first job waits after its first epoch's save until "release" exists
    launches = {}
    holder = threading.Thread(
        target=lambda: launches.update(
            hold=run_processes("sharded_faults.py", "hold", tmp_path, timeout=240, forked=False)
        )
    )
    holder.start()
    try:
        deadline = time.monotonic() + 200
        while not (tmp_path / "ready").exists() and holder.is_alive():
            assert time.monotonic() < deadline, "the first job did not save its first epoch"
            time.sleep(0.2)
        second = CheckedRanks(run_processes("sharded_faults.py", "second", tmp_path))
    finally:
        (tmp_path / "release").touch()
        holder.join()
    refused = values(second, "a_second_job_is_refused")
    failed = _alike([value["failed"] for value in refused])
    run_folder = os.path.dirname(refused[0]["resumed"])  # it resumed, then was refused
    assert failed.startswith(
        f"CheckpointError: TrainingCheckpoint: another job writes training states into "
        f"{run_folder}: process "
    ), failed
    assert re.search(r": process \d+ on [^,]+, .*since \d{4}-", failed), failed
    for value in values(CheckedRanks(launches["hold"]), "the_job_writing_there_goes_on"):
        assert value["failed"] is None  # the first job finished, its states whole
        states = [name for name in value["files"] if name.startswith("training-state")]
        assert states == ["training-state-000001", "training-state-000002"]
        assert MARKER not in value["files"]  # given up when its fit ended


def test_a_claim_ends_with_its_process_however_it_ends(tmp_path):
    code = (
        "import sys, time\n"
        "from accel_mixin.checkpoint.folder_claim import claim\n"
        "assert claim(sys.argv[1]) is None\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, cwd=ROOT
    )
    try:
        assert process.stdout.readline() == b"held\n"
        holder = claim(tmp_path)
        assert holder.startswith(f"process {process.pid} on {socket.gethostname()}"), holder
    finally:
        process.kill()
        process.wait()
    assert claim(tmp_path) is None  # the kernel let go of the killed process's lock
    assert claim(tmp_path) is None  # held already: a second claim of this process
    release(tmp_path)
    assert (tmp_path / MARKER).exists()
    release(tmp_path)
    assert not (tmp_path / MARKER).exists()
