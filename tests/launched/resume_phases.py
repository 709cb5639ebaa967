"""Several scenarios' crashes in one launch, and the tests' reading of it.

A launch that crashes scenarios runs each as a named check (``common.Checks``)
and stops its training where a crash would: by an exception raised in a
callback (``Interrupted``), except the last scenario, whose processes die
(``os._exit``) as a preempted job's do. Before dying, every rank writes the
report of the checks before it, so that the test reads them from a launch
that failed on purpose (``crashed``). The rerun of every scenario is another
launch, as after a crash.
"""

import os

from common import write_report  # the report of a rank about to die

KILLED = 3


class Interrupted(Exception):
    """The in-process stop of a scenario's first run."""


class Stop:
    """Where a scenario's first run stops: ``stop(net)`` raises
    ``Interrupted``, or, as the launch's last scenario (``kill``), ends the
    process after reporting ``checks``. Saves in flight are written first,
    either way."""

    def __init__(self, checks, kill):
        self.checks, self.kill = checks, kill

    def __call__(self, net):
        net.wait_for_saves()
        if not self.kill:
            raise Interrupted(f"stopped when epoch {len(net.history) + 1} began")
        write_report({"checks": self.checks.results, "killed": True})
        # torchrun ends the other ranks once one dies: not before their reports
        net.accelerator.wait_for_everyone()
        os._exit(KILLED)  # pylint: disable=protected-access


def stopped(fit):
    """Run ``fit``, whose training must end at its ``Stop``."""
    try:
        fit()
    except Interrupted:
        return
    raise AssertionError("the fit went on past its stop")


def crash_all(checks, scenarios, **kwargs):
    """Run ``scenarios`` (name -> ``fn(stop)``) in order as checks, each
    given its ``Stop``; the last one's kills the process."""
    names = list(scenarios)
    for name in names:
        stop = Stop(checks, kill=name == names[-1])
        checks.run(lambda fn=scenarios[name], stop=stop: fn(stop), name=name, **kwargs)
    # not killed: the last check failed before its stop, and says why
    write_report({"checks": checks.results})
    raise SystemExit(1)


def once_per_layout(launch):
    """For a module-scoped fixture: ``get(nproc)`` returns ``launch(nproc)``,
    launched the first time each number of processes is asked for. A
    failure is kept too: every test that reads the launch fails with it,
    none launches it again."""
    import pytest

    done = {}

    def get(nproc):
        if nproc not in done:
            try:
                done[nproc] = (launch(nproc), None)
            except (Exception, pytest.fail.Exception) as exc:  # pylint: disable=broad-except
                done[nproc] = (None, exc)
        result, error = done[nproc]
        if error is not None:
            raise error
        return result

    return get


def crashed(launch):
    """Every rank's checks of a launch whose last scenario killed its
    processes (``crash_all``); fails the test if it ended otherwise."""
    import pytest

    if launch.timed_out or launch.hung or launch.returncode == 0:
        pytest.fail(launch.describe(), pytrace=False)
    if any(rank is None or not rank.get("killed") for rank in launch.ranks):
        pytest.fail(f"a rank did not reach its kill; {launch.describe()}", pytrace=False)
    return [rank["checks"] for rank in launch.ranks]
