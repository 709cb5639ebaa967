"""What the launching guide says of ``accelerate config`` files, each row
launched with ``accelerate launch --config_file`` on CPU; and
``scripts/demo`` on the port the caller sets."""

import json
import os
import re
import subprocess
import sys

import pytest
from harness import LAUNCHED, ROOT, free_port

pytestmark = pytest.mark.multiprocess

# as `accelerate config` writes it for multi-CPU (accelerate 1.15)
MULTI_CPU = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: {port}
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""
MULTI_GPU = MULTI_CPU.replace("MULTI_CPU", "MULTI_GPU").replace("use_cpu: true", "use_cpu: false")


def launch(tmp_path, config, *flags, env=None):
    """Every rank's view (``launched/config_view.py``), by rank."""
    path = tmp_path / "cfg.yaml"
    path.write_text(config.format(port=free_port()))
    results = tmp_path / "results"
    results.mkdir()
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    run_env.update(
        OMP_NUM_THREADS="1",
        ACCEL_RESULTS_DIR=str(results),
        PYTHONPATH=os.pathsep.join([str(ROOT), str(LAUNCHED)]),
        **(env or {}),
    )
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path)]
    out = subprocess.run(
        [*command, *flags, str(LAUNCHED / "config_view.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=run_env,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return [json.loads(p.read_text()) for p in sorted(results.glob("rank*.json"))]


CPU = {"ACCELERATE_USE_CPU": "true"}


def test_a_multi_cpu_file_as_accelerate_config_writes_it_starts_one_process(tmp_path):
    (alone,) = launch(tmp_path, MULTI_CPU, env=CPU)
    assert alone["num_processes"] == 1 and alone["world_size"] is None
    assert alone["mixed_precision"] == "bf16"  # the file's other settings apply


def test_a_multi_gpu_file_with_accelerate_use_cpu_starts_cpu_processes(tmp_path):
    # accelerate launch's --gradient_accumulation_steps is DeepSpeed's only
    ranks = launch(tmp_path, MULTI_GPU, "--gradient_accumulation_steps", "2", env=CPU)
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["distributed_type"] == "DistributedType.MULTI_CPU"
        assert rank["num_processes"] == 2 and rank["mixed_precision"] == "bf16"
        assert rank["accumulation"] == 1 and rank["initialize"] is None


def test_a_multi_gpu_file_without_accelerate_use_cpu_is_refused_by_the_net(tmp_path):
    ranks = launch(tmp_path, MULTI_GPU)
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["num_processes"] == 1 and rank["world_size"] == "2"
        assert rank["initialize"].startswith("RuntimeError: This process is one of WORLD_SIZE=2")


def test_multi_gpu_and_the_environment_set_processes_and_accumulation(tmp_path):
    env = dict(CPU, ACCELERATE_GRADIENT_ACCUMULATION_STEPS="2")
    ranks = launch(tmp_path, MULTI_CPU, "--multi_gpu", env=env)
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["num_processes"] == 2 and rank["accumulation"] == 2
        assert rank["mixed_precision"] == "bf16" and rank["initialize"] is None


def test_the_demo_takes_master_port_where_it_is_set(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    out = subprocess.run(
        [str(ROOT / "scripts" / "demo"), "--out", str(tmp_path / "out"), "--epochs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(env, MASTER_PORT=str(port)),
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(rf"^scripts/demo: two CPU processes, port {port}$", out.stdout, re.M)
    assert out.stdout.count("Test accuracy") == 3
