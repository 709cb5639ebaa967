"""Private names of torch, accelerate and skorch: present on the pinned
versions, and a loud error where a release renames one. Backends the mixin
cannot train with are refused before training."""

import types

import accelerate.optimizer
import pytest
import torch
import torch.distributed.distributed_c10d as c10d
from accelerate import Accelerator
from accelerate.utils import DistributedType, is_lomo_available
from common import MLP, AcceleratedNet
from skorch import utils as skorch_utils

from accel_mixin.internals import (
    InternalsChanged,
    cache_lomo_check,
    check_dataloader,
    check_prepared_module,
    default_store,
    missing,
    record_score,
)


def test_every_private_name_exists_on_the_pinned_versions():
    assert missing(Accelerator(cpu=True)) == []


def test_a_renamed_accelerator_list_fails_loudly(monkeypatch):
    accelerator = Accelerator(cpu=True)
    monkeypatch.delattr(accelerator, "_schedulers")
    with pytest.raises(
        InternalsChanged,
        match=r"accelerate no longer has Accelerator._schedulers"
        r".*constraints/pinned.txt",
    ):
        AcceleratedNet(MLP, accelerator=accelerator).initialize()


def test_a_prepared_module_without_accelerates_marks_fails_loudly():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    module = torch.nn.Linear(2, 2)
    # DDP was due, and prepare_model returned the module as it was
    with pytest.raises(InternalsChanged, match="the mark _is_accelerate_prepared"):
        check_prepared_module(module, module, accelerator, wrapped=True)
    with pytest.raises(InternalsChanged, match="the mark _original_forward"):
        check_prepared_module(module, module, accelerator, wrapped=False)


def test_a_dataloader_without_its_shuffling_state_fails_loudly():
    with pytest.raises(InternalsChanged, match=r"SimpleNamespace\.synchronized_generator"):
        check_dataloader(types.SimpleNamespace(iteration=0))


def test_missing_names_of_torch_and_skorch_are_listed(monkeypatch):
    monkeypatch.delattr(c10d, "_get_default_store")
    monkeypatch.delattr(skorch_utils, "_check_f_arguments")
    found = missing(Accelerator(cpu=True))
    assert len(found) == 2
    assert "torch no longer has torch.distributed.distributed_c10d._get_default_store" in found[0]
    assert "skorch no longer has skorch.utils._check_f_arguments" in found[1]
    with pytest.raises(InternalsChanged, match="for the barriers of several processes"):
        default_store()


@pytest.mark.parametrize(
    "kind, name",
    [
        (DistributedType.DEEPSPEED, "DeepSpeed"),
        (DistributedType.MEGATRON_LM, "Megatron-LM"),
    ],
)
def test_unsupported_backends_are_refused_at_initialize(monkeypatch, kind, name):
    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(type(accelerator), "distributed_type", property(lambda self: kind))
    with pytest.raises(
        ValueError,
        match=f"AccelerateMixin does not support {name} .*Supported: one process, DDP .*FSDP2",
    ):
        AcceleratedNet(MLP, accelerator=accelerator).initialize()


def test_fsdp1_is_refused_naming_fsdp2():
    from accel_mixin.distributed.process_layout import check_supported

    for version, refused in ((1, True), (2, False)):
        fake = types.SimpleNamespace(
            distributed_type=DistributedType.FSDP, num_processes=2, is_fsdp2=version == 2
        )
        if refused:
            with pytest.raises(ValueError, match=r"does not support FSDP1 .*fsdp_version=2"):
                check_supported(fake)
        else:
            check_supported(fake)


def test_xla_is_refused_with_several_processes_only(monkeypatch):
    from accel_mixin.distributed.process_layout import check_supported

    for processes, refused in ((1, False), (2, True)):
        fake = types.SimpleNamespace(distributed_type=DistributedType.XLA, num_processes=processes)
        if refused:
            with pytest.raises(ValueError, match="XLA \\(TPU\\) with several processes"):
                check_supported(fake)
        else:
            check_supported(fake)


def test_a_renamed_progress_bar_method_is_listed(monkeypatch):
    from skorch.callbacks import ProgressBar

    monkeypatch.delattr(ProgressBar, "_get_batches_per_epoch_phase")
    (found,) = missing(Accelerator(cpu=True))
    assert "skorch no longer has ProgressBar._get_batches_per_epoch_phase" in found


def test_a_renamed_score_recorder_is_listed_and_fails_loudly(monkeypatch):
    from skorch.callbacks import EpochScoring

    monkeypatch.delattr(EpochScoring, "_record_score")
    (found,) = missing(Accelerator(cpu=True))
    assert "skorch no longer has EpochScoring._record_score" in found
    with pytest.raises(InternalsChanged, match="to score cached predictions once"):
        record_score(EpochScoring("accuracy"), None, 0.5)


def test_accelerates_lomo_check_is_answered_once_with_the_same_answer():
    cache_lomo_check()
    cached = accelerate.optimizer.is_lomo_available
    assert cached.cache_info() is not None and cached() == is_lomo_available()
    cache_lomo_check()  # once is enough: not wrapped twice
    assert accelerate.optimizer.is_lomo_available is cached
