"""Fit time beside PyTorch Lightning: accel_mixin, Lightning's
``Trainer(strategy="ddp")`` and a hand-written accelerate loop train the
same MLP on the same data, batch size per process, optimizer and epochs,
in the same launched job, with per-epoch validation (loss and accuracy on a
20% stratified split) and without.

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 scripts/benchmarks/vs_lightning.py \
        --out results/raw/lightning.json

The order rotates every round; the ratios are medians of per-round ratios
(accel_mixin's time over the other's, in the same round). Each trains with
shuffled batches, as skorch does by default; Lightning logs its validation
metrics with ``sync_dist=True``, as its docs recommend under DDP.
"""

import argparse
import logging
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from accelerate import Accelerator
from sklearn.datasets import make_classification
from skorch import NeuralNetClassifier

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from common import Timer, alternate, is_main, seed_everything, summarize, write_result
from fit import MLP, OursNet, loaders, loop_fit, nll

VARIANTS = ("accel_mixin", "lightning", "accelerate loop")


def ours(accelerator, X, y, args, validation):
    net = OursNet(
        MLP,
        accelerator=accelerator,
        max_epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        verbose=0,
        **({} if validation else {"train_split": None}),
    )
    net.fit(X, y)


class LitMLP(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.model, self.lr = MLP(), lr

    def training_step(self, batch, batch_idx):
        xb, yb = batch
        return nll(self.model(xb), yb)

    def validation_step(self, batch, batch_idx):
        xb, yb = batch
        proba = self.model(xb)
        self.log("valid_loss", nll(proba, yb), sync_dist=True)
        self.log("valid_acc", (proba.argmax(-1) == yb).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def lightning(accelerator, X, y, args, validation):
    train, valid = loaders(X, y, args, validation)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=accelerator.num_processes,
        strategy="ddp" if accelerator.num_processes > 1 else "auto",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(LitMLP(args.lr), train, valid)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")

    accelerator = Accelerator()
    X, y = make_classification(args.samples, 100, n_informative=20, random_state=0)
    X = X.astype(np.float32)
    fits = {"accel_mixin": ours, "lightning": lightning, "accelerate loop": loop_fit}
    results = {}
    for validation in (True, False):

        def measure(name, validation=validation):
            seed_everything(0)
            with Timer() as timer:
                fits[name](accelerator, X, y, args, validation)
            return timer.seconds

        for name in VARIANTS:  # warm up: imports, the first DDP
            measure(name)
        times = alternate(VARIANTS, args.repeats, measure)
        results["with validation" if validation else "without validation"] = summarize(
            times, "accel_mixin"
        )
    if is_main():
        for setup, summary in results.items():
            ratios = ", ".join(
                f"{1 / summary[name]['paired_ratio']:.2f} x {name}" for name in VARIANTS[1:]
            )
            print(f"{setup}: accel_mixin takes {ratios}")
    write_result(
        args.out,
        {
            "benchmark": "lightning",
            "processes": accelerator.num_processes,
            "setup": (
                f"{args.samples} x 100 MLP (2 hidden layers of 256), {args.epochs} epochs, "
                f"batch {args.batch_size} per process, SGD"
            ),
            "versions": {"lightning": pl.__version__, "skorch": NeuralNetClassifier.__module__},
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
