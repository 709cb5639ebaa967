"""One voice: the main process speaks for all.

Callbacks print epoch tables and progress bars, and code warns, on every
process; the same line from every rank is noise. Lines that torch's C++
code writes to the stderr descriptor bypass Python's streams and are left
alone: ``TORCH_CPP_LOG_LEVEL=ERROR`` or torchrun's ``--local-ranks-filter 0``
silence them (the guide's "One voice").
"""

import contextlib
import os
import warnings

__all__ = ["quiet_unless_main", "silent", "sink_for"]


def silent(*args, **kwargs):  # pylint: disable=unused-argument
    """A sink that prints nothing: the sink of processes other than the main."""


def sink_for(accelerator):
    """The print function for this process: ``print`` on the main process only.

    Returning the builtin itself keeps skorch's rule that ``verbose=0``
    silences a ``print`` sink.

    """
    return print if accelerator.is_main_process else silent


@contextlib.contextmanager
def quiet_unless_main(accelerator):
    """On processes other than the main one, silence stdout, stderr and warnings.

    Callbacks print epoch tables, progress bars and warnings on every
    process; the main process speaks for all.

    """
    if accelerator.is_main_process:
        yield
        return
    with (
        contextlib.redirect_stdout(_devnull()),
        contextlib.redirect_stderr(_devnull()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        yield


_DEVNULL = []


def _devnull():
    # One file, never closed: a progress bar made while quiet keeps it.
    if not _DEVNULL:
        _DEVNULL.append(open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115
    return _DEVNULL[0]
