"""accelerate's data and step settings on several processes, against one
process (the launching guide's table of settings).

Usage: torchrun --nproc_per_node N settings_run.py
       python settings_run.py alone        (one process: the reference)

Every case fits ``make_data`` samples (a size that leaves the last global
batch partial), as a Dataset, and reports the weights, each epoch's train
loss and batch count; one process fits the same with the global batch.

  dispatched   DataLoaderConfiguration(dispatch_batches=True): the main
               process reads every batch and sends each rank its part
  split        DataLoaderConfiguration(split_batches=True): the batch size
               is the global batch's, each rank taking its part
  seedable     use_seedable_sampler=True, data_seed=7, shuffled

Every rank also reports torch's generator as each epoch's first batch
begins, ranks seeded apart, with accelerate's default rng_types and with
``rng_types=["torch", "generator"]``, which synchronizes them.

Every rank also reports what its DDP wrapper was built with
(DistributedDataParallelKwargs), before and after a Freezer changed the
trainable parameters and the module was prepared again, and how often DDP's
communication hook ran with sync_each_batch.
"""

import sys

import torch
from accelerate import DataLoaderConfiguration
from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    DropoutMLP,
    freeze_what_is_loaded,
    fresh_state,
    make_accelerator,
    make_data,
    report,
)
from skorch.callbacks import Callback, Freezer
from streams_run import BATCH, SIZES, net_for, outcomes
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

CASES = {
    "dispatched": ({"dispatch_batches": True}, {}),
    "split": ({"split_batches": True}, {}),
    "seedable": ({"use_seedable_sampler": True, "data_seed": 7}, {"shuffle": True}),
}


def fit(case, processes):
    """One case, on ``processes`` processes (1: the reference, with the global batch)."""
    config, options = CASES[case]
    fresh_state()
    X, y = make_data(SIZES["partial"], seed=4)
    accelerator = make_accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
    whole = processes == 1 or config.get("split_batches")
    net = net_for(accelerator, batch=2 * BATCH if whole else BATCH)
    net.set_params(iterator_train__shuffle=options.get("shuffle", False))
    return outcomes(net.fit(X, y))


class FirstDraws(Callback):
    """torch's generator as each epoch's first training batch begins."""

    in_run_identity = False

    def on_epoch_begin(self, net, **kwargs):
        self.first_ = True

    def on_batch_begin(self, net, training=False, **kwargs):
        if training and self.first_:
            self.first_ = False
            self.states_.append(int(torch.get_rng_state().sum()))

    def on_train_begin(self, net, **kwargs):
        self.states_ = []


def rng_types(checks):
    X, y = make_data(SIZES["partial"], seed=4)

    @checks
    def rng_types_synchronize():
        states = {}
        for types in (None, ["torch", "generator"]):
            fresh_state()
            options = {"rng_types": types} if types else {}
            accelerator = make_accelerator(cpu=True, **options)
            draws = FirstDraws()
            net = net_for(accelerator)
            net.set_params(module=DropoutMLP, iterator_train__shuffle=True, callbacks=[draws])
            torch.manual_seed(100 + accelerator.process_index)  # each rank its own
            net.fit(X, y)
            states[str(types)] = draws.states_
        return states


class HookCount(Callback):
    """Counts the runs of a DDP communication hook on the wrapped module."""

    in_run_identity = False

    def on_train_begin(self, net, **kwargs):
        self.calls_ = 0

    def on_epoch_begin(self, net, **kwargs):
        # the DDP wrapper, once the net prepared it for training
        if self.calls_:
            return

        def counting(state, bucket):
            self.calls_ += 1
            return allreduce_hook(state, bucket)

        net.module_.register_comm_hook(None, counting)


def ddp_settings(checks):
    X, y = make_data(SIZES["partial"], seed=4)

    @checks
    def ddp_kwargs():
        """The DDP wrapper has the handler's settings, also once prepared again."""
        fresh_state()
        handler = DistributedDataParallelKwargs(bucket_cap_mb=1, gradient_as_bucket_view=True)
        net = AcceleratedNet(
            MLP,
            accelerator=make_accelerator(cpu=True, kwargs_handlers=[handler]),
            max_epochs=3,
            batch_size=BATCH,
            train_split=None,
            verbose=0,
        )
        seen = []

        class Wrapper(Callback):
            in_run_identity = False

            def on_epoch_begin(self, net, **kwargs):
                ddp = net.module_
                seen.append([ddp.bucket_bytes_cap, ddp.gradient_as_bucket_view, id(ddp)])

        # the first layer frozen from epoch 2 on: the module is prepared again
        net.set_params(callbacks=[Freezer("hidden.*", at=2), Wrapper()])
        net.fit(X, y)
        return seen

    @checks
    def sync_each_batch():
        """DDP's hook runs at every batch with sync_each_batch, at every
        second one without (accumulation 2)."""
        counts = {}
        for each in (False, True):
            fresh_state()
            plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=each)
            counter = HookCount()
            net = AcceleratedNet(
                MLP,
                accelerator=make_accelerator(cpu=True, gradient_accumulation_plugin=plugin),
                max_epochs=1,
                batch_size=BATCH,
                train_split=None,
                verbose=0,
                callbacks=[counter],
            )
            net.fit(X[: 8 * 2 * BATCH], y[: 8 * 2 * BATCH])  # 8 batches on each rank
            counts[str(each)] = counter.calls_
        return counts


def main():
    freeze_what_is_loaded()
    checks = Checks()
    alone = len(sys.argv) > 1 and sys.argv[1] == "alone"
    for case in CASES:
        checks.run(lambda case=case: fit(case, 1 if alone else 2), case)
    if not alone:
        ddp_settings(checks)
        rng_types(checks)
    report(checks.results)


if __name__ == "__main__":
    main()
