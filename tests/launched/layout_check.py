"""torchrun without ACCELERATE_USE_CPU: the processes each believe they are
alone. Initializing a net must say so; Accelerator(cpu=True), the fix the
error names, must then train one model across the processes.

Usage: torchrun --nproc_per_node 2 layout_check.py

Both mixins are checked in one launch: first each alone, while no process
group exists (``alone_refused/ours``, ``alone_refused/incumbent``), then
ours with the fix (``cpu_flag_trains_together``), which starts one.
"""

import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import gather_object
from common import MLP, AcceleratedNet, Checks, IncumbentNet, make_accelerator, make_data, report

X, y = make_data(200)
checks = Checks()

for name, Net in (("ours", AcceleratedNet), ("incumbent", IncumbentNet)):

    def alone_refused(Net=Net):
        accelerator = make_accelerator()
        net = Net(MLP, accelerator=accelerator, max_epochs=1, verbose=0)
        net.initialize()
        return {"distributed_type": str(accelerator.distributed_type)}

    checks.run(alone_refused, name=f"alone_refused/{name}")


@checks
def cpu_flag_trains_together():
    AcceleratorState._reset_state(reset_partial_state=True)  # pylint: disable=protected-access
    GradientState._reset_state()  # pylint: disable=protected-access
    accelerator = make_accelerator(cpu=True)
    net = AcceleratedNet(
        MLP, accelerator=accelerator, max_epochs=2, verbose=0, iterator_train__shuffle=True
    )
    net.fit(X, y)
    mine = torch.cat([p.detach().flatten() for p in net.module_.parameters()])
    everyone = gather_object([mine.numpy()])
    return {
        "num_processes": accelerator.num_processes,
        "spread": float(abs(everyone[0] - everyone[1]).max()),
    }


report(checks.results)
