"""A search with n_jobs=2 inside a job of two processes: joblib's workers
inherit RANK and WORLD_SIZE; each rank must get a clear error within
seconds, not a silent wait for a rendezvous that never comes.

Usage: torchrun --nproc_per_node 2 children_check.py
"""

import time

from common import MLP, AcceleratedNet, Checks, make_accelerator, make_data, report
from sklearn.model_selection import GridSearchCV

accelerator = make_accelerator()
X, y = make_data(120)
checks = Checks()


@checks
def search_with_worker_processes():
    net = AcceleratedNet(MLP, accelerator=accelerator, max_epochs=1, verbose=0)
    search = GridSearchCV(net, {"lr": [0.05, 0.1]}, cv=2, n_jobs=2, error_score="raise")
    start = time.monotonic()
    try:
        search.fit(X, y)
    except Exception as exc:  # pylint: disable=broad-except
        # joblib reports a worker's failure to unpickle as BrokenProcessPool,
        # with the worker's traceback as its cause, as the user sees it
        return {
            "error": f"{type(exc).__name__}: {exc}",
            "cause": str(exc.__cause__),
            "seconds": time.monotonic() - start,
        }
    return {"error": None}


report({"checks": checks.results})
