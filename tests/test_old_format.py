"""Training states written by the releases before issue 47 (a torch file;
under FSDP2 a file and the folder of shards it names) still resume exactly:
``tests/data/old_format/`` holds such states of one process, of DDP on 2 and
of FSDP2 on 2 processes, written by that code (``launched/old_format.py
make``), with the full files of the uninterrupted run."""

import shutil
from pathlib import Path

import pytest
from harness import CheckedRanks, run_plain, run_processes
from harness import check_values as values

pytestmark = pytest.mark.multiprocess

DATA = Path(__file__).parent / "data" / "old_format"


def _checked(tmp_path, layout, nproc):
    copy = tmp_path / layout
    shutil.copytree(DATA / layout, copy)
    if nproc == 1:
        launch = run_plain("old_format.py", "check", copy, layout, timeout=180)
    else:
        launch = run_processes("old_format.py", "check", copy, layout, nproc=nproc, timeout=240)
    return CheckedRanks(launch)


@pytest.mark.parametrize("layout, nproc", [("one", 1), ("ddp", 2), ("fsdp", 2)])
def test_an_old_run_folder_resumes_exactly(tmp_path, layout, nproc):
    ranks = _checked(tmp_path, layout, nproc)
    # weights, Adam's state, history: bit for bit where this machine's
    # uninterrupted run reproduces the fixture's; where its CPU's float
    # kernels differ (the fixture's own run differs here by about 1e-7),
    # within round-off, far below what a wrong generator or batch gives
    here = max(
        value["difference"] for value in values(ranks, "this_machine_reproduces_the_reference")
    )
    bound = 0.0 if here == 0.0 else 1e-5
    for value in values(ranks, "resumed_from_the_run_folder"):
        # the newest state, inside epoch 2
        assert value["from"] == f"training-state-000001-batch-000002-ranks-{nproc}.pt"
        assert value["difference"] <= bound
    for value in values(ranks, "loaded_at_an_epochs_end"):
        assert value["difference"] <= bound
