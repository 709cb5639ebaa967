"""Training states of a module sharded by FSDP2, on real CPU processes
(gloo): every rank writes its own shards with torch.distributed.checkpoint,
resumes at an epoch's end, inside an epoch, after a preemption notice and
after torchrun's restart equal the uninterrupted run bit for bit, a failed
save leaves the previous state, and a state saved on 2 processes loads on 3
and on 1, sharded or not, with the saved weights and optimizer state.

accelerate selects FSDP for GPU kinds only; the launched scripts set it on
CPU with the test-only ``make_fsdp_accelerator`` (``launched/common.py``).
"""

import pytest
from harness import CheckedRanks, free_port, run_plain, run_processes
from harness import check_values as values
from test_mid_epoch import scenario

pytestmark = pytest.mark.multiprocess

PROCESSES = 2


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp-states")


@pytest.fixture(scope="module")
def trained(shared):
    # read in each test: a launch that crashed fails every test reading it
    launch = run_processes("fsdp_resume.py", "train", shared, nproc=PROCESSES, timeout=300)
    return CheckedRanks(launch)


def _exact(value):
    assert value["difference"] == 0.0  # weights, Adam's moments and steps, bit for bit
    assert value["history"]  # every row's losses


def test_a_run_resumed_at_an_epochs_end_from_asynchronous_saves_goes_on_exactly(trained):
    for value in values(trained, "epoch_end_resume_is_exact"):
        assert value["stopped"] == "Stop: epoch 2"
        assert value["resumed_from"] == "training-state-000001"  # stopped as epoch 2 began
        _exact(value)
        assert value["files"] and value["folders"] == []  # committed folders, nothing partial


def test_a_run_resumed_inside_an_epoch_goes_on_exactly(trained):
    for value in values(trained, "mid_epoch_resume_is_exact"):
        assert value["stopped"] == "Stop: batch 5 of epoch 2"
        assert value["resumed_from"] == f"training-state-000001-batch-000004-ranks-{PROCESSES}"
        _exact(value)
        assert value["files"] and value["folders"] == []  # committed folders, nothing partial


def test_a_notice_saves_the_shards_and_the_rerun_goes_on_exactly(trained):
    for value in values(trained, "a_notice_stops_saves_and_the_rerun_resumes_exactly"):
        assert value["stopped"].startswith("Preempted: Preempted (notice: ")
        # every rank stopped at the batch after the notice, and saved there
        assert "training stopped after training batch 6 of epoch 2" in value["stopped"]
        assert value["resumed_from"] == f"training-state-000001-batch-000006-ranks-{PROCESSES}"
        _exact(value)


def test_early_stoppings_best_weights_other_than_the_current_come_back(trained):
    for value in values(trained, "early_stoppings_best_weights_come_back"):
        assert value["resumed_from"] == f"training-state-000001-batch-000004-ranks-{PROCESSES}"
        assert value["best_epoch"] == [1, 1]
        # load_best put the first epoch's weights back, as in the uninterrupted run
        assert value["difference"] == 0.0


def test_rotation_removes_folders_and_leaves_nothing_partial(trained):
    for value in values(trained, "rotation_removes_folders_with_files"):
        assert value["files"] == ["training-state-000004"]
        assert value["files"] and value["folders"] == []  # committed folders, nothing partial


def test_a_save_failing_after_the_shards_leaves_the_previous_state(trained):
    for value in values(trained, "a_failed_save_leaves_the_previous_state"):
        # every rank wrote its shards; the commit failed: one error on every rank
        # (rank 1's names rank 0's)
        assert "CheckpointError: Cannot save the training state " in value["failed"]
        assert "the disk went away" in value["failed"]
        # the previous state alone is there, its partial folder removed
        assert value["before"] == value["after_failure"] == ["state.pt"]
        assert value["restored"] == 0.0  # the state still loads, with the earlier weights
        assert value["after_next_save"] == ["state.pt"]


def test_a_sharded_state_loads_into_ddp_and_back_on_the_same_processes(trained):
    for value in values(trained, "a_state_for_other_process_counts"):
        assert value["ddp_difference"] == 0.0
        assert value["predicts"] == 250
        # the DDP net's own state (a folder of full tensors) reshards into FSDP2
        assert value["back_to_fsdp_difference"] == 0.0


LOADS = {
    "3-processes-sharded": (3, "sharded"),
    "1-process-sharded": (1, "sharded"),
    "1-process-plain": (None, "unsharded"),
}


@pytest.mark.parametrize("layout", sorted(LOADS))
def test_a_state_saved_on_2_processes_loads_on_another_number(trained, shared, layout):
    assert list(trained)  # the state was saved
    nproc, kind = LOADS[layout]
    if nproc is None:  # python script.py: no launcher, no process group
        launch = run_plain("fsdp_resume.py", "load", shared, kind, timeout=180)
    else:
        launch = run_processes("fsdp_resume.py", "load", shared, kind, nproc=nproc, timeout=180)
    for value in values(CheckedRanks(launch), "a_state_loads_on_another_number_of_processes"):
        assert value["difference"] == 0.0  # DCP resharded: the saved weights and moments
        assert value["sharded"] == ("DTensor" if kind == "sharded" else "Parameter")
        assert value["epochs"] == [2, 4]  # and it trains on, to max_epochs


def test_torchrun_restarts_a_killed_worker_of_a_sharded_job_which_goes_on_exactly(tmp_path):
    # as test_preemption.py's elastic test, with the module sharded
    run = run_processes(
        "midepoch_run.py",
        tmp_path,
        "full",
        "elastic",
        nproc=PROCESSES,
        timeout=300,
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "ACCEL_TEST_FSDP": "1"},
        launcher_args=[
            "--max-restarts=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        ],
    )
    run.check()
    runs = {"launch": (["full", "elastic"], run)}
    full = scenario(runs, "full")
    for rank, expected in zip(scenario(runs, "elastic"), full):
        assert rank["attempt"] == 1  # the restarted workers finished the job
        assert rank["resumed_from"].startswith("training-state-000001-batch-000006-ranks-2")
        assert rank["history"] == expected["history"]
        assert rank["params"] == expected["params"]
        # committed states, nothing partial left by the killed worker's save
        assert any(f.startswith("training-state-") for f in rank["files"])
        assert not [f for f in rank["files"] if f.startswith(".")]
