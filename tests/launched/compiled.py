"""``compile=True`` with torch.compile's default backend (inductor, which
generates C++ on a CPU) under DDP: training follows the eager net's, the
ranks end with equal weights, and ``save_params`` loads into a plain skorch
net that was never compiled.

Usage: torchrun --nproc_per_node 2 compiled.py DIR

``core_checks.py`` runs these checks in its launch (``compiled_checks``).
"""

import hashlib
import os
import sys

import numpy as np
import torch
from common import MLP, AcceleratedNet, Checks, make_accelerator, make_data, report
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback


class Wrapping(Callback):
    """What ``module_`` is while training (afterwards the net is unwrapped)."""

    def on_batch_end(self, net, **kwargs):
        module, self.seen_ = net.module_, []
        while module is not None:
            self.seen_.append(type(module).__name__)
            inner = vars(module).get("_modules", {}).get("module")  # DDP's
            module = inner if inner is not None else getattr(module, "_orig_mod", None)


def compiled_checks(dirname):
    """The checks, with the files they write in ``dirname``: their results."""
    accelerator = make_accelerator()
    checks = Checks()
    X, y = make_data(200)

    def fit(compiled):
        torch.manual_seed(0)
        net = AcceleratedNet(
            MLP,
            accelerator=accelerator,
            compile=compiled,
            max_epochs=2,
            lr=0.1,
            batch_size=32,
            train_split=None,
            verbose=0,
            callbacks=[Wrapping()],
        )
        return net.fit(X, y)

    compiled, eager = fit(True), fit(False)

    @checks
    def the_module_trains_in_ddp_compiled():
        return dict(compiled.callbacks_)["Wrapping"].seen_

    @checks
    def training_follows_the_eager_net():
        ours, theirs = compiled.history[:, "train_loss"], eager.history[:, "train_loss"]
        # inductor fuses and vectorises: the same arithmetic in another order
        assert np.allclose(ours, theirs, rtol=1e-4), (ours, theirs)
        proba, expected = compiled.predict_proba(X), eager.predict_proba(X)
        assert np.allclose(proba, expected, atol=1e-5), np.abs(proba - expected).max()
        return float(np.abs(proba - expected).max())

    @checks
    def weights_digest():
        digest = hashlib.sha256()
        for value in compiled.accelerator.unwrap_model(compiled.module_).state_dict().values():
            digest.update(value.detach().cpu().numpy().tobytes())
        return digest.hexdigest()

    @checks
    def saved_params_load_into_a_plain_net():
        path = os.path.join(dirname, "compiled.pt")
        compiled.save_params(f_params=path)
        plain = NeuralNetClassifier(MLP, verbose=0).initialize()
        plain.load_params(f_params=path)
        proba, expected = plain.predict_proba(X), compiled.predict_proba(X)
        assert np.allclose(proba, expected, atol=1e-5), np.abs(proba - expected).max()
        return sorted(plain.module_.state_dict())

    return checks.results


if __name__ == "__main__":
    report(compiled_checks(sys.argv[1]))
