"""The exceptions accel_mixin raises, each for one kind of failure."""

__all__ = ["CheckpointError", "DistributedError", "InternalsChanged", "Preempted", "Stalled"]


class DistributedError(RuntimeError):
    """Raised on every rank when a collective section failed on another rank,
    or another rank is gone."""

    # set where every rank learned it in one barrier: no collective follows
    # (accel_mixin.distributed.control)
    agreed: bool = False


class Preempted(Exception):
    """Training stopped on a preemption notice, after a state was saved.

    Every rank stops at the same batch and saves a training state there.
    It ends ``fit`` with an error, so that a script that does not catch it
    exits non-zero and the scheduler requeues the job; the next run resumes
    from the saved state (``ResumeTraining``). Every rank raises it: it is no
    failure of one rank. The net is left as training stopped (still wrapped,
    its history ending with the unfinished epoch's row): run the script
    again rather than training on in the same process.
    """


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded: corrupt, unsafe or mismatched."""


class InternalsChanged(RuntimeError):
    """A private name of torch, accelerate or skorch that accel_mixin uses is gone."""


class Stalled(TimeoutError):
    """A file operation made no progress for its I/O timeout."""
