"""The examples run as the README shows them."""

import json
import os
import subprocess
import sys

import pytest
from harness import ROOT, free_port, run_processes

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
def test_transformer_example_on_two_processes(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    report = tmp_path / "report"
    report.mkdir()
    launch = run_processes(
        EXAMPLES / "transformer.py", "--dir", tmp_path / "out", "--report", report, timeout=300
    )
    assert launch.returncode == 0 and not launch.timed_out, launch.describe()
    ranks = [json.loads((report / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["processes"] == 2 for r in ranks)
    assert ranks[0]["digest"] == ranks[1]["digest"]  # bit for bit the same weights
    assert ranks[0] == ranks[1]
    assert ranks[0]["accuracy"] > 0.8  # chance: 0.5
    assert ranks[0]["same_predictions"]  # a plain skorch net loads the saved parameters
    (out0, _), (out1, _) = launch.rank_outputs
    assert out1.strip() == ""  # output once, by the main process
    lines = out0.strip().splitlines()
    assert [line.split(":")[0].split(" ")[0] for line in lines] == ["grid", "test", "plain"], out0
