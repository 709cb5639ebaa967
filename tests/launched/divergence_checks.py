"""No silent divergence: trainable sets that change, data that differ between
ranks, and the replica check that catches a divergence from any cause.

Usage: torchrun --nproc_per_node 2 divergence_checks.py
"""

import hashlib

import numpy as np
import torch
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    TwoStageNet,
    error_and_seconds,
    make_accelerator,
    make_data,
    report,
)
from skorch.callbacks import Callback, Checkpoint, Freezer, LoadInitState, Unfreezer

accelerator = make_accelerator()
rank = accelerator.process_index
X, y = make_data(240, seed=2)
checks = Checks()


def make_net(cls=AcceleratedNet, **kwargs):
    torch.manual_seed(0)
    params = dict(
        module=MLP,
        accelerator=accelerator,
        max_epochs=3,
        lr=0.2,
        batch_size=16,
        verbose=0,
        iterator_train__shuffle=True,
    )
    params.update(kwargs)
    return cls(**params)


def digest(net):
    """Every parameter of every module, as this rank holds it."""
    out = {}
    objects = net._objects  # pylint: disable=protected-access
    for name in objects.modules:
        for key, param in objects.raw(name).named_parameters():
            out[f"{name}.{key}"] = hashlib.sha256(
                param.detach().cpu().numpy().tobytes()
            ).hexdigest()[:16]
    return out


def copy_of(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def changed(before, module):
    return sorted(k for k, v in module.state_dict().items() if not torch.equal(before[k], v))


@checks
def freezer_after_prepare():
    # Freezer acts when epoch 1 begins, after DDP was built for every parameter
    net = make_net(callbacks=[Freezer("hidden.*")])
    net.initialize()
    before = copy_of(net._objects.raw("module"))  # pylint: disable=protected-access
    net.partial_fit(X, y)
    return {"digest": digest(net), "changed": changed(before, net.module_)}


@checks
def unfreezer_after_freezer():
    net = make_net(max_epochs=4, callbacks=[Freezer("hidden.*"), Unfreezer("hidden.*", at=3)])
    net.fit(X, y)
    return {"digest": digest(net), "hidden_grad": net.module_.hidden.weight.requires_grad}


class FrozenSecondStage(TwoStageNet):
    """module2_ is frozen completely when the net initializes."""

    def initialize_module(self):
        super().initialize_module()
        self.module2_.requires_grad_(False)
        return self


@checks
def module_frozen_at_initialize_then_unfrozen():
    # module2_'s parameters are 'weight' and 'bias' in get_all_learnable_params
    net = make_net(FrozenSecondStage, max_epochs=3, callbacks=[Unfreezer(["weight", "bias"], at=2)])
    net.initialize()
    before = copy_of(net.module2_)
    net.partial_fit(X, y)
    return {"digest": digest(net), "changed": changed(before, net.module2_)}


@checks
def requires_grad_between_fits():
    net = make_net(max_epochs=2)
    net.fit(X, y)
    net.module_.hidden.requires_grad_(False)
    frozen = copy_of(net.module_)
    net.partial_fit(X, y)
    changed_while_frozen = changed(frozen, net.module_)
    net.module_.hidden.requires_grad_(True)
    thawed = copy_of(net.module_)
    net.partial_fit(X, y)
    return {
        "digest": digest(net),
        "changed_while_frozen": changed_while_frozen,
        "changed_after": changed(thawed, net.module_),
    }


@checks
def data_of_other_lengths():
    n = 200 if rank == 0 else 150  # a script that loads a rank's own shard
    return error_and_seconds(lambda: make_net().fit(X[:n], y[:n]))


@checks
def data_of_other_values():
    # as a tokenizer fitted on each rank encodes the same text otherwise
    X_rank = X[:200] + np.float32(rank)
    return error_and_seconds(lambda: make_net().fit(X_rank, y[:200]))


class NudgeOneRank(Callback):
    """Changes rank 1's weights after epoch 2, as a careless callback would."""

    def on_epoch_end(self, net, **kwargs):
        if len(net.history) == 2 and rank == 1:
            with torch.no_grad():
                net.module_.module.out.bias[0] += 1e-6  # DDP's wrapped module


@checks
def replica_check_catches_a_divergence():
    net = make_net(max_epochs=4, callbacks=[NudgeOneRank()])
    outcome = error_and_seconds(lambda: net.fit(X, y))
    outcome["epochs"] = len(net.history)
    return outcome


@checks
def replica_check_off():
    net = make_net(max_epochs=3, replica_check_every=0, callbacks=[NudgeOneRank()])
    outcome = error_and_seconds(lambda: net.fit(X, y))
    outcome["digest"] = digest(net)
    return outcome


@checks
def replica_check_spaced_out():
    # every 3rd epoch: the nudge after epoch 2 is caught after epoch 3
    net = make_net(max_epochs=4, replica_check_every=3, callbacks=[NudgeOneRank()])
    outcome = error_and_seconds(lambda: net.fit(X, y))
    outcome["epochs"] = len(net.history)
    return outcome


class BypassingNet(AcceleratedNet):
    """A custom train_step that steps on each rank's own gradients."""

    def train_step(self, batch, **fit_params):
        step = self.train_step_single(batch, **fit_params)  # DDP syncs here
        with torch.no_grad():
            for param in self.module_.parameters():
                param.add_(1e-3 * (rank + 1))  # a rank-dependent update
        self.optimizer_.zero_grad()
        return step


@checks
def replica_check_catches_a_bypassing_train_step():
    return error_and_seconds(lambda: make_net(BypassingNet, max_epochs=2).fit(X, y))


@checks
def load_init_state_on_some_ranks_only():
    # machines without a shared filesystem: the checkpoint is on rank 0's
    # only; LoadInitState swallows rank 1's FileNotFoundError
    dirname = f"init_rank{rank}"
    make_net(max_epochs=1, callbacks=[Checkpoint(dirname=dirname)]).fit(X, y)
    checkpoint = Checkpoint(dirname=dirname)
    net = make_net(max_epochs=1, callbacks=[checkpoint, LoadInitState(checkpoint)])
    return error_and_seconds(lambda: net.fit(X, y))


class LoadOnRank0(Callback):
    """Changes weights on rank 0 only, as a careless callback would."""

    def on_train_begin(self, net, **kwargs):
        if rank == 0:
            with torch.no_grad():
                net.module_.out.bias.add_(1.0)


@checks
def weights_changed_on_some_ranks_at_train_begin():
    return error_and_seconds(lambda: make_net(callbacks=[LoadOnRank0()]).fit(X, y))


class FrozenExtra(MLP):
    """A trainable MLP and a frozen layer that only the last rank builds:
    DDP compares the trainable parameters only."""

    def __init__(self):
        super().__init__()
        if rank == accelerator.num_processes - 1:
            self.extra = torch.nn.Linear(2, 2).requires_grad_(False)


@checks
def other_architectures_on_some_ranks():
    return error_and_seconds(lambda: make_net(module=FrozenExtra, max_epochs=1).fit(X, y))


@checks
def private_names_present():
    from accel_mixin.internals import missing

    return missing(accelerator)  # the process group's store included


report({"checks": checks.results})
