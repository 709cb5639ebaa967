"""The suite's own order: whole files, the longest first (tests/conftest.py)."""

import json
from types import SimpleNamespace

from conftest import longest_first
from suite_profile import file_seconds


def items(*nodeids):
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_files_run_longest_first_each_keeping_its_own_order():
    collected = items("a.py::one", "a.py::two", "b.py::one", "c.py::one", "c.py::two")
    longest_first(collected, {"a.py": 1.0, "b.py": 30.0, "c.py": 5.0})
    assert [item.nodeid for item in collected] == [
        "b.py::one",
        "c.py::one",
        "c.py::two",
        "a.py::one",
        "a.py::two",
    ]


def test_a_file_the_profile_lacks_runs_first():
    collected = items("old.py::one", "new.py::one")
    longest_first(collected, {"old.py": 100.0})
    assert [item.nodeid for item in collected] == ["new.py::one", "old.py::one"]


def test_the_seconds_are_summed_per_file_from_the_quiet_profile(tmp_path):
    profile = tmp_path / "suite-profile.json"
    tests = {"a.py::one": 1.5, "a.py::two[x]": 2.0, "b.py::one": 4.0}
    quiet = {"tests": tests, "launches": [], "startup": {}}
    busy = {"tests": {"a.py::one": 99.0}, "launches": [], "startup": {}}
    profile.write_text(json.dumps({"quiet": quiet, "busy": busy}))
    assert file_seconds(profile) == {"a.py": 3.5, "b.py": 4.0}


def test_without_a_profile_the_collection_keeps_its_order(tmp_path):
    assert file_seconds(tmp_path / "missing.json") == {}
    collected = items("b.py::one", "a.py::one")
    longest_first(collected, {})
    assert [item.nodeid for item in collected] == ["b.py::one", "a.py::one"]
