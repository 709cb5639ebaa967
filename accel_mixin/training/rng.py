"""This process's random number generators (Python, NumPy, torch, CUDA),
captured as tensors and plain values (a training state loads them with
``weights_only=True``) and restored."""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch

__all__ = ["restore_rng", "rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's random number generators: Python, NumPy, torch, CUDA."""
    # legacy=True (the default) gives the tuple, not the dict
    kind, keys, pos, has_gauss, cached = cast(
        "tuple[str, np.ndarray, int, int, float]", np.random.get_state()
    )
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    # only where this process started CUDA: a CPU run on a GPU machine must
    # not start it, and an unused generator has nothing to resume
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # a machine with fewer GPUs than the one that saved restores those it has
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
