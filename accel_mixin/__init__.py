"""skorch nets trained with HuggingFace accelerate: DDP, mixed precision,
gradient accumulation, and checkpoints that are right in every process layout."""

from accel_mixin.checkpoint.params import SafeParamsMixin
from accel_mixin.checkpoint.weights import strip_wrapper_prefixes
from accel_mixin.errors import CheckpointError, DistributedError, Preempted
from accel_mixin.net import AccelerateMixin

__all__ = [
    "AccelerateMixin",
    "CheckpointError",
    "DistributedError",
    "Preempted",
    "SafeParamsMixin",
    "strip_wrapper_prefixes",
]
__version__ = "0.1.0"
