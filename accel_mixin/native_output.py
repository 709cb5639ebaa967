"""Warnings that torch's C++ code prints straight to the stderr descriptor.

DDP's reducer warns from autograd's threads (for instance that
``find_unused_parameters=True`` found no unused parameter), through c10's
logging: out of reach of Python's ``warnings`` and of ``sys.stderr``, so
redirecting those leaves every rank printing it. ``native_warnings_dropped``
puts a filter in front of file descriptor 2 for the length of a block and
passes through everything but such warning lines: errors, tracebacks and
whatever else a rank prints still arrive.

The filter is a small process of its own, not a thread: when the rank dies
(an abort, a segfault, ``os._exit``), the filter still reads to the end of
its input, so the rank's last words are not lost with it.
"""

import contextlib
import os
import re
import subprocess
import sys
import threading

__all__ = ["is_native_warning", "native_warnings_dropped"]

# c10's log lines: "[W1130 15:27:58.469831308 reducer.cpp:1529] Warning: ...",
# "[W reducer.cpp:1360] Warning: ..." in older releases, each prefixed with
# "[rank1]:" once torch.distributed knows the rank
_PATTERN = rb"^(?:\[rank\d+\]:)?\[W(?:\d{4} | \S+:\d+\])"
_WARNING = re.compile(_PATTERN)

# the filter: stdin to stderr, line by line, warning lines left out
_FILTER = f"""
import os, re
warning = re.compile({_PATTERN!r})
def write(data):
    view = memoryview(data)
    while view:
        view = view[os.write(2, view):]
pending = b''
while True:
    chunk = os.read(0, 65536)
    if not chunk:
        break
    pending += chunk
    *lines, pending = pending.split(b'\\n')
    kept = [line + b'\\n' for line in lines if not warning.match(line)]
    if kept:
        write(b''.join(kept))
if pending and not warning.match(pending):
    write(pending)
"""

# how long the end of a block waits for the filter to pass on the last
# lines: a child process that inherited descriptor 2 (a DataLoader worker)
# may hold the pipe open longer, and the filter then goes on by itself
_DRAIN_SECONDS = 2.0

# descriptor 2 is the process's, not a thread's: one filter at a time
_LOCK = threading.Lock()
_DEPTH = [0]


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
    if not active:
        yield
        return
    with _LOCK:
        nested = _DEPTH[0] > 0
        _DEPTH[0] += 1
    try:
        if nested:
            yield
        else:
            with _filtered_stderr():
                yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1


@contextlib.contextmanager
def _filtered_stderr():
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        original = os.dup(2)
    except OSError:  # no descriptor 2: nothing to filter
        yield
        return
    filter_process = None
    try:
        try:
            filter_process = subprocess.Popen(  # pylint: disable=consider-using-with
                [sys.executable, "-S", "-c", _FILTER],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                close_fds=True,
                # out of the rank's process group: a signal that ends the
                # rank must leave the filter to pass on its last words
                start_new_session=True,
            )
            os.dup2(filter_process.stdin.fileno(), 2)
            filter_process.stdin.close()  # descriptor 2 holds the pipe now
        except OSError:  # no process to spare: leave the output as it is
            os.dup2(original, 2)
            filter_process = None
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        # descriptor 2 goes back; the pipe's last writer here closes with
        # it, and the filter reads to the end
        os.dup2(original, 2)
        os.close(original)
        if filter_process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                filter_process.wait(_DRAIN_SECONDS)
