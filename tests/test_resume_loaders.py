"""Exact resume for every DataLoader setup (``launched/resume_loaders.py``):
workers 0 and 2, persistent or not, a seeded generator or none, shuffled or
not, a sampler of the user's; stopped at an epoch's end and inside an
epoch; on one process and on two. The resumed run, with other seeds, must
repeat the uninterrupted one bit for bit: every batch's loss, every epoch's
losses, every weight, on every rank."""

import pytest
from harness import run_plain, run_processes
from resume_phases import once_per_layout

pytestmark = pytest.mark.multiprocess

CASES = (
    "w0",
    "w0-generator",
    "w0-ordered",
    "w2",
    "w2-persistent",
    "w2-persistent-generator",
    "w2-persistent-ordered",
    "sampler",
)
STOPS = ("epoch", "inside")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    def run(nproc):
        dirname = tmp_path_factory.mktemp(f"loaders{nproc}")
        if nproc == 1:
            return run_plain("resume_loaders.py", dirname, *CASES, timeout=600).check()
        return run_processes("resume_loaders.py", dirname, *CASES, nproc=nproc, timeout=600).check()

    return once_per_layout(run)


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("stop", STOPS)
@pytest.mark.parametrize("case", CASES)
def test_a_resumed_fit_repeats_the_uninterrupted_one(launched, nproc, case, stop):
    expected_file = {
        "epoch": "training-state-000002",
        "inside": f"training-state-000001-batch-000004-ranks-{nproc}",
    }[stop]
    for rank, results in enumerate(launched(nproc)):
        result = results[f"{case}/{stop}"]
        assert result["resumed_from"] == expected_file, f"rank {rank}"
        resumed, uninterrupted = result["resumed"], result["uninterrupted"]
        for what in ("batches", "epochs", "weights"):
            assert resumed[what] == uninterrupted[what], f"rank {rank}: {what} differ"
