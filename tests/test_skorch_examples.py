"""skorch's two accelerate examples, unchanged but for the import, on two
processes: cross_validate with a DistributedHistory
(launched/skorch_cross_validate.py), and save_params loaded into accelerated
and plain nets (launched/skorch_save_load.py)."""

import math

import pytest
from harness import free_port, run_processes

pytestmark = pytest.mark.multiprocess


def test_skorch_s_cross_validate_example():
    launch = run_processes("skorch_cross_validate.py", "--port", free_port(), timeout=180)
    scores = [r["test_score"] for r in launch.check()]
    assert len(scores[0]) == 2 and all(math.isfinite(s) for s in scores[0])
    assert scores[0] == scores[1]


def test_skorch_s_save_load_example():
    launch = run_processes("skorch_save_load.py", "--port", free_port(), timeout=180)
    per_rank = [r["accuracies"] for r in launch.check()]
    assert set(per_rank[0]) == {"True", "False"}
    for accuracies in per_rank:
        for result in accuracies.values():
            assert result["before"] == result["loaded"] == result["plain"]
            assert result["epochs_loaded"] == 5
    assert per_rank[0] == per_rank[1]
