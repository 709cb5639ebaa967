"""save_state and load_state under several processes: the API, errors on
every rank, and asynchronous writes whose failure reaches every rank
(``resume_run.py`` runs them after its resumes, ``run``). Files are written
in the working directory.
"""

import shutil
from pathlib import Path

import numpy as np
import torch
from common import MLP, AcceleratedNet, make_accelerator, make_data, outcome

from accel_mixin.callbacks import TrainingCheckpoint


class RemoveDirAfterFirstSave(TrainingCheckpoint):
    """The folder vanishes after the first save, so the next write fails."""

    def on_epoch_finished(self, net, **kwargs):
        super().on_epoch_finished(net, **kwargs)
        net.wait_for_saves()
        net.accelerator.wait_for_everyone()
        if net.accelerator.is_main_process and Path(self.dirname).exists():
            shutil.rmtree(self.dirname)


def run(checks):
    """Every check, in order, each with an accelerator of its own settings
    (the process's last: accelerate's gradient state is per process)."""
    accelerator = make_accelerator()
    X, y = make_data(300)

    def make_net(**kwargs):
        params = dict(module=MLP, accelerator=accelerator, max_epochs=2, verbose=0, lr=0.1)
        params.update(kwargs)
        return AcceleratedNet(**params)

    @checks
    def round_trip():
        import accel_mixin.checkpoint.files as files

        net = make_net()
        net.fit(X, y)
        # the files this rank writes, synchronously and in the background
        writes, atomic_write = [], files.atomic_write

        def counting_atomic_write(path, write, **kwargs):
            writes.append(str(path))
            return atomic_write(path, write, **kwargs)

        files.atomic_write = counting_atomic_write
        try:
            net.save_state("asynchronous.pt", asynchronous=True)
            net.wait_for_saves()
            net.save_state("state.pt")
        finally:
            files.atomic_write = atomic_write
        fresh = make_net()
        fresh.load_state("state.pt")
        fresh.partial_fit(X, y)  # resumed: the remaining epochs, none
        return {
            "same_predictions": bool(np.array_equal(fresh.predict_proba(X), net.predict_proba(X))),
            "epochs": len(fresh.history),
            "keys": sorted(torch.load("state.pt", weights_only=True)),
            "writes": writes,
        }

    @checks
    def mismatch_raises_on_every_rank():
        wide = make_net(module__hidden=64).initialize()
        return {
            "architecture": outcome(lambda: wide.load_state("state.pt")),
            "params_file": outcome(
                lambda: (
                    make_net().initialize().save_params(f_params="p.pt"),
                    make_net().load_state("p.pt"),
                )
            ),
            "missing": outcome(lambda: make_net().load_state("nope.pt")),
        }

    @checks
    def asynchronous_failure_reaches_every_rank():
        net = make_net(
            max_epochs=3,
            callbacks=[RemoveDirAfterFirstSave("vanishing", asynchronous=True, every_n_epochs=1)],
        )
        return {"error": outcome(lambda: net.fit(X, y))}

    @checks
    def load_right_after_an_asynchronous_save():
        """load_state and load_params, of this net and of a fresh one, right
        after save_state(asynchronous=True) of a write that takes a while: each
        loads the new state."""
        import time

        import accel_mixin.checkpointing as checkpointing

        net = make_net(max_epochs=1)
        net.fit(X, y)
        net.save_state("slow.pt")
        write_state = checkpointing.write_state

        def slow_write_state(*args, **kwargs):
            time.sleep(1.0)
            return write_state(*args, **kwargs)

        def saved_slowly(net):
            net.partial_fit(X, y)
            checkpointing.write_state = slow_write_state
            try:
                net.save_state("slow.pt", asynchronous=True)
            finally:
                checkpointing.write_state = write_state
            return [p.detach().clone() for p in net.module_.parameters()]

        def loaded(net, expected):
            return all(torch.equal(a, b) for a, b in zip(net.module_.parameters(), expected))

        expected = saved_slowly(net)
        fresh = make_net(max_epochs=1)
        fresh.load_state("slow.pt")
        other_net = loaded(fresh, expected)
        expected = saved_slowly(net)
        net.load_state("slow.pt")
        same_net = loaded(net, expected)
        net.save_params(f_params="slow-params.pt")
        expected = saved_slowly(net)  # a state in flight, then params of an older epoch
        net.load_params(f_params="slow-params.pt")
        # on return the state in flight is in its file, on every rank
        written = torch.load("slow.pt", weights_only=True)["modules"]["module"]
        params_waited = all(torch.equal(a, b) for a, b in zip(written.values(), expected))
        return {"other_net": other_net, "same_net": same_net, "params_waited": params_waited}
