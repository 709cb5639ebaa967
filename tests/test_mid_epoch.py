"""Training states inside an epoch: batches skipped unread, and a resumed
epoch that ends as the uninterrupted one, in one process and in two."""
import pytest
import torch
from accelerate import Accelerator

from accel_mixin.mid_epoch import skipping_batches
from harness import run_plain, run_processes


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n, self.loaded = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded += 1
        return torch.tensor([float(i)])


def shuffled_loader(dataset, seed=0):
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed))
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


def launch(nproc, mode, dirname):
    if nproc == 1:
        return run_plain('midepoch_run.py', mode, dirname, timeout=240)
    return run_processes('midepoch_run.py', mode, dirname, nproc=nproc, timeout=240)


@pytest.fixture(scope='module', params=[1, 2], ids=['1 process', '2 processes'])
def crashed_and_resumed(request, tmp_path_factory):
    nproc, dirname = request.param, tmp_path_factory.mktemp('states')
    full = launch(nproc, 'full', dirname).check()
    crash = launch(nproc, 'crash', dirname)
    resumed = launch(nproc, 'resume', dirname).check()
    return full, crash, resumed


@pytest.mark.multiprocess
def test_a_run_lost_inside_an_epoch_resumes_there_exactly(crashed_and_resumed):
    full, crash, resumed = crashed_and_resumed
    assert crash.returncode != 0 and all(rank is None for rank in crash.ranks)
    for rank in resumed:
        # saved every 3 batches: at the first optimizer step at or after
        # batch 6 (accumulation 2), before the loss after batch 8
        assert rank['resumed_from'] == 'training-state-000001-batch-000006.pt'
        assert rank['history'] == full[0]['history']  # every batch's loss, every row
        assert rank['params'] == full[0]['params']  # bit for bit
    # the resumed run saves inside its epochs too; keep_last=3 kept the newest
    assert [f for f in resumed[0]['files'] if '-batch-' in f][-1].startswith('training-state-000003-')
