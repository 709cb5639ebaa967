"""accelerate's settings that only its ``prepare()`` applies, refused by name.

accelerate applies tensor, context and sequence parallelism
(``ParallelismConfig``) and FP8 training (torchao, TransformerEngine, MS-AMP)
inside ``Accelerator.prepare``, to all the training objects at once. The
mixin prepares a DDP module with ``prepare_model`` (so that it can unwrap
and rewrap it), which applies none of them: without a check the net would
train without them and say nothing. Context and sequence parallelism also
need the training step to split each sequence (``maybe_context_parallel``),
which skorch's step does not.

HSDP (``dp_replicate_size`` x ``dp_shard_size`` under FSDP2) is data
parallelism, and ``prepare_model`` applies it: accelerate's FSDP2
preparation shards each module on the ``ParallelismConfig``'s 2-D mesh,
replicated across its first dimension and sharded along its second; the
training states, ``save_params``' gathering and resharding work on its
DTensors as on FSDP2's (``tests/test_hsdp.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel_mixin.distributed.sharding import sharded

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["check_parallelism"]

# ParallelismConfig's dimension -> what it is, and why the mixin cannot apply it
_REFUSED = {
    "tp": (
        "tensor parallelism",
        "accelerate applies it in prepare() to models that bring a tensor-parallel plan "
        "(transformers' tp_plan), and feeds every rank of a tensor-parallel group the same "
        "batches, which the mixin's data loading does not",
    ),
    "cp": (
        "context parallelism",
        "each training step must split its sequences between the ranks "
        "(accelerator.maybe_context_parallel), which skorch's training step does not",
    ),
    "sp": (
        "sequence parallelism",
        "it runs under DeepSpeed only, whose engine replaces skorch's modules",
    ),
}

_ALTERNATIVES = (
    "The mixin trains with data parallelism: DDP, or FSDP2 to shard a model larger than "
    "one process. Create the Accelerator without it, or train with accelerate directly."
)


def check_parallelism(accelerator: Accelerator) -> None:
    """Raise ``ValueError`` naming the setting and why, for a
    ``ParallelismConfig`` or FP8 training the mixin would silently drop."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None:
        for dimension, (name, why) in _REFUSED.items():
            size = getattr(config, f"{dimension}_size", 1) or 1
            if size > 1:
                raise ValueError(
                    f"AccelerateMixin cannot train with {name} (ParallelismConfig("
                    f"{dimension}_size={size})): {why}. {_ALTERNATIVES}"
                )
    # an enum in recent accelerate releases, a string in older ones
    backend = getattr(accelerator, "fp8_backend", None)
    backend = str(getattr(backend, "value", backend) or "NO")
    precision = getattr(accelerator, "mixed_precision", None)
    if backend.upper() != "NO" or precision == "fp8":
        why = (
            "under FSDP2 its states, unwrapping and rewrapping are not proven with the "
            "modules FP8 converts"
            if sharded(accelerator)
            else "the mixin prepares a DDP module with prepare_model, so that it can unwrap "
            "and rewrap it, which does not convert it: it would train in full precision "
            "without a word"
        )
        raise ValueError(
            f"AccelerateMixin cannot train in FP8 (mixed_precision='fp8', backend {backend}): "
            f"accelerate converts the model for FP8 in prepare(); {why}. Use "
            "mixed_precision='bf16' or 'fp16'."
        )
