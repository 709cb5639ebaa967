"""Scenarios that may end their process, run in order in one launch.

``midepoch_run.py`` and ``notice_bound.py`` run several fits a launch, one
scenario each. Some end the process on purpose (a crash, a notice to
torchrun), and a broken one may too (a SIGTERM that no handler catches): the
rank's report is written before every scenario, naming the one under way,
so that a process that dies still tells where it died and what the
scenarios before returned.
"""

import gc
import sys
from contextlib import contextmanager

from accelerate.state import GradientState
from common import Checks, report, write_report


def run_scenarios(scenarios, fit, attempt=0):
    """Run ``fit(scenario)`` for each of ``scenarios`` as the check of that
    name, then report ``{"attempt", "running": None, "checks"}`` and exit,
    with status 75 if any fit was preempted (its value's ``preempted``)."""
    checks = Checks()
    for scenario in scenarios:
        write_report({"attempt": attempt, "running": scenario, "checks": checks.results})
        # each fit as in a process of its own: accelerate's gradient state
        # forgets the loaders that earlier fits left unfinished
        GradientState._reset_state()  # pylint: disable=protected-access
        checks.run(lambda scenario=scenario: fit(scenario), scenario)
        gc.collect()  # the nets of earlier fits die in reference cycles
    preempted = any(
        (result.get("value") or {}).get("preempted") for result in checks.results.values()
    )
    report({"attempt": attempt, "running": None, "checks": checks.results})
    sys.exit(75 if preempted else 0)


@contextmanager
def patched(owner, **attributes):
    """``owner``'s ``attributes`` set to these values within the block, as
    they were after it: settings of one fit, not of the fits after it."""
    before = {name: vars(owner)[name] for name in attributes}
    for name, value in attributes.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(owner, name, value)
