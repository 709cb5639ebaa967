"""Training states and params files on an S3 server (a moto server that the
test starts on localhost), from machines that share no filesystem.

Usage: object_store_run.py nodes URL   (under run_nodes: each node in its own folder)
       object_store_run.py kill URL    (one process: a save killed before its commit)
       object_store_run.py killed URL  (one process: what the killed save left)
       object_store_run.py load URL    (one process: the sharded state of ``nodes``)

The S3 endpoint and credentials come from the environment (``AWS_*``), as
on a cluster.
"""

import os
import signal
import sys

import numpy as np
from common import (
    Checks,
    make_data,
    make_fsdp_accelerator,
    report,
    seeded_net,
    write_report,
)
from streams_run import Stop, StopAt

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint
from accel_mixin.checkpoint import object_states, storage

MODE, URL = sys.argv[1], sys.argv[2].rstrip("/")
X, y = make_data(200)


def weights(net):
    return [p.detach().cpu().numpy().copy() for p in net.module_.parameters()]


def furthest(a, b):
    return max(float(np.abs(x - z).max()) for x, z in zip(a, b))


def resumed_against_uninterrupted(dirname, first, last, stop=None, **checkpoint):
    """Fit to ``first`` epochs (or until ``stop``) saving to ``dirname``, fit
    again to ``last``, resuming; against one fit to ``last``: what resumed,
    how far the weights are, and what the run folder holds then."""

    def callbacks():
        return [TrainingCheckpoint(dirname, keep_last=1, **checkpoint), ResumeTraining(dirname)]

    try:
        seeded_net(first, [*callbacks(), *([stop] if stop else [])]).fit(X, y)
    except Stop:
        pass
    resumed = seeded_net(last, callbacks())
    resumed.fit(X, y)
    alone = seeded_net(last)
    alone.fit(X, y)
    callbacks_ = dict(resumed.callbacks_)
    folder = callbacks_["TrainingCheckpoint"].run_folder_
    states = sorted(storage.listdir(folder))
    newest = storage.join(folder, [name for name in states if name != "manifest.json"][-1])
    return {
        "resumed_from": storage.split(callbacks_["ResumeTraining"].resumed_from_)[1],
        "furthest": furthest(weights(resumed), weights(alone)),
        "epochs": len(resumed.history),
        "folder": states,
        "newest": sorted(storage.listdir(newest))
        if newest.rsplit("/", 1)[1] != "manifest.json"
        else [],
    }


if MODE == "nodes":
    checks = Checks(deadline=240)
    cwd_before = sorted(os.listdir("."))

    @checks
    def resumes():
        return resumed_against_uninterrupted(f"{URL}/runs-sync", 2, 4)

    @checks
    def resumes_asynchronous():
        return resumed_against_uninterrupted(f"{URL}/runs-async", 2, 4, asynchronous=True)

    @checks
    def resumes_inside_an_epoch():
        return resumed_against_uninterrupted(
            f"{URL}/runs-inside", 3, 3, stop=StopAt(2, 5), every_n_batches=2
        )

    @checks
    def params():
        net = seeded_net(1)
        net.fit(X, y)
        files = {
            "f_params": f"{URL}/params/params.pt",
            "f_optimizer": f"{URL}/params/optimizer.pt",
            "f_history": f"{URL}/params/history.json",
        }
        net.save_params(**files)
        loaded = seeded_net(1).initialize()
        loaded.load_params(**files)
        return {
            "furthest": furthest(weights(net), weights(loaded)),
            "history": len(loaded.history),
            "optimizer": loaded.optimizer_.state_dict()["state"].keys().__len__(),
        }

    @checks
    def sharded():
        net = seeded_net(1, accelerator=make_fsdp_accelerator)
        net.fit(X, y)
        net.save_state(f"{URL}/sharded-state")
        net.save_params(f_params=f"{URL}/sharded-params.pt")
        return True

    checks.results["local_files"] = {"ok": True, "value": sorted(os.listdir(".")) == cwd_before}
    report(checks.results)

elif MODE == "load":  # the sharded state of two processes, on one
    net = seeded_net(1).initialize()
    net.load_state(f"{URL}/sharded-state")
    full = seeded_net(1).initialize()
    full.load_params(f_params=f"{URL}/sharded-params.pt")
    report({"furthest": furthest(weights(net), weights(full)), "epochs": len(net.history)})

elif MODE == "kill":
    net = seeded_net(1)
    net.fit(X, y)
    net.save_state(f"{URL}/state")
    saved = weights(net)
    net.partial_fit(X, y)
    write_report({"saved": [w.tolist() for w in saved], "killed": True})

    # every byte of the new state written, the commit marker not yet
    def killed(url, token):
        os.kill(os.getpid(), signal.SIGKILL)

    object_states.commit = killed
    net.save_state(f"{URL}/state")
    report({"saved": [w.tolist() for w in saved], "killed": False})

elif MODE == "killed":
    state = f"{URL}/state"
    left = sorted(storage.listdir(state))
    net = seeded_net(1).initialize()
    net.load_state(state)
    loaded = [w.tolist() for w in weights(net)]
    net.save_state(state)
    report({"left": left, "loaded": loaded, "after": sorted(storage.listdir(state))})
