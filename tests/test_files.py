"""Checkpoint files under several processes, and on two simulated machines."""

import re

import pytest
from harness import check_errors as errors
from harness import check_values as values
from harness import run_nodes, run_processes

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks():
    return [r["checks"] for r in run_processes("files_checks.py", timeout=300).check()]


@pytest.fixture(scope="module")
def nodes():
    return [r["checks"] for r in run_nodes("each_node.py", timeout=180).check()]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "FileNotFoundError: No checkpoint at nope.pt"),
        ("truncated", "CheckpointError: cut.pt is not a complete torch file"),
        ("directory", "IsADirectoryError: Cannot load adir: it is a directory"),
        (
            "architecture",
            "CheckpointError: good.pt does not fit module_: 'hidden.weight' has "
            "shape (32, 20) in the file but (64, 20) in the module",
        ),
    ],
)
def test_bad_input_raises_a_clear_error_on_every_rank(ranks, case, expected):
    for value in values(ranks, "bad_input_raises_on_every_rank"):
        result = value[case]
        # each rank raises its own error, or the first rank's, named
        assert expected in result["error"], result["error"]
        assert result["seconds"] < 5


def test_saving_to_a_directory_raises_on_every_rank(ranks):
    rank0, rank1 = (v["save_to_directory"] for v in values(ranks, "bad_input_raises_on_every_rank"))
    assert rank0["error"].startswith("IsADirectoryError: Cannot save to adir")
    assert rank1["error"].startswith(
        "DistributedError: save_params failed on rank 0: IsADirectoryError"
    )


def test_unwritable_target_raises_everywhere_and_keeps_the_file(ranks):
    rank0, rank1 = values(ranks, "unwritable_target_keeps_the_previous_file")
    if not rank0["locked"]:
        pytest.skip("chattr +i is not available: nothing here can make a file unwritable for root")
    assert rank0["save"]["error"].startswith("PermissionError")
    assert rank1["save"]["error"].startswith(
        "DistributedError: save_params failed on rank 0: PermissionError"
    )
    assert rank0["intact"] and rank1["intact"]
    assert rank0["strays"] == []


def test_files_of_separate_saves_load_on_every_rank(ranks):
    for value in values(ranks, "files_of_separate_saves_load_on_every_rank"):
        assert value == {
            "separate": None,
            "saved_again": None,
            "files": ["opt_e1.pt", "opt_e3.pt", "params_e1.pt", "params_e2.pt"],
        }


def test_ddp_prefixed_file_loads_into_a_wrapped_net(ranks):
    for value in values(ranks, "prefixed_file_loads_under_ddp"):
        assert value == {"module_type": "DistributedDataParallel", "same_predictions": True}


def test_compiled_net_under_ddp_saves_clean_keys(ranks):
    for value in values(ranks, "compiled_net_saves_clean_keys"):
        assert value["keys"] == ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]


def test_save_on_each_node_on_one_machine_saves_one_state_together(ranks):
    for value in values(ranks, "one_machine_saves_one_state_together"):
        assert value == ["__0_0.distcp", "__1_0.distcp"]


def test_two_machines_without_a_shared_filesystem(nodes):
    for node, value in enumerate(values(nodes, "layout")):
        assert value == {"cwd": f"node{node}", "rank": node, "local_main": True, "num_processes": 2}
    for value in values(nodes, "save_on_each_node"):
        assert value == {
            "files": ["history.json", "params.pt"],
            "same_predictions": True,
            "history_epochs": 2,
        }


def test_resume_training_takes_the_newest_epoch_every_node_has(nodes):
    node0, node1 = (v for v in values(nodes, "resume_from_the_epoch_every_node_has"))
    assert node0["resumed_from"] == node1["resumed_from"] == "training-state-000002"
    assert node0["epochs"] == node1["epochs"] == 4
    assert node0["train_loss"] == node1["train_loss"]
    (warning,) = node0["warnings"]
    assert re.fullmatch(
        r"Resuming from epoch 2, the newest training state in states/run-\w{12} "
        r"that every rank has; rank\(s\) \[0\] also have newer ones\.",
        warning,
    )
    assert node1["warnings"] == []  # one voice
    for error in errors(nodes, "no_epoch_in_common_fails_on_every_node"):
        assert re.match(
            r"CheckpointError: No training state in states/run-\w{12} is on every "
            r"rank \(rank 0: epochs \[1, 2, 3, 4\], rank 1: epochs \[\]\)",
            error,
        )


def test_copies_of_each_node_resume_inside_an_epoch_exactly(nodes):
    for value in values(nodes, "copies_resume_inside_an_epoch_exactly"):
        assert value == {
            "keys": ["partial.rank-0", "partial.rank-1", "rng.rank-0", "rng.rank-1"],
            "files": ["__0_0.distcp"],  # its main process wrote it alone
            "resumed_from": "training-state-000001-batch-000004-ranks-2",
            "same_losses": True,
            "warnings": [],
        }


def test_a_failed_copy_raises_on_every_node(nodes):
    node0, node1 = values(nodes, "a_failed_copy_raises_on_every_node")
    failure = "FileNotFoundError: Cannot save to missing/state: the directory "
    for asynchronous in ("false", "true"):  # JSON's keys
        assert node1["errors"][asynchronous].startswith(failure)
        assert node0["errors"][asynchronous].startswith(
            f"DistributedError: save_state failed on rank 1: {failure}"
        )
    # node 0's own copy is whole, and its asynchronous save was waited for
    assert (node0["saved"], node1["saved"]) == (["state"], [])
    assert (node0["written"], node1["written"]) == ([True], [])


def test_sharded_copies_on_each_node_are_refused(nodes):
    for error in errors(nodes, "sharded_copies_are_refused"):
        assert error is not None, "the sharded net saved copies per machine"
        assert re.fullmatch(
            r"CheckpointError: Cannot save the training state fsdp/run-\w{12}/"
            r"training-state-000001: ProjectConfiguration\(save_on_each_node=True\) on "
            r"several machines .* FSDP2 shards across machines has on none\. Save to a "
            r"filesystem every machine sees, with save_on_each_node=False .*",
            error,
        ), error


def test_without_save_on_each_node_the_other_machine_fails_clearly(nodes):
    node0, node1 = values(nodes, "main_process_only")
    assert (node0["files"], node1["files"]) == (["params.pt"], [])
    assert node1["load_error"].startswith("FileNotFoundError: No checkpoint at only_main/params.pt")
    assert "save_on_each_node=True" in node1["load_error"]
    assert node0["load_error"].startswith("DistributedError: load_params failed on rank 1")


def test_named_files_are_written_while_the_others_arrive(ranks):
    # a file by name is replaced atomically: no rank can see it half written,
    # so the main process need not wait for the others before writing it
    value = values(ranks, "named_files_are_written_while_the_others_arrive")[1]
    assert value == {"named_before": True, "object_before": 0}
