"""A net given skorch's DistributedHistory against the same net with a plain
History: the same rows and weights on every rank, nothing through the store,
the paths that load a history.

Usage: torchrun --nproc_per_node 2 history_checks.py STORE_PORT
"""

import json
import os
import sys

import torch
from accelerate.utils import gather_object
from common import MLP, AcceleratedNet, Checks, make_accelerator, make_data, report
from skorch.callbacks import Checkpoint, LoadInitState
from skorch.history import DistributedHistory
from torch.distributed import TCPStore

accelerator = make_accelerator()
rank, world_size = accelerator.process_index, accelerator.num_processes
store = TCPStore(
    os.environ.get("MASTER_ADDR", "127.0.0.1"),
    port=int(sys.argv[1]),
    world_size=world_size,
    is_master=rank == 0,
)
# 250 samples, 200 to train: the last global batch of 2 x 16 is padded
X, y = make_data(250, noise=0.2, seed=3)
checks = Checks()


def distributed_history():
    return DistributedHistory(store=store, rank=rank, world_size=world_size)


SETTINGS = dict(max_epochs=3, lr=0.3, batch_size=16, verbose=0, iterator_train__shuffle=True)


def make_net(history=None, **kwargs):
    torch.manual_seed(0)
    return AcceleratedNet(MLP, accelerator=accelerator, history=history, **{**SETTINGS, **kwargs})


def rows(history, timed=False):
    """The rows as plain data; without ``dur`` unless ``timed``: two fits
    take different times."""
    return [{k: v for k, v in row.items() if timed or k != "dur"} for row in history]


def weights(net):
    return {k: v.tolist() for k, v in net.module_.state_dict().items()}


def in_store(epochs, batches):
    """Whether any batch record of skorch's DistributedHistory reached the store."""
    keys = [
        json.dumps([epoch, batch, r, attr])
        for epoch in range(epochs + 1)
        for batch in range(batches + 1)
        for r in range(world_size)
        for attr in ("train_loss", "train_batch_size", "valid_loss", "valid_batch_size")
    ]
    return any(store.check([key]) for key in keys)


def same_on_every_rank(value):
    everyone = gather_object([value])
    return all(other == everyone[0] for other in everyone)


@checks
def same_as_plain_history():
    history = distributed_history()
    shared = make_net(history)
    shared.fit(X, y)
    plain = make_net()
    plain.fit(X, y)
    store.set(f"users_key_{rank}", "still mine")
    return {
        "rows": rows(shared.history),
        "plain_rows": rows(plain.history),
        "users_view": rows(history),
        "rows_on_every_rank": same_on_every_rank(rows(shared.history, timed=True)),
        "weights": weights(shared),
        "plain_weights": weights(plain),
        "weights_on_every_rank": same_on_every_rank(weights(shared)),
        "history_type": type(shared.history).__name__,
        "through_store": in_store(3, 20),
        "store_after_fit": store.get(f"users_key_{1 - rank}").decode(),
    }


@checks
def load_best():
    def fit(history):
        cp = Checkpoint(
            monitor="valid_loss_best", dirname=f"cp_best_{history is None}", load_best=True
        )
        return make_net(history, max_epochs=4, lr=1.0, callbacks=[cp]).fit(X, y)

    shared, plain = fit(distributed_history()), fit(None)
    return {
        "rows": rows(shared.history),
        "plain_rows": rows(plain.history),
        "equal_weights": weights(shared) == weights(plain),
        "rows_on_every_rank": same_on_every_rank(rows(shared.history, timed=True)),
    }


@checks
def load_init_state():
    make_net(max_epochs=2, callbacks=[Checkpoint(monitor=None, dirname="cp_init")]).fit(X, y)

    def resume(history):
        cp = Checkpoint(monitor=None, dirname="cp_init")
        # the second net writes no checkpoint of its own: both load the same
        net = make_net(history, max_epochs=2, callbacks=[LoadInitState(cp)])
        return net.fit(X, y)

    shared, plain = resume(distributed_history()), resume(None)
    return {
        "epochs": len(shared.history),
        "rows": rows(shared.history),
        "plain_rows": rows(plain.history),
        "equal_weights": weights(shared) == weights(plain),
        "rows_on_every_rank": same_on_every_rank(rows(shared.history, timed=True)),
        "weights_on_every_rank": same_on_every_rank(weights(shared)),
    }


report({"rank": rank, "checks": checks.results})
