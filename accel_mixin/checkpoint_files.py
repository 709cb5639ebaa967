"""Which training-state files a folder holds, and which one every rank has.

``TrainingCheckpoint`` names its files ``training-state-<epoch>.pt`` and
renames each into place once complete, so a file with that name is whole.
"""
import os
import re
import warnings

from accelerate.utils import gather_object

from accel_mixin.state_dict import CheckpointError

__all__ = ['CHECKPOINT_NAME', 'agreed_checkpoint', 'checkpoint_epochs', 'checkpoint_files']

CHECKPOINT_NAME = 'training-state-{epoch:06d}.pt'
_CHECKPOINT_RE = re.compile(r'^training-state-(\d{6,})\.pt$')


def checkpoint_epochs(dirname):
    """The complete training-state files in ``dirname``, by epoch."""
    try:
        names = os.listdir(dirname)
    except FileNotFoundError:
        return {}
    return {int(m.group(1)): os.path.join(dirname, n)
            for n in names for m in [_CHECKPOINT_RE.match(n)] if m}


def checkpoint_files(dirname):
    """The complete training-state files in ``dirname``, oldest first."""
    found = checkpoint_epochs(dirname)
    return [found[epoch] for epoch in sorted(found)]


def agreed_checkpoint(dirname, accelerator):
    """The newest training state in ``dirname`` that every rank has, or None.

    Machines that share no filesystem (``save_on_each_node``) can hold
    different files: one killed during a write, or a new machine with none.
    Each rank lists its own ``dirname``; all resume from the newest epoch
    they all have, so that they train the same epochs from the same state.
    Files are renamed into place when complete, so a write that was killed
    never has the name this looks for.

    Raises
    ------
    CheckpointError
      On every rank, if some ranks have training states and others have
      none in common with them, or a rank cannot read ``dirname``.

    """
    try:
        found, error = checkpoint_epochs(dirname), None
    except OSError as exc:
        found, error = {}, f'{type(exc).__name__}: {exc}'
    everyone = [(sorted(found), error)]
    if accelerator.num_processes > 1:
        everyone = gather_object(everyone)
    errors = [f'rank {rank}: {err}' for rank, (_, err) in enumerate(everyone) if err]
    if errors:
        raise CheckpointError(
            f"Cannot look for training states in {dirname}: {'; '.join(errors)}.")
    common = set.intersection(*(set(epochs) for epochs, _ in everyone))
    newest = {rank: max(epochs) for rank, (epochs, _) in enumerate(everyone) if epochs}
    if common:
        epoch = max(common)
        ahead = sorted(rank for rank, last in newest.items() if last > epoch)
        if ahead and accelerator.is_main_process:
            warnings.warn(
                f"Resuming from epoch {epoch}, the newest training state in {dirname} that "
                f"every rank has; rank(s) {ahead} also have newer ones.", RuntimeWarning)
        return found[epoch]
    if newest:
        have = ', '.join(f'rank {rank}: epochs {epochs}'
                         for rank, (epochs, _) in enumerate(everyone))
        raise CheckpointError(
            f"No training state in {dirname} is on every rank ({have}). Copy the newest "
            f"file to {dirname} on every machine, or remove the files everywhere to "
            "start afresh.")
    return None
