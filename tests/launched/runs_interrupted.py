"""Interrupted runs of searches and of augmenting Datasets, every scenario's
phase in one launch (``resume_phases.py``).

Usage: runs_interrupted.py PHASE DIRNAME SCENARIO...
  crash  the uninterrupted references (the search in one go, the search over
         class weights without and with checkpoints), then each SCENARIO's
         fit with checkpoints, stopped: by an exception, the last one by the
         death of its processes, as a preempted job's
  rerun  another launch: each SCENARIO again, resumed where it stopped

SCENARIO  augmented-unseeded, augmented-per_rank (augmented_run.py), search
          (search_run.py, killed when its third fit's second epoch begins;
          put it last), search-weights (search_weights.py: no stop, searched
          again by the rerun), run-folders (runs_checks.py: its checks run in
          the rerun, after the scenarios)
"""

import sys
from pathlib import Path

import augmented_run
import runs_checks
import search_run
import search_weights
from common import Checks, make_accelerator, report
from resume_phases import crash_all

PHASE, DIRNAME, SCENARIOS = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
accelerator = make_accelerator()
checks = Checks(deadline=300)  # a search fits 5 times, on a machine often busy


def crash(scenario):
    if scenario == "search":
        return lambda stop: search_run.search(accelerator, DIRNAME / "search", stop)
    seeding = scenario.split("-", 1)[1]
    (DIRNAME / scenario).mkdir(exist_ok=True)
    return lambda stop: augmented_run.crash(accelerator, seeding, DIRNAME / scenario, stop)


def rerun(scenario):
    if scenario == "search":
        return lambda: search_run.search(accelerator, DIRNAME / "search")
    if scenario == "search-weights":
        return lambda: search_weights.search(accelerator, DIRNAME / "weights")
    seeding = scenario.split("-", 1)[1]
    return lambda: augmented_run.resume(accelerator, seeding, DIRNAME / scenario)


if PHASE == "crash":
    if "search" in SCENARIOS:
        checks.run(lambda: search_run.search(accelerator, DIRNAME / "full"), name="search/full")
    if "search-weights" in SCENARIOS:
        checks.run(lambda: search_weights.search(accelerator), name="search-weights/plain")
        checks.run(
            lambda: search_weights.search(accelerator, DIRNAME / "weights"),
            name="search-weights",
        )
    stopped = [s for s in SCENARIOS if s == "search" or s.startswith("augmented-")]
    crash_all(checks, {s: crash(s) for s in stopped})
for scenario in SCENARIOS:
    if scenario != "run-folders":
        checks.run(rerun(scenario), name=scenario)
if "run-folders" in SCENARIOS:
    runs_checks.run(checks, accelerator, DIRNAME / "run-folders")
report({"checks": checks.results})
