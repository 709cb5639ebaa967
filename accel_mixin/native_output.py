"""Warnings that torch's C++ code prints straight to the stderr descriptor.

DDP's reducer warns from autograd's threads (for instance that
``find_unused_parameters=True`` found no unused parameter), through c10's
logging: out of reach of Python's ``warnings`` and of ``sys.stderr``, so
redirecting those leaves every rank printing it. ``native_warnings_dropped``
puts a pipe in front of file descriptor 2 for the length of a block and
passes through everything but such warning lines: errors, tracebacks and
whatever else a rank prints still arrive.
"""
import contextlib
import os
import re
import sys
import threading

__all__ = ['is_native_warning', 'native_warnings_dropped']

# c10's log lines: "[W1130 15:27:58.469831308 reducer.cpp:1529] Warning: ...",
# "[W reducer.cpp:1360] Warning: ..." in older releases, each prefixed with
# "[rank1]:" once torch.distributed knows the rank
_WARNING = re.compile(rb'^(?:\[rank\d+\]:)?\[W(?:\d{4} | \S+:\d+\])')

# how long the end of a block waits for the last lines: a child process
# that inherited the pipe (a DataLoader worker) may hold it open longer, and
# the pump then goes on forwarding in the background
_DRAIN_SECONDS = 2.0

_ACTIVE = threading.local()


def is_native_warning(line):
    """Whether ``line`` (bytes) is a warning of c10's logging."""
    return _WARNING.match(line) is not None


@contextlib.contextmanager
def native_warnings_dropped(active=True):
    """Within the block, drop c10's warning lines from file descriptor 2.

    Parameters
    ----------
    active : bool (default=True)
      False makes the block a no-op: on the main process, which speaks for
      every rank.

    """
    if not active or getattr(_ACTIVE, 'depth', 0):
        yield
        return
    try:
        sys.stderr.flush()
        original = os.dup(2)
        read_end, write_end = os.pipe()
    except OSError:  # no descriptor 2, or none to spare: leave the output as it is
        yield
        return
    os.dup2(write_end, 2)
    os.close(write_end)
    pump = threading.Thread(target=_pump, args=(read_end, original), daemon=True,
                            name='accel_mixin-native-warnings')
    pump.start()
    _ACTIVE.depth = 1
    try:
        yield
    finally:
        _ACTIVE.depth = 0
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        # fd 2 goes back to the original; the pipe's write end closes with
        # it, and the pump sees the end of its input
        os.dup2(original, 2)
        pump.join(_DRAIN_SECONDS)


def _pump(read_end, original):
    """Forward lines from the pipe to the original stderr, warnings left out."""
    pending = b''
    try:
        while True:
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b'\n')
            for line in lines:
                if not is_native_warning(line):
                    _write_all(original, line + b'\n')
        if pending and not is_native_warning(pending):
            _write_all(original, pending)
    except OSError:
        pass
    finally:
        os.close(read_end)
        os.close(original)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
