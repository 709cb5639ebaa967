"""One truth on every rank, in two real processes (launched/sync_checks.py)."""

import pytest
from harness import CheckedRanks, run_processes
from harness import check_values as values

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def launch():
    # as the guide says to launch, for the lines torch's C++ code writes
    return run_processes("sync_checks.py", timeout=300, env={"TORCH_CPP_LOG_LEVEL": "ERROR"})


@pytest.fixture(scope="module")
def ranks(launch):
    return CheckedRanks(launch)


def test_history_rows_are_identical_on_every_rank(ranks):
    for check in ("rows_and_scores", "load_best", "load_init_state_resume"):
        rank0, rank1 = values(ranks, check)
        assert rank0["rows"] == rank1["rows"], check


def test_losses_count_every_real_sample_once(ranks):
    for value in values(ranks, "rows_and_scores"):
        # 600 samples, 2 ranks, batches of 16: the last batches are padded
        assert value["train_sizes"] == [value["n_train"]] * 3
        assert value["valid_sizes"] == [value["n_valid"]] * 3


def test_scores_equal_one_process_on_the_whole_validation_set(ranks):
    for value in values(ranks, "rows_and_scores"):
        scores, expected = value["scores"], value["one_process"]
        for name in ("valid_acc", "valid_acc_nocache", "valid_acc_batch"):
            assert scores[name] == pytest.approx(expected["accuracy"], abs=1e-12), name
        assert scores["valid_loss"] == pytest.approx(expected["loss"], rel=1e-5)


def test_checkpoint_on_best_accuracy_decides_alike_and_writes_once(ranks):
    rank0, rank1 = values(ranks, "checkpoint_on_best_accuracy")
    assert rank0["event_cp"] == rank1["event_cp"]
    assert len(rank0["event_cp"]) == 12
    saves = sum(rank0["event_cp"])
    # params, optimizer, criterion, history and the pickle, per checkpoint
    assert (rank0["writes"], rank1["writes"]) == (5 * saves, 0)
    assert rank0["pickle_rows"] == rank1["pickle_rows"] == 333


def test_early_stopping_stops_at_the_same_epoch(ranks):
    rank0, rank1 = values(ranks, "early_stopping")
    assert rank0["epochs"] == rank1["epochs"] < 40


def test_load_best_and_load_init_state_keep_ranks_in_sync(ranks):
    for value in values(ranks, "load_best"):
        assert value["spread"] == 0.0
    for value in values(ranks, "load_init_state_resume"):
        assert value["epochs"] == 4  # two loaded, two trained
        assert value["spread"] == 0.0


def test_reduce_lr_on_plateau_on_valid_loss(ranks):
    rank0, rank1 = values(ranks, "reduce_lr_on_plateau")
    assert rank0["event_lr"] == rank1["event_lr"]
    assert rank0["event_lr"][-1] < 1.0
    assert rank0["spread"] == 0.0


def test_train_end_checkpoint_writes_once(ranks):
    rank0, rank1 = values(ranks, "train_end_checkpoint")
    assert (rank0["writes"], rank1["writes"]) == (4, 0)
    assert rank0["files"] == rank1["files"]


def test_one_voice(launch):
    def section(text):
        """What a stream of one rank got during the check, markers left out."""
        start, end = text.index("=== one voice starts"), text.index("=== one voice ends")
        return text[start:end].split("\n", 1)[1]

    (out0, err0), (out1, err1) = (map(section, streams) for streams in launch.rank_outputs)
    assert out0.count("epoch    train_loss") == 1
    assert out0.count("A checkpoint was triggered in epoch 2.") == 1
    assert "Perhaps you meant" in err0  # skorch's warning, as in one process
    assert "%|" in err0  # the progress bar
    assert "forward pass in evaluation mode" in err0  # a warning in predict
    # rank 1 said nothing at all: the launch sets TORCH_CPP_LOG_LEVEL=ERROR,
    # as the guide says to, for the lines of DDP's reducer (C++)
    assert out1 == err1 == ""


@pytest.mark.parametrize(
    "hook", ["on_epoch_end", "on_epoch_begin", "on_train_begin", "on_batch_end"]
)
def test_an_error_on_rank_1_reaches_rank_0_promptly(ranks, hook):
    rank0, rank1 = (value[hook] for value in values(ranks, "error_in_a_callback_on_rank_1"))
    assert rank1["error"] == "ValueError: boom from rank 1"
    assert rank0["error"].startswith(f"DistributedError: {hook} failed on rank 1")
    assert "boom from rank 1" in rank0["error"]
    assert max(rank0["seconds"], rank1["seconds"]) < 5  # the collective timeout is 30 s


def test_uneven_batches_validate_in_step_and_refuse_uneven_training(ranks):
    rank0, rank1 = values(ranks, "uneven_validation")
    assert rank0["rows"] == rank1["rows"]  # one history, no hang at its sync
    assert rank0["valid_samples"] == [40, 40]  # every validation sample, once
    for value in values(ranks, "uneven_training"):
        assert value["error"].startswith(
            "DistributedError: With even_batches=False the ranks have different numbers of "
            "training batches (rank 0: 2, rank 1: 1)"
        )
        assert value["seconds"] < 25  # not the 30 s collective timeout


def test_padding_only_batches_are_neither_kept_nor_counted(ranks):
    for value in values(ranks, "padding_only_batches_are_not_counted"):
        assert value == {"count": 7, "records": 7, "samples": 100}  # as in one process


def test_a_pickle_does_not_depend_on_the_rank_that_made_it(ranks, capsys):
    import base64
    import pickle

    _, made_on_rank1 = values(ranks, "pickle_made_on_each_rank")
    net = pickle.loads(base64.b64decode(made_on_rank1))  # in one process, as main
    net.partial_fit(*net_data())
    # the row of the epoch trained here, not the silence of rank 1's sink
    assert capsys.readouterr().out.split()[:1] == ["2"]


def net_data():
    from common import make_data

    return make_data(100)


def test_progress_bars_count_the_batches_each_rank_runs(ranks):
    for auto, count in values(ranks, "progress_bars_count_this_ranks_batches"):
        # (tqdm closes a bar again when it is collected)
        assert auto and all(n == total for n, total in auto)  # not 14 of 27
        # 'count' knows no total in the first epoch, as in skorch; later ones
        known = [(n, total) for n, total in count if total is not None]
        assert known and all(n == total for n, total in known)


def test_tensorboard_records_each_value_once_from_the_main_process(ranks):
    main, other = values(ranks, "tensorboard_once")
    for layout in ("main_only", "every_rank"):
        recorded, history = main[layout]["scalars"], main[layout]["history"]
        if layout == "main_only":
            assert main[layout]["event_files"] == 1
        for key in ("train_loss", "valid_loss", "valid_acc"):
            tag = "Loss/" + key if key.startswith(("train", "valid")) else key
            steps, values_ = zip(*sorted(recorded[tag]))
            assert steps == (1, 2, 3)  # once per epoch, from one process
            assert values_ == pytest.approx(history[key], rel=1e-6)
            assert history[key] == other[layout]["history"][key]  # synced
        assert len(recorded["dur"]) == 3  # the main process's own epoch times


def test_accelerate_trackers_get_each_row_once_from_the_main_process(ranks):
    main, other = values(ranks, "trackers_once")
    assert main["runs"] == ["AcceleratedNet"]  # one writer: the main process's
    for key, history in main["history"].items():
        steps, logged = zip(*sorted(main["scalars"][key]))
        assert steps == (1, 2, 3)
        assert logged == pytest.approx(history, rel=1e-6)
        assert history == other["history"][key]


def test_profile_kwargs_profile_a_fit_on_every_rank(ranks):
    for rank, value in enumerate(values(ranks, "profile_a_fit")):
        # accelerate's trace file per rank, in the shared folder
        assert value["traces"] == ["profile_0.json", "profile_1.json"]
        assert value["linear"] and value["gloo"], value  # the module's ops and DDP's
        # the schedule's 2 active batches of 2 linear layers, forward and back
        assert value["scheduled"] and value["scheduled"][0] >= 4, (rank, value)


def test_a_logger_saves_alone_and_a_collective_call_from_one_fails_fast(ranks):
    rank0, rank1 = values(ranks, "loggers_that_save_or_predict")
    # WandbLogger(save_model=True) and MlflowLogger save from the main process
    for rank in (rank0, rank1):
        assert rank["saving"]["error"] is None
        assert rank["saved"] == ["logged-1.pt", "logged-2.pt"]  # a shared folder here
    # predict needs every rank: it raises at once instead of waiting for them
    assert rank0["predicting"]["error"].startswith(
        "DistributedError: inference (predict, predict_proba, forward, score) is a "
        "collective call, which every rank must make, but the callback 'PredictingLogger' "
        "runs on the main process only"
    )
    assert "PredictingLogger" in rank1["predicting"]["error"]
    assert max(rank0["predicting"]["seconds"], rank1["predicting"]["seconds"]) < 10


def test_outputs_of_other_lengths_on_each_rank_are_gathered(ranks):
    pytest.importorskip("transformers")
    widths = values(ranks, "rows_of_other_lengths_are_gathered")
    assert widths[0] == widths[1]
