"""Training states inside an epoch: batches skipped unread, and a resumed
epoch that ends as the uninterrupted one, in one process and in two."""

import os

import pytest
import torch
from accelerate import Accelerator
from common import MLP, AcceleratedNet, make_data
from harness import run_nodes, run_plain, run_processes
from skorch.callbacks import Callback

from accel_mixin.checkpoint.positions import agreed_checkpoint
from accel_mixin.training.resumed_order import skipping_batches


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n, self.loaded = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded += 1
        return torch.tensor([float(i)])


def shuffled_loader(dataset, seed=0):
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    return Accelerator(cpu=True).prepare_data_loader(loader)


def test_skipped_batches_are_drawn_in_order_but_never_loaded():
    full = [batch[:, 0].tolist() for batch in shuffled_loader(CountingDataset(40))]
    for skip in (1, 5, 9):
        dataset = CountingDataset(40)
        loader = shuffled_loader(dataset)
        with skipping_batches(loader, skip):
            rest = [batch[:, 0].tolist() for batch in loader]
        assert rest == full[skip:]  # the same shuffled order, the first ones left out
        assert dataset.loaded == 4 * (10 - skip)  # flat: nothing read for the skipped
        # afterwards, the loader is whole again
        assert len(list(loader)) == 10


def test_skipping_keeps_the_loader_on_an_error():
    loader = shuffled_loader(CountingDataset(8))
    original = loader.base_dataloader.batch_sampler
    with pytest.raises(RuntimeError), skipping_batches(loader, 1):
        raise RuntimeError
    assert loader.base_dataloader.batch_sampler is original


# The launches of midepoch_run.py that this module and test_preemption.py
# share, in this order: each runs several scenarios (one fit each, a check
# of its own), and a launch that ends in a crash or a notice to torchrun
# ends with it. The uninterrupted run ("full") comes first, in another
# process than the resumed runs it is compared with.
LAUNCHES = {
    1: {
        "interrupted": ["full", "notice_one", "crash"],
        "resumed": ["resume:crash", "resume:notice_one"],
    },
    2: {
        "interrupted": ["full", "notice_one", "notice_mixed", "notice_last", "crash"],
        # notices with polls far apart (notice_bound.py), then one to torchrun
        "notices": ["fast_one", "fast_all", "skewed", "notice_all"],
        "resumed": [
            "resume:crash",
            "resume:notice_one",
            "resume:notice_mixed",
            "resume:notice_last",
            "resume:notice_all",
            "quiet",
        ],
    },
}
_launched = {}


def midepoch_runs(nproc, tmp_path_factory):
    """``{launch: (scenarios, Launch)}`` for ``LAUNCHES[nproc]``, launched once
    a session and shared by every test that reads them; never fails itself,
    so that each test fails on its own scenario."""
    if nproc not in _launched:
        dirname = tmp_path_factory.mktemp(f"midepoch-{nproc}")
        _launched[nproc] = {}
        for name, scenarios in LAUNCHES[nproc].items():
            if nproc == 1:
                launch = run_plain("midepoch_run.py", dirname, *scenarios, timeout=240)
            else:
                launch = run_processes(
                    "midepoch_run.py", dirname, *scenarios, nproc=nproc, timeout=240
                )
            _launched[nproc][name] = (scenarios, launch)
    return _launched[nproc]


def launch_of(runs, name):
    """The launch in ``runs`` that ran the scenario ``name``."""
    (launch,) = (launch for scenarios, launch in runs.values() if name in scenarios)
    return launch


def scenario(runs, name):
    """Every rank's outcome of the scenario ``name`` (one fit) in ``runs``;
    fails naming it unless every rank finished it."""
    launch = launch_of(runs, name)
    for rank, report in enumerate(launch.ranks):
        result = (report or {}).get("checks", {}).get(name)
        if result is None:
            ended_in = report and (report.get("running") or report.get("hung"))
            pytest.fail(
                f"{name}: rank {rank} did not finish it (its launch ended in {ended_in!r})\n"
                + launch.describe(),
                pytrace=False,
            )
        if not result["ok"]:
            pytest.fail(f"{name} failed on rank {rank}: {result['error']}", pytrace=False)
    return [report["checks"][name]["value"] for report in launch.ranks]


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [1, 2], ids=["1 process", "2 processes"])
def test_a_run_lost_inside_an_epoch_resumes_there_exactly(tmp_path_factory, nproc):
    runs = midepoch_runs(nproc, tmp_path_factory)
    full, crash = scenario(runs, "full")[0], launch_of(runs, "crash")
    assert crash.returncode != 0, crash.describe()
    # every rank began the crash and none ended it: each died inside its fit
    assert all((rank or {}).get("running") == "crash" for rank in crash.ranks), crash.describe()
    resumed = scenario(runs, "resume:crash")
    for rank in resumed:
        # saved every 3 batches: at the first optimizer step at or after
        # batch 6 (accumulation 2), before the loss after batch 8
        assert rank["resumed_from"].startswith("training-state-000001-batch-000006-ranks-")
        assert rank["history"] == full["history"]  # every batch's loss, every row
        assert rank["params"] == full["params"]  # bit for bit
    # the resumed run saves inside its epochs too; keep_last=3 kept the newest
    assert [f for f in resumed[0]["files"] if "-batch-" in f][-1].startswith(
        "training-state-000003-"
    )


def test_persistent_workers_see_every_batch_after_the_skipping_epoch():
    loader = torch.utils.data.DataLoader(
        CountingDataset(16),
        batch_size=4,
        shuffle=True,
        num_workers=1,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
    )
    loader = Accelerator(cpu=True).prepare_data_loader(loader)
    with skipping_batches(loader, 3):
        assert len(list(loader)) == 1
    assert len(list(loader)) == 4  # the workers' iterator kept the skipping sampler


class Iterable(torch.utils.data.IterableDataset):
    def __iter__(self):
        X, y = make_data(64)
        return iter(zip(X, y))


def fit_with(tmp_path, callbacks, data=None, **kwargs):
    from accel_mixin.callbacks import TrainingCheckpoint

    net = AcceleratedNet(
        MLP,
        accelerator=Accelerator(cpu=True),
        max_epochs=2,
        batch_size=8,
        train_split=None,
        verbose=0,
        **kwargs,
        callbacks=[TrainingCheckpoint(tmp_path, every_n_batches=2, keep_last=1), *callbacks],
    )
    return net.fit(*(data or make_data(64)))


def test_a_stream_without_a_state_cannot_save_inside_epochs_and_says_so_before_training(
    tmp_path,
):
    batches = []

    class Counting(Callback):
        def on_batch_end(self, net, **kwargs):
            batches.append(1)

    with pytest.raises(
        ValueError, match=r"stream Iterable .* no state_dict\(\) and load_state_dict"
    ):
        fit_with(tmp_path, [Counting()], data=(Iterable(), None))
    assert not batches  # refused as the fit began


def test_the_newest_epoch_end_is_kept_beside_states_inside_epochs(tmp_path):
    seen = []

    class Listing(Callback):
        def on_batch_finished(self, net, batches=0, **kwargs):
            folder = dict(net.callbacks_)["TrainingCheckpoint"].run_folder_
            seen.append(sorted(f for f in os.listdir(folder) if f.startswith("training-state")))

    fit_with(tmp_path, [Listing()])
    assert seen[-2] == ["training-state-000001", "training-state-000001-batch-000006-ranks-1"]


def test_a_state_inside_an_epoch_of_other_processes_is_passed_over(tmp_path):
    for name in ("training-state-000001.pt", "training-state-000001-batch-000004-ranks-2.pt"):
        (tmp_path / name).write_bytes(b"")
    assert agreed_checkpoint(str(tmp_path), Accelerator(cpu=True)).endswith(
        "training-state-000001.pt"
    )
    (tmp_path / "training-state-000001-batch-000002-ranks-1.pt").write_bytes(b"")
    assert agreed_checkpoint(str(tmp_path), Accelerator(cpu=True)).endswith(
        "training-state-000001-batch-000002-ranks-1.pt"
    )


@pytest.mark.multiprocess
def test_a_synchronous_save_inside_an_epoch_names_itself_when_a_rank_is_gone():
    # it waits for any asynchronous write first; its failures are its own
    launch = run_nodes("gone_mid_checkpoint.py", timeout=120)
    assert not launch.timed_out, launch.describe()
    rank0 = launch.ranks[0]
    assert rank0 is not None, launch.describe()
    assert rank0["error"].startswith("DistributedError: save_state: rank 1 is gone"), rank0
