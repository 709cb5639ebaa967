"""One voice: the main process speaks for all.

Callbacks print epoch tables and progress bars, and code warns, on every
process. What torch's C++ code writes to the stderr descriptor bypasses
Python's streams: ``TORCH_CPP_LOG_LEVEL=ERROR`` or torchrun's
``--local-ranks-filter 0`` silence it (the guide's "One voice").
"""

import contextlib
import functools
import os
import warnings

__all__ = ["quiet_unless_main", "silent", "sink_for"]


def silent(*args, **kwargs):  # pylint: disable=unused-argument
    """A sink that prints nothing: the sink of processes other than the main."""


def sink_for(accelerator):
    """``print`` on the main process only: the builtin itself, for skorch's
    rule that ``verbose=0`` silences a ``print`` sink."""
    return print if accelerator.is_main_process else silent


@contextlib.contextmanager
def quiet_unless_main(accelerator):
    """On processes other than the main one, silence stdout, stderr and warnings."""
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


@functools.cache
def _devnull():
    # one file, never closed: a progress bar made while quiet keeps it
    return open(os.devnull, "w", encoding="utf-8")
