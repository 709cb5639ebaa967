"""save_state and load_state under several processes: the API, errors on
every rank, and asynchronous writes whose failure reaches every rank
(``resume_run.py`` runs them after its resumes, ``run``). Files are written
in the working directory.
"""

import os
import shutil
from pathlib import Path

import numpy as np
import torch
from common import MLP, AcceleratedNet, make_accelerator, make_data, outcome

from accel_mixin.callbacks import TrainingCheckpoint
from accel_mixin.checkpoint.weights import strip_wrapper_prefixes
from accel_mixin.resume.state_folder import read_whole


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

    def loads_wait(net, saved_slowly, loaded):
        expected = saved_slowly(net)
        net.wait_for_saves()  # another net's load waits only for its own saves
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
        written = read_whole("slow.pt")["modules"]["module"]
        names = strip_wrapper_prefixes(dict(net.module_.named_parameters()))
        params_waited = all(torch.equal(written[n], b) for n, b in zip(names, expected))
        return {"other_net": other_net, "same_net": same_net, "params_waited": params_waited}

    @checks
    def round_trip():
        net = make_net()
        net.fit(X, y)
        net.save_state("asynchronous.pt", asynchronous=True)
        net.wait_for_saves()
        net.save_state("state.pt")
        fresh = make_net()
        fresh.load_state("state.pt")
        fresh.partial_fit(X, y)  # resumed: the remaining epochs, none
        return {
            "same_predictions": bool(np.array_equal(fresh.predict_proba(X), net.predict_proba(X))),
            "epochs": len(fresh.history),
            "keys": sorted(read_whole("state.pt")),
            # one folder each, every rank's part in it
            "folders": sorted(sorted(os.listdir(name)) for name in ("asynchronous.pt", "state.pt")),
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
        """load_state and load_params of this net right after
        save_state(asynchronous=True) of a write that takes a while, and a
        fresh net's load_state after its wait_for_saves: each loads the new
        state."""
        import time

        import accel_mixin.checkpoint.dcp_folder as dcp_folder

        net = make_net(max_epochs=1)
        net.fit(X, y)
        net.save_state("slow.pt")
        commit_folder = dcp_folder.commit_folder

        def slow_commit_folder(*args, **kwargs):
            # rank 0's commit, after every rank's DCP save ended
            time.sleep(1.0)
            return commit_folder(*args, **kwargs)

        def saved_slowly(net):
            net.partial_fit(X, y)
            net.save_state("slow.pt", asynchronous=True)
            return [p.detach().clone() for p in net.module_.parameters()]

        def loaded(net, expected):
            return all(torch.equal(a, b) for a, b in zip(net.module_.parameters(), expected))

        # the save's thread looks the name up when it commits: patched throughout
        dcp_folder.commit_folder = slow_commit_folder
        try:
            return loads_wait(net, saved_slowly, loaded)
        finally:
            dcp_folder.commit_folder = commit_folder
