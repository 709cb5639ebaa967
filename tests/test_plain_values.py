"""The plain-value pieces of a training state, on their own."""

import numpy as np
import pytest
import torch
from skorch.history import History

from accel_mixin.checkpoint.plain_values import (
    _NotPlain,
    as_plain,
    cpu_snapshot,
    history_state,
)


def test_plain_converts_numpy_and_keeps_tensors():
    value = {"a": np.float64(1.5), "b": [np.int64(2), torch.ones(2)], "c": np.arange(3)}
    out = as_plain(value)
    assert type(out["a"]) is float and type(out["b"][0]) is int
    assert torch.equal(out["c"], torch.arange(3))
    with pytest.raises(_NotPlain):
        as_plain(object())


def test_history_state_is_a_plain_copy_that_loads_with_weights_only(tmp_path):
    history = History()
    history.new_epoch()
    history.record("train_loss", np.float32(0.5))
    history.record("event", ("lr", 0.1))
    history.new_batch()
    history.record_batch("train_batch_size", np.int64(16))
    state = history_state(history)
    assert state == [
        {"train_loss": 0.5, "event": ("lr", 0.1), "batches": [{"train_batch_size": 16}]}
    ]
    assert type(state[0]["train_loss"]) is float and type(state[0]["event"]) is tuple
    state[0]["batches"].append({})
    assert len(history[-1, "batches"]) == 1  # a copy: the live history is untouched
    torch.save(state, tmp_path / "h.pt")
    assert torch.load(tmp_path / "h.pt", weights_only=True) == state


@pytest.mark.parametrize(
    "value, kind", [(object(), "object"), (np.zeros(2), "ndarray"), (torch.zeros(2), "Tensor")]
)
def test_history_state_names_what_it_cannot_keep(value, kind):
    history = History()
    history.new_epoch()
    history.record("value", value)
    with pytest.raises(TypeError, match=f"The history holds a {kind}"):
        history_state(history)


def test_snapshot_copies_and_reuses_memory():
    live = {"w": torch.ones(3), "opt": [torch.zeros(2)], "step": 4}
    first = cpu_snapshot(live)
    live["w"].add_(1)
    assert first["w"].tolist() == [1.0, 1.0, 1.0]  # shares nothing with training
    second = cpu_snapshot(live, reuse=first)
    assert second["w"] is first["w"] and second["w"].tolist() == [2.0, 2.0, 2.0]
    live["w"] = torch.ones(5)  # another shape: a new tensor
    assert cpu_snapshot(live, reuse=second)["w"].shape == (5,)
