"""Preemption: a two-process run killed mid-training and started again ends
with the same history as a run that was never interrupted.

    python examples/preemption.py

This script runs the training script (itself, with --worker) three times
with torchrun: once uninterrupted; once killed with SIGKILL, as a preempted
job is, soon after its third epoch's checkpoint is complete; and once more,
unchanged, which finds the checkpoint and trains the remaining epochs. It then
compares the two histories: losses, scores and learning rates of every epoch
and every batch.

The worker is what you would write for your own job: TrainingCheckpoint and
ResumeTraining on the same folder, so that running the same command again
after a crash resumes by itself.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the repository's scripts/jobs.py: SIGKILL a launcher and every worker it started
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'scripts'))
from jobs import kill_job  # noqa: E402  pylint: disable=wrong-import-position

EPOCHS = 6


def train(dirname, history_file):
    import numpy as np
    import torch
    from accelerate import Accelerator
    from sklearn.datasets import make_classification
    from skorch import NeuralNetClassifier
    from skorch.callbacks import LRScheduler

    from accel_mixin import AccelerateMixin
    from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

    class AcceleratedNet(AccelerateMixin, NeuralNetClassifier):
        pass

    torch.manual_seed(0)
    X, y = make_classification(4000, 20, n_informative=10, flip_y=0.1, random_state=0)
    module = torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(64, 2), torch.nn.Softmax(dim=-1))
    net = AcceleratedNet(
        module, accelerator=Accelerator(), max_epochs=EPOCHS, lr=0.2, batch_size=32,
        iterator_train__shuffle=True,
        callbacks=[
            LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5),
            TrainingCheckpoint(dirname, keep_last=2),
            ResumeTraining(dirname),
        ],
    )
    net.fit(X.astype(np.float32), y)
    if net.accelerator.is_main_process:
        rows = [{k: v for k, v in row.items() if k != 'dur'} for row in net.history]
        Path(history_file).write_text(json.dumps(rows))
    # Tear the process group down while Python is still whole: left to the
    # interpreter's exit, gloo's threads can abort the process.
    net.accelerator.end_training()


def launch(dirname, history_file):
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, ACCELERATE_USE_CPU='true', OMP_NUM_THREADS='1')
    return subprocess.Popen(
        [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2',
         '--master_addr=127.0.0.1', f'--master_port={port}', __file__, '--worker',
         '--dir', str(dirname), '--history', str(history_file)],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--dir', help=argparse.SUPPRESS)
    parser.add_argument('--history', help=argparse.SUPPRESS)
    parser.add_argument('--workdir', default=None, help='where to put checkpoints and histories')
    args = parser.parse_args()
    if args.worker:
        train(args.dir, args.history)
        return

    work = Path(args.workdir or tempfile.mkdtemp(prefix='accel_mixin_preemption_'))
    work.mkdir(parents=True, exist_ok=True)
    print(f"Working in {work}")

    print("1. An uninterrupted run of two processes ...", flush=True)
    if launch(work / 'uninterrupted', work / 'uninterrupted.json').wait() != 0:
        sys.exit("the uninterrupted run failed")

    print("2. The same run, killed soon after its third epoch's checkpoint ...", flush=True)
    run = launch(work / 'preempted', work / 'preempted.json')
    deadline = time.monotonic() + 300
    # TrainingCheckpoint writes into a folder of the run: preempted/run-<id>/
    while not list((work / 'preempted').glob('run-*/training-state-000003.pt')):
        if run.poll() is not None or time.monotonic() > deadline:
            sys.exit("the run ended before its third checkpoint")
        time.sleep(0.01)
    kill_job(run)  # a preemption: SIGKILL, no chance to clean up
    left = sorted(p.name for p in (work / 'preempted').glob('run-*/training-state-*.pt'))
    print(f"   killed; complete checkpoints: {', '.join(left)}", flush=True)

    print("3. The same command again: it resumes and trains the remaining epochs ...", flush=True)
    if launch(work / 'preempted', work / 'preempted.json').wait() != 0:
        sys.exit("the resumed run failed")

    uninterrupted = json.loads((work / 'uninterrupted.json').read_text())
    resumed = json.loads((work / 'preempted.json').read_text())
    for row in resumed:
        print(f"   epoch {row['epoch']}: train_loss {row['train_loss']:.6f} "
              f"valid_loss {row['valid_loss']:.6f} valid_acc {row['valid_acc']:.4f}")
    same = uninterrupted == resumed
    print(f"Histories of the uninterrupted and the preempted run identical: {same}")
    sys.exit(0 if same else 1)


if __name__ == '__main__':
    main()
