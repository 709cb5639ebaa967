"""Fixtures: a fresh accelerate state per test, data, modules, net classes."""

import sys
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState, GradientState

sys.path.insert(0, str(Path(__file__).resolve().parent / "launched"))
# scripts/jobs.py: the repository's tool that stops a launched job for good
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

# pylint: disable=wrong-import-position
from common import MLP, LogitMLP, make_data


def pytest_addoption(parser):
    parser.addoption(
        "--bench",
        action="store_true",
        help="also run the benchmarks at tiny sizes (tests/test_bench.py), as CI does",
    )


def pytest_collection_modifyitems(config, items):
    # the benchmarks' own check proves the tooling, not the package: a
    # minute that scripts/test spares, and CI runs on its own
    if config.getoption("--bench"):
        return
    skip = pytest.mark.skip(reason="the benchmarks' check: pass --bench (CI does)")
    for item in items:
        if "bench" in item.keywords:
            item.add_marker(skip)


def reset_accelerate():
    """accelerate keeps its state in per-process singletons; start afresh."""
    AcceleratorState._reset_state(reset_partial_state=True)  # pylint: disable=protected-access
    GradientState._reset_state()  # pylint: disable=protected-access


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    reset_accelerate()
    yield
    reset_accelerate()


@pytest.fixture
def data():
    return make_data(200)


@pytest.fixture
def mlp():
    return MLP


@pytest.fixture
def logit_mlp():
    return LogitMLP
