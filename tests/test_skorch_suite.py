"""skorch's own tests pass with AccelerateMixin in front of skorch's nets.

skorch's wheel ships them (``skorch/tests/test_net.py``,
``test_classifier.py`` and ``test_regressor.py``); ``skorch_suite/plugin.py``
substitutes the classes, and ``skorch_suite/differences.py`` lists the
deliberate differences, which run as strict expected failures. One process,
in a subprocess of its own, so that the substitution stays out of this suite.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parent / "skorch_suite"
ROOT = SUITE.parent.parent
MODULES = ["skorch.tests.test_net", "skorch.tests.test_classifier", "skorch.tests.test_regressor"]

pytestmark = pytest.mark.skorch_suite

sys.path.insert(0, str(SUITE))
# pylint: disable=wrong-import-position
# the lists only: plugin.py would substitute skorch's classes in this process
import differences  # noqa: E402

sys.path.remove(str(SUITE))


@pytest.fixture(scope="module")
def outcome():
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(SUITE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("ACCEL_MIXIN_SKORCH_SUITE", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "plugin",
            f"--confcutdir={SUITE}",
            "-q",
            "-rxXfE",
            "--disable-warnings",
            "-p",
            "no:cacheprovider",
            "--pyargs",
            *MODULES,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    return out


def test_skorch_own_tests_pass_with_the_mixin(outcome):
    tail = outcome.stdout[-6000:] + outcome.stderr[-2000:]
    assert outcome.returncode == 0, tail
    summary = outcome.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed > 300, summary  # the suite ran, not a handful of tests


def test_each_deliberate_difference_is_an_expected_failure(outcome):
    # strict: a listed test that passes fails the run; here, every listed
    # test must also be found and fail, so the list holds no stale entries
    failed_as_expected = set(
        re.findall(r"^XFAIL \S*?::(\S+?)(?:\[\S*\])? ", outcome.stdout, flags=re.MULTILINE)
    )
    listed = set(differences.DIFFERENCES) | set(differences.ARTIFACTS)
    assert listed <= failed_as_expected, listed - failed_as_expected


def test_the_guide_explains_each_deliberate_difference():
    page = (ROOT / "docs" / "guide" / "differences.md").read_text(encoding="utf-8")
    for name in differences.DIFFERENCES:
        assert name.split("::")[-1] in page, name
