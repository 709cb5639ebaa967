"""The examples run as the guide shows them (the quick start, the FAQ)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from harness import ROOT, free_port, run_processes
from jobs import kill_job  # scripts/jobs.py

EXAMPLES = ROOT / "examples"


def assert_demo_output(output):
    lines = [line for line in output.splitlines() if "Test accuracy" in line]
    assert len(lines) == 3, output  # printed once, by the main process
    accuracies = {line.rsplit(" ", 1)[1] for line in lines}
    assert len(accuracies) == 1, lines
    assert "Training on 2 process(es) (DistributedType.MULTI_CPU" in output


@pytest.mark.multiprocess
def test_flagship_under_torchrun(tmp_path):
    launch = run_processes(
        EXAMPLES / "save_load.py", "--out", tmp_path / "out", "--epochs", "3", timeout=180
    )
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    (out0, _), (out1, _) = launch.rank_outputs
    assert_demo_output(out0)
    assert "Test accuracy" not in out1
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "params.pt",
        "optimizer.pt",
        "history.json",
    }


@pytest.mark.multiprocess
def test_flagship_under_accelerate_launch(tmp_path):
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--main_process_port",
            str(free_port()),
            str(EXAMPLES / "save_load.py"),
            "--out",
            str(tmp_path / "out"),
            "--epochs",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert_demo_output(out.stdout)


def test_single_process_example():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "single_process.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "train accuracy" in out.stdout


@pytest.mark.multiprocess
def test_preemption_example(tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "preemption.py"), "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Preempted (notice: SIGTERM): training stopped after training batch" in out.stdout
    assert "of epoch 3" in out.stdout
    assert "torchrun restarted both workers" in out.stdout
    assert "uninterrupted and the notice run identical: True" in out.stdout
    assert "uninterrupted and the elastic run identical: True" in out.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [1, 2])
def test_streaming_example_resumes_inside_an_epoch_after_sigkill_exactly(tmp_path, nproc):
    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "streaming.py"),
            "--nproc",
            str(nproc),
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exit status 1 (non-zero: the job failed)" in out.stdout
    # the resumed run found a state saved inside epoch 2 (1 epoch done), before the kill
    found = re.search(r"found training-state-000001-batch-(\d+)", out.stdout)
    assert found and int(found.group(1)) < 20 * nproc, out.stdout
    assert "History of the uninterrupted and the resumed run identical: True" in out.stdout
    assert "Weights of the uninterrupted and the resumed run identical: True" in out.stdout


def environment(**variables):
    """This environment with ``variables``, the checkout first on the path."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, **variables)


def start_example(script, *args, logs):
    """``script`` under torchrun on two CPU processes, not waited for (the
    test sends the launcher its notice); each rank's output goes to a file of
    its own under ``logs``."""
    env = environment(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    launcher = [
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--redirects=3",
        f"--log-dir={logs}",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launcher, str(script), *map(str, args)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def rank_stdout(logs, rank):
    return next(logs.glob(f"*/attempt_0/{rank}/stdout.log")).read_text(errors="replace")


def transformer_example(tmp_path, name, dirname):
    """A launch of the transformer example on two processes, waited for:
    the launch and every rank's report."""
    report = tmp_path / f"report-{name}"
    report.mkdir()
    launch = run_processes(
        EXAMPLES / "transformer.py", "--dir", dirname, "--report", report, timeout=300
    )
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    ranks = [json.loads((report / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]  # bit for bit the same weights on both ranks
    return launch, ranks[0]


@pytest.mark.multiprocess
def test_transformer_example_preempted_and_rerun_ends_as_an_uninterrupted_run(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    preempted, logs = tmp_path / "preempted", tmp_path / "logs"
    checkpoints = preempted / "checkpoints"
    launcher = start_example(EXAMPLES / "transformer.py", "--dir", preempted, logs=logs)
    deadline = time.monotonic() + 300
    try:
        # the notice as a scheduler gives it, to the launcher, once the third
        # fit of the search began: two fits finished, three to train
        while len(list(checkpoints.glob("run-*"))) < 3:
            assert launcher.poll() is None, "the example ended before its third fit"
            assert time.monotonic() < deadline, "the third fit did not begin in 300 s"
            time.sleep(0.01)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) != 0  # non-zero: a scheduler requeues the job
    finally:
        if launcher.poll() is None:
            kill_job(launcher)
    out = rank_stdout(logs, 0)
    assert out.startswith(f"tokenizer trained and saved to {preempted}\n"), out
    assert "fit 3: started afresh" in out
    assert "Preempted (notice: SIGTERM): training stopped after training batch" in out, out
    assert rank_stdout(logs, 1) == ""  # output on the main process only
    stopped = int(re.findall(r"^fit (\d+):", out, re.M)[-1])  # the fit the notice stopped
    tokenizer = (preempted / "tokenizer" / "tokenizer.json").read_bytes()

    # the same command again: the same tokenizer, the same runs, resumed
    _, rerun = transformer_example(tmp_path, "rerun", preempted)
    assert not rerun["tokenizer_trained"]
    assert (preempted / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer
    assert len(list(checkpoints.glob("run-*"))) == 5  # no fit started afresh beside its run
    fits = rerun["fits"]
    assert len(fits) == 5 and all(fit["epochs"] == 5 for fit in fits), fits
    for fit in fits[: stopped - 1]:  # finished: resumed at their end, trained nothing
        assert fit["resumed_from"].endswith("training-state-000005"), fits
        assert fit["epochs_before"] == 5
    # stopped inside: resumed where the notice stopped it
    assert fits[stopped - 1]["resumed_from"] is not None, fits
    assert fits[stopped - 1]["epochs_before"] < 5 or "-batch-" in fits[stopped - 1]["resumed_from"]
    assert all(fit["resumed_from"] is None for fit in fits[stopped:]), fits

    # an uninterrupted run with that tokenizer (its own would give other ids)
    uninterrupted = tmp_path / "uninterrupted"
    shutil.copytree(preempted / "tokenizer", uninterrupted / "tokenizer")
    launch, expected = transformer_example(tmp_path, "uninterrupted", uninterrupted)
    assert all(fit["resumed_from"] is None for fit in expected["fits"])
    assert expected["processes"] == 2
    assert expected["accuracy"] > 0.8  # chance: 0.5
    assert expected["same_predictions"]  # a plain skorch net loads the saved parameters
    (out0, _), (out1, _) = launch.rank_outputs
    assert out1.strip() == ""  # output once, by the main process
    lines = [line.split(":")[0].split(" ")[0] for line in out0.strip().splitlines()]
    assert lines == ["tokenizer", *["fit"] * 5, "grid", "test", "plain"], out0

    # the resumed search ends as the uninterrupted one: each candidate's mean
    # cross-validation score, the best learning rate, the refitted net's
    # weights (digest), its test accuracy, and the plain net's predictions
    compared = ["cv_scores", "best_lr", "digest", "accuracy", "same_predictions"]
    assert {k: rerun[k] for k in compared} == {k: expected[k] for k in compared}


# six trainings of the example's tokenizer, single-threaded, in one process
TRAIN_AGAIN = """
import hashlib, json
from examples.transformer import make_text, word_piece_tokenizer
X, _ = make_text(320, seed=1)
for _ in range(6):
    vocab = word_piece_tokenizer().fit(X).fast_tokenizer_.get_vocab()
    print(hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest())
"""


def test_a_tokenizer_trained_again_on_the_same_texts_has_another_vocabulary():
    pytest.importorskip("tokenizers")
    env = environment(RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(
        [sys.executable, "-c", TRAIN_AGAIN],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    vocabularies = out.stdout.split()
    assert len(vocabularies) == 6
    assert len(set(vocabularies)) > 1  # 6 of 6 differ, as a rule


@pytest.mark.multiprocess
def test_a_tokenizer_trained_in_a_pipeline_on_each_rank_differs_between_the_ranks():
    pytest.importorskip("tokenizers")
    launch = run_processes("tokenizer_pipeline.py", "per_rank", timeout=240)
    ranks = launch.check()
    assert ranks[0]["vocabulary"] != ranks[1]["vocabulary"]
    # where the ranks got other ids for some rows, every rank raised (the
    # vocabularies can also differ in tokens that these texts never use)
    errors = {rank["error"] for rank in ranks}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error is None or error.startswith(
        "DistributedError: The ranks fit on different data: the same rows of X or y hold "
        "other values on rank(s) 1 than on rank 0"
    ), error


@pytest.mark.multiprocess
def test_the_faqs_recipe_gives_every_rank_the_tokenizer_of_the_main_process():
    pytest.importorskip("tokenizers")
    launch = run_processes("tokenizer_pipeline.py", "shared", timeout=240)
    ranks = launch.check()
    assert ranks[0]["vocabulary"] == ranks[1]["vocabulary"]
    assert ranks[0]["error"] is None and ranks[1]["error"] is None
    assert all(rank["clone_vocabulary"] == rank["vocabulary"] for rank in ranks)
