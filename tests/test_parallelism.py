"""Settings only accelerate's ``prepare()`` applies are refused at
``initialize``, naming the setting (distributed/parallelism.py).

On CPU accelerate itself refuses a ``ParallelismConfig`` of several
processes (MULTI_CPU is no "multi device" to it), so the configs are set on
the accelerator's state as accelerate sets them on GPUs. FP8 builds on CPU
with torchao, the backend accelerate picks for it there.
"""

import re
from types import SimpleNamespace

import pytest
from accelerate import Accelerator
from common import AcceleratedNet

from accel_mixin.distributed.parallelism import check_parallelism

# accelerate 1.10 and later
ParallelismConfig = pytest.importorskip("accelerate.parallelism_config").ParallelismConfig


@pytest.mark.parametrize(
    "size, named",
    [
        ({"tp_size": 2}, "tensor parallelism (ParallelismConfig(tp_size=2))"),
        ({"cp_size": 2}, "context parallelism (ParallelismConfig(cp_size=2))"),
        ({"sp_size": 2}, "sequence parallelism (ParallelismConfig(sp_size=2))"),
    ],
)
def test_model_parallelism_is_refused_at_initialize(mlp, size, named):
    accelerator = Accelerator(cpu=True)
    accelerator.state.parallelism_config = ParallelismConfig(**size)
    net = AcceleratedNet(mlp, accelerator=accelerator)
    with pytest.raises(ValueError, match=re.escape("cannot train with " + named)):
        net.initialize()


def test_data_parallelism_alone_is_accepted(mlp, data):
    accelerator = Accelerator(cpu=True)
    # what accelerate sets for DDP when a config asks for nothing else
    accelerator.state.parallelism_config = ParallelismConfig(dp_replicate_size=1)
    net = AcceleratedNet(mlp, accelerator=accelerator, max_epochs=1, verbose=0)
    net.fit(*data)


def _accelerator(config, fsdp2=True, backend="NO", precision="no"):
    return SimpleNamespace(
        parallelism_config=config, is_fsdp2=fsdp2, fp8_backend=backend, mixed_precision=precision
    )


def test_data_parallelism_of_every_shape_is_accepted():
    # HSDP: replicated across 2, sharded across 2 (trained in tests/test_hsdp.py)
    check_parallelism(_accelerator(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)))
    check_parallelism(_accelerator(ParallelismConfig(dp_shard_size=4)))
    check_parallelism(_accelerator(ParallelismConfig(dp_replicate_size=4), fsdp2=False))


def test_fp8_is_refused_at_initialize(mlp):
    pytest.importorskip("torchao")
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="fp8")
    except ValueError as exc:  # an accelerate without torchao's FP8
        pytest.skip(f"this accelerate builds no FP8 accelerator here: {exc}")
    net = AcceleratedNet(mlp, accelerator=accelerator)
    with pytest.raises(
        ValueError, match=r"cannot train in FP8 \(mixed_precision='fp8', backend AO\)"
    ):
        net.initialize()


def test_fp8_under_fsdp2_names_what_is_not_proven():
    fp8 = _accelerator(ParallelismConfig(dp_shard_size=2), backend="AO", precision="fp8")
    with pytest.raises(ValueError, match="under FSDP2 its states, unwrapping and rewrapping"):
        check_parallelism(fp8)
