"""Train from a stream of files on disk, and resume inside an epoch after a
SIGKILL, exactly.

    python examples/streaming.py [--nproc 2] [--workdir DIR]

This script writes 12 shard files of samples, then runs the training script
(itself, with --worker) with torchrun on ``--nproc`` CPU processes:

1. once uninterrupted;
2. once where rank 0 is SIGKILLed in the middle of epoch 2, as a lost
   machine would be: torchrun ends the other workers, and the job fails;
3. the same command again: it resumes from the last training state, saved
   inside epoch 2, reading on from where each rank's stream stopped.

It then compares the histories and the weights of runs 1 and 3.

The stream is what you would write for your own files: an
``IterableDataset`` that reads the shards of its rank (as webdataset's
``split_by_node`` or ``datasets.distributed.split_dataset_by_node`` do), in
an order drawn anew each epoch (``set_epoch``), and that gives and takes its
position (``state_dict`` / ``load_state_dict``), so that a resumed run opens
the shard it stopped in, at the row it stopped at, without reading the
samples before it again.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SHARDS, ROWS, FEATURES = 12, 200, 20
EPOCHS = 3


def write_shards(folder):
    from sklearn.datasets import make_classification

    X, y = make_classification(SHARDS * ROWS, FEATURES, n_informative=10, random_state=0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(SHARDS):
        rows = slice(i * ROWS, (i + 1) * ROWS)
        np.savez(folder / f"shard-{i:03d}.npz", X=X[rows].astype(np.float32), y=y[rows])


def train(workdir, kill):
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from skorch import NeuralNetClassifier
    from skorch.callbacks import Callback

    from accel_mixin import AccelerateMixin
    from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

    class Shards(torch.utils.data.IterableDataset):
        """The rows of this rank's shard files, in an order drawn per epoch."""

        def __init__(self, files):
            self.files = sorted(files)
            self.epoch, self.file, self.row = 0, 0, 0  # where the next row is

        def set_epoch(self, epoch):
            self.epoch = epoch

        def mine(self):
            rank, world = (
                (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            )
            order = np.random.default_rng(self.epoch).permutation(len(self.files))
            return [self.files[i] for i in order][rank::world]

        def __iter__(self):
            files, start = self.mine(), (self.file, self.row)
            for f in range(start[0], len(files)):
                with np.load(files[f]) as shard:
                    X, y = shard["X"], shard["y"]
                for r in range(start[1] if f == start[0] else 0, len(X)):
                    self.file, self.row = f, r + 1
                    yield X[r], y[r]
            self.file, self.row = 0, 0  # the next epoch starts from its first shard

        def state_dict(self):
            return {"epoch": self.epoch, "file": self.file, "row": self.row}

        def load_state_dict(self, state):
            self.epoch, self.file, self.row = state["epoch"], state["file"], state["row"]

    class Net(AccelerateMixin, NeuralNetClassifier):
        pass

    class LoseAMachine(Callback):
        """Rank 0 is SIGKILLed after training batch 20 of epoch 2."""

        in_run_identity = False  # not part of what is trained

        def on_batch_end(self, net, training=False, **kwargs):
            at = (len(net.history), len(net.history[-1]["batches"]))
            if kill and training and net.accelerator.is_main_process and at == (2, 20):
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(64, 2),
        torch.nn.Softmax(dim=-1),
    )
    checkpoints = workdir / "checkpoints"
    net = Net(
        module,
        accelerator=Accelerator(),
        max_epochs=EPOCHS,
        lr=0.2,
        batch_size=16,
        train_split=None,
        verbose=0,
        callbacks=[
            TrainingCheckpoint(checkpoints, every_n_batches=8, keep_last=2),
            ResumeTraining(checkpoints),
            LoseAMachine(),
        ],
    )

    def position(path):  # (epochs done, batches done in the next)
        epochs, batches = re.match(r"training-state-(\d+)(?:-batch-(\d+))?", path.name).groups()
        return int(epochs), int(batches or 0)

    states = sorted(checkpoints.glob("run-*/training-state-*"), key=position)
    if states and net.accelerator.is_main_process:
        print(f"   found {states[-1].name}: ResumeTraining goes on from there", flush=True)
    net.fit(Shards((workdir.parent / "shards").glob("*.npz")), None)
    if net.accelerator.is_main_process:
        rows = [{k: v for k, v in row.items() if k != "dur"} for row in net.history]
        weights = [p.tolist() for p in net.accelerator.unwrap_model(net.module_).parameters()]
        result = {"history": rows, "weights": weights}
        (workdir / "result.json").write_text(json.dumps(result))
    net.accelerator.end_training()


def launch(workdir, nproc, kill=False):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        __file__,
        "--worker",
        "--dir",
        str(workdir),
        *(["--kill"] if kill else []),
    ]
    return subprocess.run(command, env=env, stderr=subprocess.DEVNULL, timeout=600).returncode


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--workdir", default=None, help="where to put shards and checkpoints")
    args = parser.parse_args()
    if args.worker:
        train(Path(args.dir), args.kill)
        return

    work = Path(args.workdir or tempfile.mkdtemp(prefix="accel_mixin_streaming_"))
    print(f"Working in {work}")
    write_shards(work / "shards")
    print(f"1. An uninterrupted run of {args.nproc} process(es) ...", flush=True)
    if launch(work / "uninterrupted", args.nproc) != 0:
        sys.exit("the uninterrupted run failed")
    print("2. The same run, rank 0 SIGKILLed after batch 20 of epoch 2 ...", flush=True)
    status = launch(work / "killed", args.nproc, kill=True)
    print(f"   exit status {status} (non-zero: the job failed)", flush=True)
    if status == 0:
        sys.exit("the killed run did not fail")
    print("3. The same command again: it resumes inside epoch 2 ...", flush=True)
    if launch(work / "killed", args.nproc) != 0:
        sys.exit("the resumed run failed")

    uninterrupted = json.loads((work / "uninterrupted" / "result.json").read_text())
    resumed = json.loads((work / "killed" / "result.json").read_text())
    for key in ("history", "weights"):
        print(
            f"{key.capitalize()} of the uninterrupted and the resumed run identical: "
            f"{uninterrupted[key] == resumed[key]}"
        )
    for row in uninterrupted["history"]:
        print(
            f"   epoch {row['epoch']}: train_loss {row['train_loss']:.6f}, "
            f"{row['train_batch_count']} batches"
        )
    if uninterrupted != resumed:
        sys.exit(1)


if __name__ == "__main__":
    main()
