"""Training states of a module sharded by FSDP2 under faults, on N real processes.

``python sharded_faults.py save DISK``: a save that fails on one rank (its
files may not grow: ``RLIMIT_FSIZE``) and one that fails on a full disk
(``DISK``, a small tmpfs the test mounted, or ``none``) raise the same
``CheckpointError`` on every rank, and leave no partial folder behind.

``python sharded_faults.py damaged``: a state whose shard file is deleted,
truncated or corrupted is named as damaged on every rank, with the older
state beside it that is intact; a state of other parameters is named so.

``python sharded_faults.py hold DIR`` and ``second DIR``: a job that writes
training states into ``DIR`` and waits there, and a second job of the same run
started meanwhile, which is refused at its first epoch, naming the first.
"""

import os
import resource
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
from common import (
    AcceleratedNet,
    Checks,
    DropoutMLP,
    fresh_state,
    make_data,
    make_fsdp_accelerator,
    outcome,
    report,
)
from skorch.callbacks import Callback

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint

PHASE = sys.argv[1]
OUT = Path(os.environ.get("ACCEL_RESULTS_DIR", "."))
RANK = int(os.environ.get("RANK", "0"))
X, y = make_data(n=120)
checks = Checks(deadline=150)


class WiderMLP(DropoutMLP):
    """Other parameters: a hidden layer of 48, not 32."""

    def __init__(self):
        super().__init__()
        self.layers[0] = torch.nn.Linear(20, 48)
        self.layers[3] = torch.nn.Linear(48, 2)


def net_of(module=DropoutMLP, **kwargs):
    fresh_state()
    torch.manual_seed(0)
    params = dict(module=module, max_epochs=1, batch_size=32, verbose=0)
    params.update(kwargs)
    return AcceleratedNet(accelerator=make_fsdp_accelerator(), **params)


def listing(folder):
    """What is in ``folder``: committed states, partial folders, the filler."""
    return sorted(p.name for p in Path(folder).iterdir() if p.name != "filler")


def weights(net):
    return {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in net.module_.state_dict().items()
    }


if PHASE == "save":
    DISK = sys.argv[2]

    @checks
    def a_write_failing_on_one_rank_fails_alike_everywhere():
        net = net_of().fit(X, y)
        folder = OUT / "one-rank"
        if RANK == 0:
            folder.mkdir()
        net.wait_for_everyone()
        path = folder / "state.pt"
        net.save_state(str(path))
        before = listing(folder)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        if RANK == 1:  # its shard file may not grow: EFBIG, as a quota would say
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (512, limit[1]))
        try:
            failed = outcome(lambda: net.save_state(str(path)))
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        net.wait_for_everyone()  # rank 0 removed the partial folder
        return {"failed": failed, "before": before, "after": listing(folder)}

    @checks
    def a_full_disk_fails_alike_everywhere_and_piles_up_no_folders():
        if DISK == "none":
            return None
        net = net_of().fit(X, y)
        folder = Path(DISK)
        path = folder / "state.pt"
        net.save_state(str(path))
        before = listing(folder)
        good = weights(net)
        net.partial_fit(X, y)  # other weights, which the failed saves held
        filler = folder / "filler"
        if RANK == 0:  # the disk full
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
            try:
                while os.write(fd, b"\0" * 4096):
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)
        net.wait_for_everyone()
        attempts = [outcome(lambda: net.save_state(str(path))) for _ in range(2)]
        net.wait_for_everyone()  # rank 0 removed the partial folders
        after = listing(folder)
        loaded = net_of()
        loaded.initialize()
        loaded.load_state(str(path))
        intact = all(torch.equal(good[k], v) for k, v in weights(loaded).items())
        if RANK == 0:
            filler.unlink()
        net.wait_for_everyone()
        return {
            "attempts": attempts,
            "before": before,
            "after": after,
            "intact": intact,
            "then": outcome(lambda: net.save_state(str(path))),
        }

elif PHASE == "damaged":
    DAMAGES = {
        "deleted": lambda shard: shard.unlink(),
        "truncated": lambda shard: os.truncate(shard, shard.stat().st_size // 2),
        "corrupted": lambda shard: shard.write_bytes(b"\xff" * 64 + shard.read_bytes()[64:]),
    }
    dirname = OUT / "run"
    net = net_of(max_epochs=2, callbacks=[TrainingCheckpoint(str(dirname), keep_last=None)])
    net.fit(X, y)
    run_folder = Path(dict(net.callbacks_)["TrainingCheckpoint"].run_folder_)
    newest = run_folder / "training-state-000002"
    shards = newest  # the state's own folder
    shard = shards / "__1_0.distcp"  # rank 1's

    def load(path, module=DropoutMLP):
        loaded = net_of(module)
        loaded.initialize()
        return outcome(lambda: loaded.load_state(str(path)))

    for kind, damage in DAMAGES.items():

        def damaged(damage=damage):
            if RANK == 0:
                shutil.copy(shard, OUT / "kept")
                damage(shard)
            net.wait_for_everyone()
            try:
                return {"error": load(newest), "shards": str(shards), "shard": str(shard)}
            finally:
                net.wait_for_everyone()
                if RANK == 0:
                    shutil.copy(OUT / "kept", shard)
                net.wait_for_everyone()

        checks.run(damaged, f"a_{kind}_shard_is_named_with_the_intact_state")

    @checks
    def with_the_older_state_damaged_too_none_is_named():
        older = run_folder / "training-state-000001"
        if RANK == 0:
            for folder in (older, shards):
                shutil.copy(folder / "__1_0.distcp", OUT / f"kept-{folder.name}")
                os.truncate(folder / "__1_0.distcp", 10)
        net.wait_for_everyone()
        try:
            return load(newest)
        finally:
            net.wait_for_everyone()
            if RANK == 0:
                for folder in (older, shards):
                    shutil.copy(OUT / f"kept-{folder.name}", folder / "__1_0.distcp")
            net.wait_for_everyone()

    @checks
    def a_state_of_other_parameters_is_named_so():
        return {"error": load(newest, WiderMLP), "intact": load(newest)}

elif PHASE in ("hold", "second"):
    # two jobs of one run writing one folder: "hold" saves its first epoch,
    # then waits for the file "release"; "second" is the requeued job
    dirname = Path(sys.argv[2])

    class Hold(Callback):
        in_run_identity = False  # the requeued job is the same run

        def on_epoch_begin(self, net, **kwargs):
            if len(net.history) == 2:  # the second epoch begins: the first is saved
                if RANK == 0:
                    (dirname / "ready").touch()
                deadline = time.monotonic() + 120
                while not (dirname / "release").exists() and time.monotonic() < deadline:
                    time.sleep(0.1)

    def saving(*callbacks):
        net = net_of(max_epochs=2, callbacks=[TrainingCheckpoint(str(dirname)), *callbacks])
        return net, outcome(lambda: net.fit(X, y))

    if PHASE == "hold":

        @checks
        def the_job_writing_there_goes_on():
            net, failed = saving(("hold", Hold()))
            folder = Path(dict(net.callbacks_)["TrainingCheckpoint"].run_folder_)
            net.wait_for_everyone()  # the main process's fit ended
            return {"failed": failed, "files": sorted(p.name for p in folder.iterdir())}

    else:

        @checks
        def a_second_job_is_refused():
            net, failed = saving(("resume", ResumeTraining(str(dirname))))
            return {"failed": failed, "resumed": dict(net.callbacks_)["resume"].resumed_from_}


report({"checks": checks.results, "world_size": int(os.environ.get("WORLD_SIZE", "1"))})
