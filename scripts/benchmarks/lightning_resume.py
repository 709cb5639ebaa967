"""Checkpoints beside PyTorch Lightning: the stall of an epoch-end checkpoint,
the time from a restart to the first trained batch, and what each resumes
exactly.

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 scripts/benchmarks/lightning_resume.py \
        --out results/raw/lightning_resume_2.json --states /tmp/states
    python scripts/benchmarks/lightning_resume.py --out results/raw/lightning_resume_1.json \
        --states /tmp/states --other-count

The job is ``vs_lightning.py``'s: the same MLP, data, batch size per process,
SGD and shuffled batches, here without validation.

- Stall: ``TrainingCheckpoint`` against Lightning's ``ModelCheckpoint`` (with
  ``AsyncCheckpointIO`` for asynchronous writes), saving at every epoch's
  end; the time each one's epoch-end hook blocks training, on rank 0.
- Restart: a run stopped after the first epoch (or inside the second) is
  resumed; the time from creating the net or the ``Trainer`` to the end of
  the first batch it trains, on rank 0.
- Exactness: the resumed runs' final weights against the uninterrupted run's
  (the largest absolute difference; 0 is bit for bit). With
  ``--other-count`` (run on another number of processes), the states the
  first launch left in ``--states`` are resumed there.
"""

import argparse
import json
import logging
import math
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from accelerate import Accelerator
from lightning.pytorch.callbacks import Callback as LitCallback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from sklearn.datasets import make_classification
from skorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from common import alternate, barrier, is_main, seed_everything, write_result
from fit import MLP, OursNet, loaders
from vs_lightning import LitMLP

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

STALLS = ("accel_mixin", "lightning", "accel_mixin async", "lightning async")


class Stop(Exception):
    """Ends a run where a restart begins."""


class OursTimer(Callback):
    """Times the checkpoint's epoch-end hook, the first batch, and stops."""

    in_run_identity = False

    def __init__(self, start=None, stop_at=None):
        self.start, self.stop_at = start, stop_at

    def initialize(self):
        self.first_batch_ = None
        return self

    def state_dict(self):
        return {}  # a resumed run times itself afresh

    def on_epoch_begin(self, net, **kwargs):
        # batch 0: as the epoch begins, once the state of the one before is saved
        if self.stop_at == (len(net.history), 0):
            raise Stop

    def on_batch_end(self, net, training=False, **kwargs):
        if training and self.first_batch_ is None and self.start is not None:
            self.first_batch_ = time.perf_counter() - self.start
        done = (len(net.history), len(net.history[-1]["batches"]))
        if training and done == self.stop_at:
            raise Stop


class TimedCheckpoint(TrainingCheckpoint):
    """Records how long each epoch end's hook blocks training."""

    def initialize(self):
        super().initialize()
        self.stalls_ = []
        return self

    def on_epoch_finished(self, net, stopped=False, **kwargs):
        start = time.perf_counter()
        super().on_epoch_finished(net, stopped=stopped, **kwargs)
        self.stalls_.append(time.perf_counter() - start)


class LitTimer(LitCallback):
    def __init__(self, start=None, stop_at=None):
        self.start, self.stop_at, self.first_batch = start, stop_at, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first_batch is None and self.start is not None:
            self.first_batch = time.perf_counter() - self.start
        if (trainer.current_epoch + 1, batch_idx + 1) == self.stop_at:
            raise Stop


class TimedModelCheckpoint(ModelCheckpoint):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stalls = []

    def on_train_epoch_end(self, trainer, pl_module):
        start = time.perf_counter()
        super().on_train_epoch_end(trainer, pl_module)
        if not self._every_n_train_steps:
            self.stalls.append(time.perf_counter() - start)


def weights(module):
    # without DDP's prefix, which the runs of another number of processes lack
    state = module.state_dict()
    return {key.removeprefix("module."): value.detach().clone() for key, value in state.items()}


def largest_difference(a, b):
    return max((a[key].double() - b[key].double()).abs().max().item() for key in a)


class Job:
    """One framework's runs on the benchmark's data, in ``folder``."""

    def __init__(self, accelerator, X, y, args, folder):
        self.accelerator, self.X, self.y, self.args = accelerator, X, y, args
        self.folder = Path(folder)

    def ours(self, folder, callbacks):
        seed_everything(0)
        net = OursNet(
            MLP,
            accelerator=self.accelerator,
            max_epochs=self.args.epochs,
            batch_size=self.args.batch_size,
            lr=self.args.lr,
            train_split=None,
            verbose=0,
            callbacks=callbacks,
        )
        try:
            net.fit(self.X, self.y)
        except Stop:
            pass
        return net

    def lightning(self, callbacks, plugins=(), ckpt_path=None, stop=False):
        seed_everything(0)
        model = LitMLP(self.args.lr)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=self.accelerator.num_processes,
            strategy="ddp" if self.accelerator.num_processes > 1 else "auto",
            max_epochs=self.args.epochs,
            logger=False,
            enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=list(callbacks),
            plugins=list(plugins),
        )
        train, _ = loaders(self.X, self.y, self.args, validation=False)
        try:
            trainer.fit(model, train, ckpt_path=ckpt_path)
        except Stop:
            if not stop:
                raise
        return model.model

    def fresh(self, name):
        folder = self.folder / name
        if is_main():
            shutil.rmtree(folder, ignore_errors=True)
        barrier()
        return folder

    def copy(self, source, name):
        folder = self.folder / name
        if is_main():
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(source, folder)
        barrier()
        return folder


def stalls(job, args):
    """Per variant, the median stall of an epoch-end checkpoint."""

    def measure(name):
        folder = job.fresh("stall")
        asynchronous = name.endswith("async")
        if name.startswith("accel_mixin"):
            checkpoint = TimedCheckpoint(str(folder), asynchronous=asynchronous, signals=())
            job.ours(folder, [checkpoint])
            found = checkpoint.stalls_
        else:
            checkpoint = TimedModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1)
            job.lightning([checkpoint], plugins=[AsyncCheckpointIO()] if asynchronous else [])
            found = checkpoint.stalls
        assert len(found) == args.epochs, found
        return statistics.median(found)

    return alternate(STALLS, args.repeats, measure)


def stopped_runs(job, args):
    """The uninterrupted runs' weights, and the states of stopped runs."""
    per_epoch = math.ceil(math.ceil(args.samples / job.accelerator.num_processes) / args.batch_size)
    every = args.every or max(1, per_epoch // 2)
    points = {"epoch end": (2, 0), "mid-epoch": (2, every + 1)}
    reference, states = {}, {}
    net = job.ours(None, [])
    reference["accel_mixin"] = weights(net.module_)
    reference["lightning"] = weights(job.lightning([]))
    for point, (epoch, batch) in points.items():
        folder = job.fresh(f"ours {point}")
        stop = OursTimer(stop_at=(epoch, batch))
        job.ours(folder, [TrainingCheckpoint(str(folder), every_n_batches=every, signals=()), stop])
        states[("accel_mixin", point)] = folder
        folder = job.fresh(f"lightning {point}")
        # Lightning counts steps over the epochs: its one state inside the
        # second epoch is where ours is
        checkpoint = (
            ModelCheckpoint(dirpath=folder, every_n_train_steps=per_epoch + every, save_top_k=-1)
            if batch
            else ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1)
        )
        job.lightning([checkpoint, LitTimer(stop_at=(epoch, batch or 1))], stop=True)
        barrier()
        newest = max(folder.glob("*.ckpt"), key=lambda path: path.stat().st_mtime)
        states[("lightning", point)] = newest
    return reference, states


def resume(job, framework, state, name):
    """Resume from ``state``: (seconds to the first trained batch, weights,
    where it resumed from)."""
    if framework == "accel_mixin":
        folder = job.copy(state, name)
        start = time.perf_counter()
        timer = OursTimer(start=start)
        resumer = ResumeTraining(str(folder))
        net = job.ours(folder, [resumer, timer])
        where = Path(resumer.resumed_from_).name if resumer.resumed_from_ else "nothing"
        return timer.first_batch_, weights(net.module_), where
    start = time.perf_counter()
    timer = LitTimer(start=start)
    module = job.lightning([timer], ckpt_path=state)
    return timer.first_batch, weights(module), Path(state).name


def restarts(job, args, states, reference):
    times = {key: [] for key in states}
    exact = {}
    for round_ in range(args.repeats):
        keys = list(states)
        shift = round_ % len(keys)
        for key in keys[shift:] + keys[:shift]:
            seconds, final, where = resume(job, key[0], states[key], "resumed")
            times[key].append(seconds)
            exact[key] = {
                "largest_difference": largest_difference(final, reference[key[0]]),
                "from": where,
            }
    return times, exact


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--states", required=True, help="folder for the runs' states")
    parser.add_argument("--other-count", action="store_true", help="resume the states left there")
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=0, help="batches between mid-epoch states")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*random number streams.*")

    accelerator = Accelerator()
    X, y = make_classification(args.samples, 100, n_informative=20, random_state=0)
    X = X.astype(np.float32)
    states_file = Path(args.states) / "states.json"
    result = {"benchmark": "lightning_resume", "processes": accelerator.num_processes}
    if args.other_count:
        saved = json.loads(states_file.read_text())
        job = Job(accelerator, X, y, args, Path(args.states) / "other count")
        reference = {
            key: torch.load(path, weights_only=True) for key, path in saved["reference"].items()
        }
        states = {tuple(key.split(" | ")): path for key, path in saved["states"].items()}
        _, exact = restarts(job, argparse.Namespace(repeats=1), states, reference)
        result.update(saved_by=saved["processes"], exact=_keyed(exact))
    else:
        job = Job(accelerator, X, y, args, args.states)
        result["stall_s"] = stalls(job, args)
        reference, states = stopped_runs(job, args)
        times, exact = restarts(job, args, states, reference)
        result.update(restart_s=_keyed(times), exact=_keyed(exact))
        if is_main():
            paths = {}
            for key, value in reference.items():
                paths[key] = str(Path(args.states) / f"reference {key}.pt")
                torch.save(value, paths[key])
            states_file.write_text(
                json.dumps(
                    {
                        "processes": accelerator.num_processes,
                        "reference": paths,
                        "states": {" | ".join(key): str(path) for key, path in states.items()},
                    }
                )
            )
    if is_main():
        print(
            json.dumps({k: v for k, v in result.items() if k != "stall_s"}, indent=1, default=float)
        )
    write_result(args.out, result)


def _keyed(by_pair):
    return {" | ".join(key): value for key, value in by_pair.items()}


if __name__ == "__main__":
    main()
