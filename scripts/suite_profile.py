"""Where the test suite's time goes: per test file, its seconds, its process
launches and what they spend starting up.

Runs pytest once (quietly, with a JUnit report for the seconds of each test,
setup and teardown included) while the harness logs every launch
(``ACCEL_MIXIN_LAUNCH_LOG``), then times an empty launch
(``tests/launched/startup.py``: imports, rendezvous, a barrier) a few
times for each layout the suite launched, and writes:

- ``results/suite-profile.json``: every test's seconds, every launch, the
  start-up medians, the wall time;
- the table in ``docs/guide/testing.md``, between its ``suite-profile``
  markers.

Usage, from the repository root (``scripts/setup`` first)::

    .venv/bin/python scripts/suite_profile.py                 # the whole suite
    .venv/bin/python scripts/suite_profile.py -- tests/test_runs.py
    .venv/bin/python scripts/suite_profile.py --table-only    # from the JSON

Run it on a quiet machine, and once more beside a busy core
(``python3 -c 'while True: pass' &``) with ``--label busy`` to record both.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "launched"), str(ROOT / "scripts")]

DOC = ROOT / "docs" / "guide" / "testing.md"
PROFILE = ROOT / "results" / "suite-profile.json"
BEGIN, END = "<!-- suite-profile: begin -->", "<!-- suite-profile: end -->"


def read_run(junit, launches):
    """``({test id: seconds}, launches)`` of a pytest run's JUnit report
    (``-o junit_family=xunit1``) and the harness's launch log."""
    tests = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('file')}::{case.get('name')}"
            tests[name] = tests.get(name, 0.0) + float(case.get("time", 0))
    logged = launches.read_text().splitlines() if launches.exists() else []
    return tests, [json.loads(line) for line in logged]


def run_suite(pytest_args):
    """Run pytest; return (wall seconds, exit status, {test id: seconds}, launches)."""
    with tempfile.TemporaryDirectory(prefix="suite_profile_") as tmp:
        junit, launches = Path(tmp) / "junit.xml", Path(tmp) / "launches.jsonl"
        # scripts/test itself: its workers, as a contributor runs it
        command = [
            str(ROOT / "scripts" / "test"),
            "-q",
            "-p",
            "no:randomly",
            f"--junitxml={junit}",
            "-o",
            "junit_family=xunit1",
            "-o",
            "junit_duration_report=total",
            *pytest_args,
        ]
        env = dict(os.environ, ACCEL_MIXIN_LAUNCH_LOG=str(launches))
        start = time.monotonic()
        status = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
        wall = time.monotonic() - start
        return (wall, status, *read_run(junit, launches))


def layout(launch):
    """A launch's layout, as the table names it."""
    forked = ", forked" if launch.get("forked") else ""
    if launch["agents"] == 0:
        return f"python{forked}"
    agents = f" on {launch['agents']} agents" if launch["agents"] > 1 else ""
    return f"{launch['processes']} processes{agents}{forked}"


def time_startup(launches, runs):
    """Median seconds of an empty launch, per layout the suite launched."""
    from harness import run_nodes, run_plain, run_processes

    out = {}
    for launch in {layout(launch): launch for launch in launches}.values():
        seconds = []
        for _ in range(runs):
            start = time.monotonic()
            forked = launch.get("forked", False)
            if launch["agents"] == 0:
                run = run_plain("startup.py", timeout=120, forked=forked)
            elif launch["agents"] > 1:
                run = run_nodes("startup.py", nodes=launch["agents"], timeout=120)
            else:
                run = run_processes(
                    "startup.py", nproc=launch["processes"], timeout=120, forked=forked
                )
            run.check()
            seconds.append(time.monotonic() - start)
        out[layout(launch)] = statistics.median(seconds)
    return dict(sorted(out.items()))


def by_file(profile):
    """Rows per test file: tests, seconds, launches, launch and start-up seconds."""
    startup = profile["startup"]
    rows = {}
    for test, seconds in profile["tests"].items():
        row = rows.setdefault(test.split("::")[0], dict.fromkeys(_COLUMNS, 0.0))
        row["tests"] += 1
        row["seconds"] += seconds
    for launch in profile["launches"]:
        path = launch["test"].split("::")[0] or "(outside tests)"
        row = rows.setdefault(path, dict.fromkeys(_COLUMNS, 0.0))
        row["launches"] += 1
        row["launch_seconds"] += launch["seconds"]
        row["startup_seconds"] += startup.get(layout(launch), 0.0)
    return rows


_COLUMNS = ("tests", "seconds", "launches", "launch_seconds", "startup_seconds")


def file_seconds(path=PROFILE, label="quiet"):
    """Each test file's seconds in the saved profile of ``label``; empty
    without one (the suite's conftest orders the files by them)."""
    try:
        profile = json.loads(Path(path).read_text())[label]
    except (OSError, ValueError, KeyError):
        return {}
    return {test_file: row["seconds"] for test_file, row in by_file(profile).items()}


def workers(profile):
    """How many workers ran the files side by side, in words ('' for one)."""
    count = profile.get("workers", 1)
    if count == 1:
        return ""
    return f" on {count} workers (a file's seconds are its own: they add up to more)"


def table(profile):
    rows = by_file(profile)
    total = {c: sum(r[c] for r in rows.values()) for c in _COLUMNS}
    lines = [
        f"Measured {profile['when']} ({profile['label']}): `scripts/test` took "
        f"{profile['wall'] / 60:.1f} min wall{workers(profile)}, pytest exit "
        f"{profile['status']}. An empty "
        "launch (the imports, the rendezvous, a barrier) takes "
        + ", ".join(f"{s:.1f} s with {k}" for k, s in profile["startup"].items())
        + ".",
        "",
        "| test file | tests | seconds | share | launches | in launches s | start-up s "
        "(launches x empty launch) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path, row in sorted(rows.items(), key=lambda item: -item[1]["seconds"]):
        lines.append(
            f"| {path} | {row['tests']:.0f} | {row['seconds']:.0f} | "
            f"{row['seconds'] / max(total['seconds'], 1):.1%} | {row['launches']:.0f} | "
            f"{row['launch_seconds']:.0f} | {row['startup_seconds']:.0f} |"
        )
    lines.append(
        f"| **all** | {total['tests']:.0f} | {total['seconds']:.0f} | 100% | "
        f"{total['launches']:.0f} | {total['launch_seconds']:.0f} | "
        f"{total['startup_seconds']:.0f} |"
    )
    return "\n".join(lines)


def write_doc(profiles):
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    body = "\n\n".join(table(p) for p in profiles)
    DOC.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(PROFILE))
    parser.add_argument("--label", default="quiet", help="what the machine was doing")
    parser.add_argument("--startup-runs", type=int, default=3)
    parser.add_argument("--table-only", action="store_true", help="rewrite the table only")
    parser.add_argument(
        "--from-run",
        nargs=4,
        metavar=("JUNIT", "LAUNCHES", "WALL", "STATUS"),
        help="a run made elsewhere (scripts/test with ACCEL_MIXIN_LAUNCH_LOG=LAUNCHES "
        "-o junit_family=xunit1 --junitxml=JUNIT), its wall seconds and exit status",
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args()
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.exists() else {}
    if not args.table_only:
        if args.from_run:
            junit, logged, wall, status = args.from_run
            wall, status = float(wall), int(status)
            tests, launches = read_run(Path(junit), Path(logged))
        else:
            wall, status, tests, launches = run_suite(args.pytest_args)
        saved[args.label] = {
            "label": args.label,
            "when": time.strftime("%Y-%m-%d"),
            "wall": wall,
            "status": status,
            "tests": tests,
            "launches": launches,
            "startup": time_startup(launches, args.startup_runs),
            "workers": max((launch.get("workers", 1) for launch in launches), default=1),
        }
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(saved, indent=1))
    write_doc([saved[label] for label in sorted(saved)])
    print(DOC.read_text().partition(BEGIN)[2].partition(END)[0])


if __name__ == "__main__":
    main()
