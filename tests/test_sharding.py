"""The helpers of FSDP2 sharding that need no process group
(``accel_mixin.distributed.sharding``), in this process; sharded training is
in test_fsdp.py."""

from collections import OrderedDict

import torch

from accel_mixin.distributed.sharding import _on_cpu, sharded_module_name


def test_the_sharded_module_is_the_first_with_parameters():
    modules = [("module", torch.nn.ReLU()), ("head", torch.nn.Linear(2, 2))]
    assert sharded_module_name(modules) == "head"
    assert sharded_module_name([("module", torch.nn.ReLU()), ("scale", 2.0)]) is None


def test_a_full_state_is_put_on_the_cpu_whatever_its_nesting():
    state = {
        "state": OrderedDict({0: {"exp_avg": torch.ones(2), "step": 3}}),
        "param_groups": [{"lr": 0.1, "params": [0], "buffers": [torch.zeros(1)]}],
    }
    out = _on_cpu(state)
    assert type(out["state"]) is dict and out["state"][0]["step"] == 3
    assert out["state"][0]["exp_avg"].device.type == "cpu"
    assert torch.equal(out["state"][0]["exp_avg"], torch.ones(2))
    (group,) = out["param_groups"]
    assert group["lr"] == 0.1 and group["params"] == [0]
    assert group["buffers"][0].device.type == "cpu" and torch.equal(
        group["buffers"][0], torch.zeros(1)
    )
