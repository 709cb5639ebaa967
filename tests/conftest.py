"""Fixtures: a fresh accelerate state per test, data, modules, net classes."""

import os
import sys
from pathlib import Path

# Before torch is imported: one intra-op thread per process, as the launched
# processes have. The two workers, their launches and the subprocesses (the
# skorch suite) share two cores; with a thread per core each, their spinning
# threads took the skorch suite from 28 s alone to 191 s within the suite.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# pylint: disable=wrong-import-position
import pytest
from accelerate.state import AcceleratorState, GradientState

sys.path.insert(0, str(Path(__file__).resolve().parent / "launched"))
# scripts/jobs.py: the repository's tool that stops a launched job for good
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from common import MLP, LogitMLP, make_data
from suite_profile import file_seconds


def pytest_addoption(parser):
    parser.addoption(
        "--bench",
        action="store_true",
        help="also run the benchmarks at tiny sizes (tests/test_bench.py), as CI does",
    )


def longest_first(items, seconds):
    """Sort whole files, longest first; a file the profile lacks counts as the
    longest, and a file's own tests keep their order."""
    longest = max(seconds.values(), default=0.0)
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], longest + 1))


def pytest_configure(config):
    # --dist loadfile hands out whole files, by default the ones with the most
    # tests first: a two-test file of launches came last and ran alone for
    # minutes. The collection's order, longest first, is kept instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    longest_first(items, file_seconds())
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
