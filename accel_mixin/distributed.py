"""Rank helpers: the process layout, collective sections, one voice."""
import os

from accelerate.utils import gather_object

__all__ = [
    'DistributedError',
    'check_process_layout',
    'run_collectively',
    'silent',
    'sink_for',
]


class DistributedError(RuntimeError):
    """Raised on every rank when a collective section failed on another rank."""


def _env_int(name, default=1):
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def check_process_layout(accelerator):
    """Refuse to train independent models in a group of processes.

    ``torchrun`` or ``accelerate launch --multi_gpu`` without a GPU start
    several processes, but unless accelerate is told to use the CPU each of
    them believes it is alone and trains its own model, silently.

    Raises
    ------
    RuntimeError
      If ``WORLD_SIZE`` says several processes were launched together while
      the accelerator sees a single one.

    """
    world_size = _env_int('WORLD_SIZE')
    if world_size <= 1 or accelerator.num_processes > 1:
        return
    raise RuntimeError(
        f"This process is one of WORLD_SIZE={world_size} processes launched "
        "together, but the Accelerator sees a single process "
        f"(distributed_type={accelerator.distributed_type}), so every process "
        "would train its own model without syncing gradients. On CPU, set "
        "ACCELERATE_USE_CPU=true in the environment of the launcher or create "
        "the accelerator with Accelerator(cpu=True); with GPUs, make sure "
        "every process can see CUDA."
    )


def run_collectively(accelerator, fn, *, what, main_only=False):
    """Run ``fn`` on the main process or on all, then agree on the outcome.

    Every process returns only once ``fn`` finished wherever it ran, so a
    file written on the main process is complete when any process returns.
    If ``fn`` failed anywhere, every process raises: the failing process its
    own exception, the others a :class:`DistributedError` that names the
    rank and its error. This costs one collective and no rank is left
    waiting for a rank that already failed.

    Parameters
    ----------
    accelerator : accelerate.Accelerator
      Gives the process layout.

    fn : callable
      Called without arguments.

    what : str
      Name of the operation, used in error messages.

    main_only : bool (default=False)
      Whether to call ``fn`` on the main process only.

    Returns
    -------
    result
      What ``fn`` returned on this process, or None where it did not run.

    """
    result, error = None, None
    if not main_only or accelerator.is_main_process:
        try:
            result = fn()
        except Exception as exc:  # pylint: disable=broad-except
            error = exc

    if accelerator.num_processes > 1:
        message = None if error is None else f"{type(error).__name__}: {error}"
        outcomes = gather_object([message])
        failures = [
            f"rank {rank}: {msg}" for rank, msg in enumerate(outcomes) if msg
        ]
        if failures and error is None:
            raise DistributedError(
                f"{what} failed on another process; " + "; ".join(failures))
    if error is not None:
        raise error
    return result


def silent(*args, **kwargs):  # pylint: disable=unused-argument
    """A sink that prints nothing: the sink of processes other than the main."""


def sink_for(accelerator):
    """The print function for this process: ``print`` on the main process only.

    Returning the builtin itself keeps skorch's rule that ``verbose=0``
    silences a ``print`` sink.

    """
    return print if accelerator.is_main_process else silent
