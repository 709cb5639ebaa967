"""One write at a time, in a background thread."""
import threading

__all__ = ['BackgroundWriter']


class BackgroundWriter:
    """Runs one job at a time in a background thread.

    ``submit`` waits for the previous job first, so at most one is in
    flight; ``wait`` returns when the current job is done and raises what it
    raised, once.
    """

    def __init__(self):
        self._thread = None
        self._error = None

    @property
    def busy(self):
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job):
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job,), daemon=True,
                                        name='accel_mixin-writer')
        self._thread.start()

    def _run(self, job):
        try:
            job()
        except BaseException as exc:  # pylint: disable=broad-except
            self._error = exc

    def wait(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
