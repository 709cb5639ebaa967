"""Callbacks for resumable training: TrainingCheckpoint and ResumeTraining.

Use them together; running the same script again after a crash resumes by
itself::

    net = AcceleratedNet(
        MyModule, accelerator=Accelerator(), max_epochs=20,
        callbacks=[TrainingCheckpoint('ckpt'), ResumeTraining('ckpt')],
    )
    net.fit(X, y)  # after a crash: trains only the epochs that remain

"""
import os

from skorch.callbacks import Callback

__all__ = ['ResumeTraining', 'TrainingCheckpoint']


class TrainingCheckpoint(Callback):
    """Save the whole training state at the end of epochs, for resuming.

    The net calls it after every other callback at the end of an epoch, so
    the state it saves is that of the finished epoch, with the decisions of
    the other callbacks in it. Files are named after the epoch,
    ``training-state-000012.pt``, so numbering continues after a resume, and
    are renamed into place when complete, so ``ResumeTraining`` never picks
    a file whose write was interrupted.

    Parameters
    ----------
    dirname : str
      Folder of the checkpoint files; created if needed.

    every_n_epochs : int (default=1)
      Save after every ``every_n_epochs``-th epoch.

    keep_last : int or None (default=2)
      How many checkpoint files to keep; older ones are deleted once a new
      one is complete. None keeps all.

    asynchronous : bool (default=False)
      Copy the state to CPU memory and write it in a background thread while
      training goes on. At most one write is in flight; the next save and
      the end of training wait for it, and a failed write raises on every
      rank there.

    """
    def __init__(self, dirname, every_n_epochs=1, keep_last=2, asynchronous=False):
        self.dirname = dirname
        self.every_n_epochs = every_n_epochs
        self.keep_last = keep_last
        self.asynchronous = asynchronous

    def initialize(self):
        if self.every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be at least 1, got {self.every_n_epochs}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 or None, got {self.keep_last}")
        os.makedirs(self.dirname, exist_ok=True)
        return self

    def save_epoch(self, net):
        """Save the state of the epoch that just ended, if it is due."""
        from accel_mixin.checkpoint import CHECKPOINT_NAME  # pylint: disable=import-outside-toplevel

        epoch = len(net.history)
        if epoch % self.every_n_epochs:
            return
        path = os.path.join(self.dirname, CHECKPOINT_NAME.format(epoch=epoch))
        net.save_state(path, asynchronous=self.asynchronous, on_written=self._rotate)

    def _rotate(self):
        from accel_mixin.checkpoint import checkpoint_files  # pylint: disable=import-outside-toplevel

        if self.keep_last is None:
            return
        for path in checkpoint_files(self.dirname)[:-self.keep_last]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def on_train_end(self, net, **kwargs):
        if self.asynchronous:
            net.wait_for_saves()


class ResumeTraining(Callback):
    """Resume from the latest complete training state in ``dirname``, if any.

    At the start of training, loads the newest file that
    ``TrainingCheckpoint`` completed in ``dirname``; ``fit`` then trains only
    the epochs that remain up to ``max_epochs``, none if the saved run was
    stopped by ``EarlyStopping``. Without a checkpoint, training starts
    afresh. Where machines keep their own copies (``save_on_each_node``),
    every rank resumes from the newest epoch that all of them have, and all
    raise a ``CheckpointError`` if some have files and others none of those.

    Parameters
    ----------
    dirname : str
      The folder ``TrainingCheckpoint`` writes to.

    """
    def __init__(self, dirname):
        self.dirname = dirname

    def initialize(self):
        self.resumed_from_ = None
        return self

    def on_train_begin(self, net, **kwargs):
        from accel_mixin.checkpoint import agreed_checkpoint  # pylint: disable=import-outside-toplevel

        # every rank gets here before the ranks compare their files, or
        # raises if a callback before this one failed on some rank
        net._coordinator.barrier('ResumeTraining')  # pylint: disable=protected-access
        path = agreed_checkpoint(self.dirname, net.accelerator)
        if path is not None:
            net.load_state(path)
            self.resumed_from_ = path
