"""Train on several processes, save, and load into accelerated and plain nets.

Run it on two CPU processes:

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 examples/save_load.py

or on the GPUs of this machine:

    accelerate launch --multi_gpu --num_processes 2 examples/save_load.py

Every process runs this script. The net trains with DDP across them, saves
from the main process only, and loads on every process. The main process
prints the test accuracy of the trained net, of a fresh accelerated net that
loaded the file, and of a plain skorch net that loaded it: all three match.
"""

import argparse
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from sklearn.datasets import make_classification
from sklearn.model_selection import train_test_split
from skorch import NeuralNetClassifier

from accel_mixin import AccelerateMixin


class AcceleratedNet(AccelerateMixin, NeuralNetClassifier):
    """A NeuralNetClassifier that trains with accelerate."""


class MLP(torch.nn.Module):
    def __init__(self, n_features=20, hidden=64, n_classes=2):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(n_features, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, n_classes),
            torch.nn.Softmax(dim=-1),
        )

    def forward(self, X):
        return self.layers(X)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="accel_mixin_demo", help="folder for the saved files")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()

    # A short collective timeout: should a process die, the others stop soon.
    accelerator = Accelerator(
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=60))]
    )
    say = accelerator.print

    X, y = make_classification(3000, 20, n_informative=10, random_state=0)
    X_train, X_test, y_train, y_test = train_test_split(X.astype(np.float32), y, random_state=0)

    torch.manual_seed(0)
    net = AcceleratedNet(
        MLP,
        accelerator=accelerator,
        max_epochs=args.epochs,
        lr=0.1,
        batch_size=64,
        iterator_train__shuffle=True,
    )
    say(
        f"Training on {accelerator.num_processes} process(es) "
        f"({accelerator.distributed_type}, device {accelerator.device})"
    )
    net.fit(X_train, y_train)
    before = net.score(X_test, y_test)

    out = Path(args.out).resolve()
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    files = {
        "f_params": out / "params.pt",
        "f_optimizer": out / "optimizer.pt",
        "f_history": out / "history.json",
    }
    net.save_params(**files)

    fresh = AcceleratedNet(MLP, accelerator=accelerator).initialize()
    fresh.load_params(**files)
    after_accelerated = fresh.score(X_test, y_test)

    plain = NeuralNetClassifier(MLP).initialize()
    plain.load_params(f_params=files["f_params"])
    after_plain = plain.score(X_test, y_test)

    say(f"Test accuracy after training:            {before:.4f}")
    say(f"Test accuracy, accelerated net reloaded: {after_accelerated:.4f}")
    say(f"Test accuracy, plain skorch net reloaded: {after_plain:.4f}")
    say(f"Saved to {out}: {', '.join(sorted(p.name for p in files.values()))}")
    # Tear the process group down while Python is still whole: left to the
    # interpreter's exit, gloo's threads can abort the process.
    accelerator.end_training()
    if not before == after_accelerated == after_plain:
        raise SystemExit("Accuracies differ after loading")


if __name__ == "__main__":
    main()
