"""python -m accel_mixin env: versions and every rank's view, from the main process."""

import os
import subprocess
import sys

import accelerate
import skorch
import torch
from accelerate import Accelerator
from harness import ROOT, run_processes

import accel_mixin
from accel_mixin.diagnostics import environment_report


def test_the_report_names_the_versions_and_what_accelerate_sees():
    report = environment_report(Accelerator(cpu=True))
    for line in (
        f"accel_mixin {accel_mixin.__version__}",
        f"torch {torch.__version__}",
        f"accelerate {accelerate.__version__}",
        f"skorch {skorch.__version__}",
    ):
        assert line in report
    assert "rank 0 of 1: distributed_type=NO" in report
    assert "layout check: ok" in report


def test_a_group_that_sees_one_process_is_reported_not_raised(monkeypatch):
    accelerator = Accelerator(cpu=True)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun without ACCELERATE_USE_CPU
    report = environment_report(accelerator)
    assert "WORLD_SIZE=2" in report and "layout check: FAILS: This process is one of" in report


def test_the_command_runs():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run(
        [sys.executable, "-m", "accel_mixin", "env"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("accel_mixin ") and "rank 0 of 1" in out.stdout


def test_on_two_processes_the_main_process_reports_every_rank():
    launch = run_processes("env_run.py", timeout=120)
    assert launch.returncode == 0, launch.describe()
    (out0, _), (out1, _) = launch.rank_outputs
    assert "rank 0 of 2: distributed_type=MULTI_CPU" in out0
    assert "rank 1 of 2: distributed_type=MULTI_CPU" in out0
    assert out0.count("layout check: ok") == 2
    assert out1 == ""  # one voice


def test_the_report_says_whether_restarts_share_the_store(monkeypatch):
    from accel_mixin.diagnostics import restart_store

    assert restart_store() is None or "TORCHELASTIC_RESTART_COUNT" in os.environ
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    shared = restart_store()
    assert "shared across restarts" in shared and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared
    assert shared in environment_report(Accelerator(cpu=True))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert restart_store() == "restarts: every attempt gets a store of its own"
