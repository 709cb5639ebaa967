"""accelerate's settings, one row of the launching guide's table each
(``docs/guide/launching.md``, "Every accelerate setting"): what the mixin
does with it, shown the way a user meets it. The data and DDP settings run
on 2 real processes (``launched/settings_run.py``); the rest on one. Rows
tested elsewhere name their tests in the table.
"""

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import (
    AutocastKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    ProjectConfiguration,
)
from common import MLP, AcceleratedNet, fresh_state, make_accelerator, make_data
from harness import check_values, run_plain, run_processes
from skorch.callbacks import Callback, LRScheduler
from streams_run import SIZES, Positioned

from accel_mixin.callbacks import TrainingCheckpoint
from accel_mixin.distributed.parallelism import check_parallelism
from accel_mixin.training.portable import accelerator_settings

FP32 = 1e-6  # measured: at most 9e-8


def net(accelerator, **kwargs):
    options = {"max_epochs": 2, "batch_size": 8, "train_split": None, "verbose": 0}
    return AcceleratedNet(MLP, accelerator=accelerator, **{**options, **kwargs})


@pytest.fixture(scope="module")
def launched():
    ranks = run_processes("settings_run.py", nproc=2, timeout=600).check()
    alone = run_plain("settings_run.py", "alone", timeout=600).check()[0]
    return ranks, alone


# --- DataLoaderConfiguration, on 2 processes against one ------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case, batches",
    # one process counts batches of the batch size the net was given
    [("dispatched", 7), ("split", 4), ("seedable", 7)],
)
def test_data_settings_train_as_one_process_with_the_global_batch(launched, case, batches):
    ranks, alone = launched
    expected = alone[case]["value"]
    for rank in check_values(ranks, case):
        for got, want in zip(rank["weights"], expected["weights"]):
            np.testing.assert_allclose(got, want, rtol=0, atol=FP32)
        np.testing.assert_allclose(rank["train_loss"], expected["train_loss"], rtol=0, atol=FP32)
        assert rank["train_batch_count"] == [batches] * 2


@pytest.mark.multiprocess
def test_rng_types_synchronize_the_ranks_generators_as_each_epoch_begins(launched):
    ranks, _ = launched
    default, synchronized = (
        [rank[key] for rank in check_values(ranks, "rng_types_synchronize")]
        for key in ("None", "['torch', 'generator']")
    )
    assert synchronized[0] == synchronized[1]  # rng_types=["torch", ...]: alike
    assert default[0] != default[1]  # accelerate's default leaves torch's apart


@pytest.mark.multiprocess
def test_ddp_kwargs_reach_the_ddp_wrapper_also_once_prepared_again(launched):
    ranks, _ = launched
    for seen in check_values(ranks, "ddp_kwargs"):
        assert [epoch[:2] for epoch in seen] == [[2**20, True]] * 3  # bucket_cap_mb=1
        assert seen[2][2] != seen[0][2]  # the Freezer's change: a new wrapper


@pytest.mark.multiprocess
def test_sync_each_batch_syncs_every_micro_batch(launched):
    ranks, _ = launched
    # 4 batches on each rank, accumulation 2
    assert check_values(ranks, "sync_each_batch") == [{"False": 2, "True": 4}] * 2


# --- one process ------------------------------------------------------------


class LearningRates(Callback):
    in_run_identity = False

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            self.rates_ = [*getattr(self, "rates_", []), net.optimizer_.param_groups[0]["lr"]]


@pytest.mark.filterwarnings(r"ignore:Detected call of .lr_scheduler.step\(\).")  # torch, on False
@pytest.mark.parametrize("with_optimizer, steps", [(True, 4), (False, 8)])
def test_step_scheduler_with_optimizer_decides_if_a_batch_schedule_waits_for_the_steps(
    with_optimizer, steps
):
    """8 batches, accumulation 2: the optimizers step 4 times."""
    fresh_state()
    accelerator = make_accelerator(
        cpu=True, gradient_accumulation_steps=2, step_scheduler_with_optimizer=with_optimizer
    )
    schedule = LRScheduler(
        torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5, step_every="batch"
    )
    rates = LearningRates()
    X, y = make_data(64)
    net(accelerator, max_epochs=1, lr=1.0, callbacks=[schedule, rates]).fit(X, y)
    assert rates.rates_[-1] == 0.5**steps


def test_an_epoch_schedule_steps_every_epoch_also_where_an_epoch_ends_inside_a_window():
    """sync_with_dataloader=False, accumulation 2, 7 batches an epoch: epochs
    1 and 3 end inside a window, where accelerate's wrapper would not step."""
    fresh_state()
    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    accelerator = make_accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    schedule = LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    trained = net(accelerator, max_epochs=4, lr=1.0, callbacks=[schedule]).fit(*make_data(56))
    assert trained.history[:, "event_lr"] == [1.0, 0.5, 0.25, 0.125]


def test_a_dataset_dispatched_from_the_main_process_saves_at_epoch_ends_only(tmp_path):
    fresh_state()
    config = DataLoaderConfiguration(dispatch_batches=True)
    inside = TrainingCheckpoint(tmp_path, every_n_batches=2)
    with pytest.raises(ValueError, match=r"dispatch_batches=True\) the main\s+process reads"):
        net(make_accelerator(cpu=True, dataloader_config=config), callbacks=[inside]).fit(
            *make_data(64)
        )


def test_dynamo_compiles_the_prepared_module_and_files_keep_plain_keys():
    fresh_state()
    compiled = []

    class Seen(Callback):
        def on_epoch_begin(self, net, **kwargs):
            compiled.append(type(net.module_).__name__)

    trained = net(make_accelerator(cpu=True, dynamo_backend="eager"), callbacks=[Seen()])
    trained.fit(*make_data(64))
    assert compiled == ["OptimizedModule"] * 2
    assert type(trained.module_) is MLP  # unwrapped after training
    f = io.BytesIO()
    trained.save_params(f_params=f)
    f.seek(0)
    assert list(torch.load(f)) == ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]


def test_autocast_kwargs_are_the_autocast_of_training_and_inference():
    fresh_state()
    dtypes = []
    accelerator = make_accelerator(
        cpu=True, mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)]
    )
    trained = net(accelerator, max_epochs=1)
    trained.initialize()
    trained.module_.hidden.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    trained.partial_fit(*make_data(16))
    trained.predict(make_data(8)[0])
    assert set(dtypes) == {torch.float32}  # enabled=False: no bf16 autocast


def test_logging_dir_is_where_a_tracker_writes(tmp_path):
    fresh_state()
    config = ProjectConfiguration(project_dir=tmp_path / "project", logging_dir=tmp_path / "logs")
    accelerator = make_accelerator(cpu=True, log_with="tensorboard", project_config=config)
    net(accelerator).fit(*make_data(32))
    accelerator.end_training()
    assert list((tmp_path / "logs" / "AcceleratedNet").glob("events.out.tfevents.*"))


def test_accelerates_own_save_state_names_and_rotates_what_is_prepared(tmp_path):
    """automatic_checkpoint_naming, total_limit and iteration are
    ``accelerator.save_state``'s: it saves the net's prepared objects while
    they are prepared (unwrap_after_train=False)."""
    fresh_state()
    config = ProjectConfiguration(
        project_dir=tmp_path, automatic_checkpoint_naming=True, total_limit=1
    )
    accelerator = make_accelerator(cpu=True, project_config=config)
    net(accelerator, unwrap_after_train=False).fit(*make_data(32))
    accelerator.save_state()
    accelerator.save_state()
    (kept,) = (tmp_path / "checkpoints").iterdir()
    assert kept.name == "checkpoint_1" and (kept / "model.safetensors").exists()


def test_non_blocking_reaches_the_prepared_dataloader():
    fresh_state()
    config = DataLoaderConfiguration(non_blocking=True)
    trained = net(make_accelerator(cpu=True, dataloader_config=config))
    trained.initialize()
    X, y = make_data(16)
    loader = trained.get_iterator(trained.get_dataset(X, y), training=True)
    assert loader._non_blocking is True  # pylint: disable=protected-access


def test_use_stateful_dataloader_lets_a_stream_be_saved_inside_an_epoch_by_hand(tmp_path):
    X, y = make_data(SIZES["partial"], seed=4)
    saved = []

    class SaveAt(Callback):
        in_run_identity = False

        def on_batch_end(self, net, training=False, **kwargs):
            if training and len(net.history) == 2 and len(net.history[-1]["batches"]) == 2:
                net.save_state(tmp_path / "state")
                saved.append(net.history[-1]["batches"][-1]["train_loss"])

    fresh_state()
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = make_accelerator(cpu=True, dataloader_config=config)
    uninterrupted = net(accelerator, max_epochs=3, callbacks=[SaveAt()]).fit(Positioned(X, y), None)
    fresh_state()
    accelerator = make_accelerator(cpu=True, dataloader_config=config)
    stream = Positioned(X, y)
    resumed = net(accelerator, max_epochs=3)
    resumed.initialize()
    resumed.load_state(tmp_path / "state")
    resumed.partial_fit(stream, None)
    assert saved and resumed.history[:, "train_loss"] == uninterrupted.history[:, "train_loss"]
    assert stream.yielded == len(X) - 2 * 8 + len(X)  # read on from the position


# --- settings accelerate itself ignores or refuses, pinned -----------------


def test_accelerate_ignores_the_old_split_batches_argument_which_the_mixin_never_reads():
    fresh_state()
    assert Accelerator(cpu=True, split_batches=True).split_batches is False


def test_accelerate_ignores_adjust_scheduler_which_the_mixin_leaves_to_it():
    fresh_state()
    plugin = GradientAccumulationPlugin(num_steps=2, adjust_scheduler=True)
    assert (
        Accelerator(cpu=True, gradient_accumulation_plugin=plugin).gradient_state.adjust_scheduler
        is False
    )


@pytest.mark.parametrize("backend", ["TE", "MSAMP", "AO"])
def test_every_fp8_backend_is_refused_by_name(backend):
    accelerator = SimpleNamespace(
        parallelism_config=None, is_fsdp2=False, fp8_backend=backend, mixed_precision="fp8"
    )
    with pytest.raises(ValueError, match=f"FP8.*{backend}"):
        check_parallelism(accelerator)


def test_grad_scaler_kwargs_travel_with_a_pickled_net():
    fresh_state()
    accelerator = make_accelerator(cpu=True, kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    handlers = accelerator_settings(accelerator)["kwargs_handlers"]
    assert [h.init_scale for h in handlers if isinstance(h, GradScalerKwargs)] == [1024.0]
