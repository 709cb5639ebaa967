"""What a plain ``Accelerator()`` sees under ``accelerate launch --config_file``,
and whether a net initializes there (``test_launch_config.py``)."""

import os

from accelerate import Accelerator
from common import MLP, AcceleratedNet, outcome, report

accelerator = Accelerator()
report(
    {
        "world_size": os.environ.get("WORLD_SIZE"),
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "mixed_precision": accelerator.mixed_precision,
        "accumulation": accelerator.gradient_accumulation_steps,
        "initialize": outcome(lambda: AcceleratedNet(MLP, accelerator=accelerator).initialize()),
    }
)
