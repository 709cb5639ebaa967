"""A process's random number generators, captured and restored."""

import random

import numpy as np
import torch

from accel_mixin.training.rng import restore_rng, rng_state


def test_rng_state_round_trip():
    state = rng_state()
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


def test_cuda_generators_are_kept_where_cuda_started_and_restored_on_the_gpus_there_are(
    monkeypatch,
):
    # a machine with two GPUs saves, one with a single GPU resumes (simulated)
    saved = [torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert "cuda" not in rng_state()  # CUDA never started: nothing to resume
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: saved)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device))
    )
    state = rng_state()
    assert state["cuda"] is saved
    restore_rng(state)
    assert len(restored) == 1 and restored[0][0] is saved[0] and restored[0][1] == 0
