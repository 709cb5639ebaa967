"""Fit time: plain skorch, the incumbent, accel_mixin and a hand-written
accelerate loop doing the same work (training, then per-epoch validation loss
and accuracy on a 20% stratified split). Three variants of accel_mixin add a
TrainingCheckpoint that never saves: what polling for preemption notices
costs (and what polling after every batch cost), and what it costs with
signals=(). With several processes, 'accel_mixin, padding trains' is the fit
as before N processes trained as one (the samples that fill the last global
batch train): what the shares of the last batch cost.

    python scripts/benchmarks/fit.py --out results/raw/fit_1.json
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 scripts/benchmarks/fit.py --out ...

With several processes, plain skorch is left out (it would train one model
per process), and the incumbent uses the criterion workaround it needs to fit
at all (a criterion with a dummy trainable parameter; see FIELD_NOTES).
"""

import argparse
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from sklearn.datasets import make_classification
from sklearn.model_selection import train_test_split
from skorch import NeuralNet, NeuralNetClassifier
from skorch.hf import AccelerateMixin as IncumbentMixin

sys.path.insert(0, str(Path(__file__).resolve().parent))
# pylint: disable=wrong-import-position
from common import Timer, alternate, seed_everything, summarize, write_result
from report import EVERY_BATCH, PADDED, POLLING, QUIET

from accel_mixin import AccelerateMixin
from accel_mixin.callbacks import TrainingCheckpoint
from accel_mixin.distributed.preemption import NoticeBoard
from accel_mixin.training import epochs, wrapping


class OursNet(AccelerateMixin, NeuralNetClassifier):
    pass


class IncumbentNet(IncumbentMixin, NeuralNetClassifier):
    pass


class NoSyncNet(OursNet):
    """accel_mixin without history sync (no padding accounting, no merge at
    the end of an epoch): what the sync costs."""

    run_single_epoch = NeuralNet.run_single_epoch

    def _end_epoch(self, **cb_kwargs):
        NeuralNet.notify(self, "on_epoch_end", **cb_kwargs)


class MLP(torch.nn.Module):
    def __init__(self, n_features=100, hidden=256, n_classes=2):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(n_features, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, n_classes),
            torch.nn.Softmax(dim=-1),
        )

    def forward(self, X):
        return self.layers(X)


class ParamNLLLoss(torch.nn.NLLLoss):
    """The incumbent's workaround: a trainable parameter makes DDP accept the
    criterion. It takes log-probabilities itself because, wrapped in DDP, the
    criterion no longer looks like NLLLoss to skorch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, y_pred, y_true):
        return super().forward(torch.log(y_pred + 1e-7), y_true) + 0.0 * self.dummy.sum()


NO_SYNC = "accel_mixin, no history sync"


def skorch_fit(net_cls, X, y, args, **kwargs):
    net = net_cls(
        MLP, max_epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, verbose=0, **kwargs
    )
    net.fit(X, y)
    return net.history[-1, "valid_acc"]


def loaders(X, y, args, validation=True):
    """Shuffled training batches, as skorch's, and with ``validation`` the
    20% stratified split."""
    if validation:
        X, X_valid, y, y_valid = train_test_split(X, y, test_size=0.2, stratify=y, random_state=0)

    def loader(Xs, ys, shuffle):
        data = torch.utils.data.TensorDataset(torch.as_tensor(Xs), torch.as_tensor(ys))
        return torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=shuffle)

    return loader(X, y, True), loader(X_valid, y_valid, False) if validation else None


def nll(proba, target):
    return torch.nn.functional.nll_loss(torch.log(proba + 1e-7), target)


def loop_fit(accelerator, X, y, args, validation=True):
    """What a user writes by hand with accelerate for the same work; the
    last epoch's validation accuracy."""
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    train, valid = loaders(X, y, args, validation)
    model, optimizer, train = accelerator.prepare(model, optimizer, train)
    valid = accelerator.prepare(valid) if validation else None
    accuracy = None
    for _ in range(args.epochs):
        model.train()
        train_losses = []
        for xb, yb in train:
            with accelerator.accumulate(model):
                loss = nll(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            train_losses.append(loss.item())
        if valid is None:
            continue
        model.eval()
        valid_losses, correct, seen = [], 0, 0
        with torch.no_grad():
            for xb, yb in valid:
                proba = model(xb)
                valid_losses.append(nll(proba, yb).item())
                preds, targets = accelerator.gather_for_metrics((proba.argmax(-1), yb))
                correct += (preds == targets).sum().item()
                seen += len(targets)
        accuracy = correct / seen
    # without this the loop's objects would pile up over the repeats
    for name in ("_models", "_optimizers", "_schedulers", "_dataloaders"):
        getattr(accelerator, name).clear()
    return accuracy


def polling_every_batch(fit):
    """The fit, polling for notices after every batch as before the ranks
    agreed on intervals: what the intervals save."""
    interval, NoticeBoard.max_interval = NoticeBoard.max_interval, 1
    try:
        return fit()
    finally:
        NoticeBoard.max_interval = interval


def padding_trains(fit):
    """The fit as before N processes trained as one: the padding of the last
    global batch trains, and accelerate's generator keeps its first seed."""
    mean, draw = epochs.criterion_is_mean, wrapping.draw_orders_as_one_process
    epochs.criterion_is_mean = lambda criterion: False
    wrapping.draw_orders_as_one_process = lambda prepared: None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fit()
    finally:
        epochs.criterion_is_mean, wrapping.draw_orders_as_one_process = mean, draw


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--only", nargs="*", default=None, help="run only these variants")
    args = parser.parse_args()

    accelerator = Accelerator()
    processes = accelerator.num_processes
    X, y = make_classification(args.samples, 100, n_informative=20, random_state=0)
    X = X.astype(np.float32)

    variants = {
        "accel_mixin": lambda: skorch_fit(OursNet, X, y, args, accelerator=accelerator),
        "incumbent": lambda: skorch_fit(
            IncumbentNet,
            X,
            y,
            args,
            accelerator=accelerator,
            **({"criterion": ParamNLLLoss} if processes > 1 else {}),
        ),
        "accelerate loop": lambda: loop_fit(accelerator, X, y, args),
    }
    folder = tempfile.mkdtemp(prefix="fit-bench-") if accelerator.is_main_process else None
    folder = gather_object([folder])[0] if processes > 1 else folder
    variants[POLLING] = lambda: skorch_fit(
        OursNet,
        X,
        y,
        args,
        accelerator=accelerator,
        callbacks=[TrainingCheckpoint(folder, every_n_epochs=10**9)],
    )
    variants[QUIET] = lambda: skorch_fit(
        OursNet,
        X,
        y,
        args,
        accelerator=accelerator,
        callbacks=[TrainingCheckpoint(folder, every_n_epochs=10**9, signals=())],
    )
    if processes == 1:
        variants = {"skorch": lambda: skorch_fit(NeuralNetClassifier, X, y, args), **variants}
    else:
        variants[NO_SYNC] = lambda: skorch_fit(NoSyncNet, X, y, args, accelerator=accelerator)
        variants[EVERY_BATCH] = lambda: polling_every_batch(variants[POLLING])
        variants[PADDED] = lambda: padding_trains(variants["accel_mixin"])
    if args.only:
        variants = {name: fit for name, fit in variants.items() if name in args.only}
    baseline = next(iter(variants))

    # The first optimizer a process builds imports torch._dynamo (about
    # 1.5 s): warm every variant up before timing.
    for fit in variants.values():
        fit()

    accuracy = {}

    def measure(name):
        seed_everything(0)
        with Timer() as timer:
            accuracy[name] = variants[name]()
        return timer.seconds

    times = alternate(variants, args.repeats, measure)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(folder)
    write_result(
        args.out,
        {
            "benchmark": "fit",
            "processes": processes,
            "setup": (
                f"{args.samples} x 100 MLP (2 hidden layers of 256), {args.epochs} epochs, "
                f"batch {args.batch_size} per process, 20% validation"
            ),
            "baseline": baseline,
            "incumbent_workaround": processes > 1,
            "valid_acc": accuracy,
            "results": summarize(times, baseline),
        },
    )


if __name__ == "__main__":
    main()
