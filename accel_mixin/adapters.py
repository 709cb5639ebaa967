"""What skorch's own callbacks need to run on several processes."""
from contextlib import contextmanager

__all__ = ['main_process_pickles']


@contextmanager
def main_process_pickles(callbacks, is_main_process):
    """Let only the main process write ``f_pickle`` files.

    skorch's ``Checkpoint`` (and ``TrainEndCheckpoint``, through its
    ``checkpoint_``) pickles the whole net into ``f_pickle`` on whichever
    process runs it; on several processes they would all write the same
    file. Elsewhere ``f_pickle`` is set aside for the duration of the block.

    """
    if is_main_process:
        yield
        return
    saved = []
    for _, cb in callbacks:
        for obj in (cb, getattr(cb, 'checkpoint_', None)):
            if getattr(obj, 'f_pickle', None):
                saved.append((obj, obj.f_pickle))
                obj.f_pickle = None
    try:
        yield
    finally:
        for obj, value in saved:
            obj.f_pickle = value
