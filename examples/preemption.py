"""Preemption and elastic restarts: a two-process run stopped in the middle of
an epoch, in two ways, ends with the history of a run never interrupted.

    python examples/preemption.py

This script runs the training script (itself, with --worker) with torchrun:

1. once uninterrupted;
2. once with a preemption notice: SIGTERM to torchrun, as a scheduler sends
   it, in the middle of epoch 3. torchrun forwards it to every worker; they
   stop at the same batch, save a training state there and exit non-zero
   (``Preempted``), as a job to be requeued does. The same command again
   resumes there;
3. once under ``torchrun --max-restarts 1``, where a worker is SIGKILLed in
   the middle of epoch 3: torchrun restarts every worker, and they resume
   from the last state saved inside the epoch.

It then compares the histories: losses, scores and learning rates of every
epoch and every batch.

The worker is what you would write for your own job: TrainingCheckpoint,
saving every 20 batches too, and ResumeTraining on the same folder.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EPOCHS = 5


def train(dirname, history_file, kill_at):
    import numpy as np
    import torch
    from accelerate import Accelerator
    from sklearn.datasets import make_classification
    from skorch import NeuralNetClassifier
    from skorch.callbacks import Callback, LRScheduler

    from accel_mixin import AccelerateMixin, Preempted
    from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

    class AcceleratedNet(AccelerateMixin, NeuralNetClassifier):
        pass

    class LoseAWorker(Callback):
        """In torchrun's first attempt, rank 1 dies after batch 30 of epoch 3."""

        in_run_identity = False  # not part of what is trained

        def on_batch_end(self, net, training=False, **kwargs):
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
            if (
                kill_at
                and first_attempt
                and training
                and net.accelerator.process_index == 1
                and (len(net.history), len(net.history[-1]["batches"])) == (3, 30)
            ):
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    # 150 batches an epoch on each rank: the ranks poll for notices at most 64
    # batches apart, so a notice in the middle of an epoch stops inside it
    X, y = make_classification(12000, 20, n_informative=10, flip_y=0.1, random_state=0)
    module = torch.nn.Sequential(
        torch.nn.Linear(20, 64),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(64, 2),
        torch.nn.Softmax(dim=-1),
    )
    net = AcceleratedNet(
        module,
        accelerator=Accelerator(),
        max_epochs=EPOCHS,
        lr=0.2,
        batch_size=32,
        iterator_train__shuffle=True,
        verbose=0,
        callbacks=[
            LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5),
            TrainingCheckpoint(dirname, every_n_batches=20, keep_last=2),
            ResumeTraining(dirname),
            LoseAWorker(),
        ],
    )
    try:
        net.fit(X.astype(np.float32), y)
    except Preempted as exc:
        if net.accelerator.is_main_process:
            print(f"   {exc}", flush=True)
        raise
    if net.accelerator.is_main_process:
        rows = [{k: v for k, v in row.items() if k != "dur"} for row in net.history]
        Path(history_file).write_text(json.dumps(rows))
    # Tear the process group down while Python is still whole: left to the
    # interpreter's exit, gloo's threads can abort the process.
    net.accelerator.end_training()


def launch(dirname, history_file, elastic=False):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # torch's c10d rendezvous for restarts, with a store of the workers' own:
    # sharing the launcher's, restarted workers can read the addresses of
    # the workers they replace (pytorch/pytorch#135712)
    env = dict(
        os.environ,
        ACCELERATE_USE_CPU="true",
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    rendezvous = (
        ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=1"]
        if elastic
        else ["--master_addr=127.0.0.1", f"--master_port={port}"]
    )
    worker = [__file__, "--worker", "--dir", str(dirname), "--history", str(history_file)]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            *rendezvous,
            *worker,
            *(["--kill"] if elastic else []),
        ],
        env=env,
        start_new_session=True,
        stderr=subprocess.DEVNULL,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--history", help=argparse.SUPPRESS)
    parser.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help="where to put checkpoints and histories")
    args = parser.parse_args()
    if args.worker:
        train(args.dir, args.history, args.kill)
        return

    work = Path(args.workdir or tempfile.mkdtemp(prefix="accel_mixin_preemption_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"Working in {work}")

    print("1. An uninterrupted run of two processes ...", flush=True)
    if launch(work / "uninterrupted", work / "uninterrupted.json").wait() != 0:
        sys.exit("the uninterrupted run failed")

    print(
        "2. The same run, given notice (SIGTERM to torchrun) in the middle of epoch 3 ...",
        flush=True,
    )
    run = launch(work / "notice", work / "notice.json")
    deadline = time.monotonic() + 300
    # TrainingCheckpoint writes into a folder of the run: notice/run-<id>/
    while not list((work / "notice").glob("run-*/training-state-000002-batch-*")):
        if run.poll() is not None or time.monotonic() > deadline:
            sys.exit("the run ended before the middle of epoch 3")
        time.sleep(0.01)
    run.send_signal(signal.SIGTERM)
    print(f"   exit status {run.wait()} (non-zero: a scheduler requeues the job)", flush=True)
    print("   the same command again: it resumes where it stopped ...", flush=True)
    if launch(work / "notice", work / "notice.json").wait() != 0:
        sys.exit("the resumed run failed")

    print(
        "3. Under torchrun --max-restarts 1, rank 1 SIGKILLed in the middle of epoch 3 ...",
        flush=True,
    )
    if launch(work / "elastic", work / "elastic.json", elastic=True).wait() != 0:
        sys.exit("the elastic run failed")
    print("   torchrun restarted both workers, which resumed and finished", flush=True)

    uninterrupted = json.loads((work / "uninterrupted.json").read_text())
    same = True
    for name in ("notice", "elastic"):
        resumed = json.loads((work / f"{name}.json").read_text())
        print(
            f"Histories of the uninterrupted and the {name} run identical: "
            f"{uninterrupted == resumed}"
        )
        same = same and uninterrupted == resumed
    for row in uninterrupted:
        print(
            f"   epoch {row['epoch']}: train_loss {row['train_loss']:.6f} "
            f"valid_loss {row['valid_loss']:.6f} valid_acc {row['valid_acc']:.4f}"
        )
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
