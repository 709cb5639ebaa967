"""FSDP asked for where accelerate does not select it (CPU processes): the
net refuses at initialize, naming why, where skorch.hf trains DDP silently.

Usage: torchrun --nproc_per_node 2 fsdp_asked.py ROUTE
ROUTE  plugin: Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
       fsdp_version=2)), as docs/guide/sharded.md shows;
       env: a plain Accelerator() in a launch with ACCELERATE_USE_FSDP=true,
       which `accelerate launch --use_fsdp --fsdp_version 2` sets.

The incumbent is checked first: the plugin sets ACCELERATE_USE_FSDP in the
process's environment, and ours is refused after it as well.
"""

import sys

from accelerate.utils import FullyShardedDataParallelPlugin
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    IncumbentNet,
    ParamNLLLoss,
    make_accelerator,
    make_data,
    report,
)

ROUTE = sys.argv[1]
X, y = make_data(100)
checks = Checks()


def accelerator():
    if ROUTE == "plugin":
        return make_accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    return make_accelerator()


for name, Net in (("incumbent", IncumbentNet), ("ours", AcceleratedNet)):

    def asked(Net=Net):
        acc = accelerator()
        # the criterion with a parameter lets the incumbent fit at all
        Net(MLP, criterion=ParamNLLLoss, accelerator=acc, max_epochs=1, verbose=0).fit(X, y)
        return {"distributed_type": str(acc.distributed_type)}

    checks.run(asked, name=name)

report(checks.results)
