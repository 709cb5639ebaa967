"""skorch nets trained with HuggingFace accelerate: DDP, mixed precision,
gradient accumulation, and checkpoints that are right in every process layout."""
from accel_mixin.coordination import DistributedError
from accel_mixin.mixin import AccelerateMixin

__all__ = ['AccelerateMixin', 'DistributedError']
__version__ = '0.1.0'
