"""One write at a time, in a background thread."""

import threading
import warnings
import weakref
from contextlib import contextmanager

# every writer of this process, so that a load waits for any write in flight
_WRITERS = weakref.WeakSet()


def join_all():
    """Wait until no writer of this process has a job in flight."""
    for writer in list(_WRITERS):
        writer.join()


def in_flight():
    """Whether a writer of this process has a job running, or one whose
    error is yet to be raised."""
    return any(writer.busy for writer in list(_WRITERS))


class BackgroundWriter:
    """Runs one job at a time in a thread: ``submit`` waits for the previous
    job, ``wait`` raises what the last one raised, once. Not a daemon: a write
    in flight when the program ends is finished, never cut off halfway."""

    def __init__(self):
        self._thread = self._error = None
        _WRITERS.add(self)

    def submit(self, job):
        self.wait()
        self._thread = threading.Thread(
            target=self._run, args=(job,), daemon=False, name="accel_mixin-writer"
        )
        self._thread.start()

    def _run(self, job):
        try:
            job()
        except BaseException as exc:  # pylint: disable=broad-except
            self._error = exc

    @property
    def busy(self):
        """Whether a job runs, or failed and its error is yet to be raised."""
        thread = self._thread
        return self._error is not None or (thread is not None and thread.is_alive())

    def join(self):
        """Wait for the current job, keeping what it raised for ``wait``."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def wait(self):
        self.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


@contextmanager
def finished_on_error(get_writer):
    """Where the block raises, finish the write in flight of ``get_writer()``
    (or None) and warn if it failed too, without hiding the block's error."""
    try:
        yield
    except BaseException:
        writer = get_writer()
        if writer is not None:
            try:
                writer.wait()
            except Exception as exc:  # pylint: disable=broad-except
                warnings.warn(
                    f"An asynchronous save_state failed too: {type(exc).__name__}: {exc}",
                    RuntimeWarning,
                )
        raise
