"""The private names of torch, accelerate and skorch that accel_mixin relies on.

Each is used because no public API does the job:

- torch's ``_get_default_store``: the key-value store of the process group,
  which carries the fail-fast barriers (``coordination.py``);
- accelerate's ``Accelerator._models``, ``_optimizers``, ``_schedulers`` and
  ``_dataloaders``: the lists that unwrapping and rewrapping keep exact
  (``wrapping.py``);
- the marks accelerate leaves on a prepared module: ``_original_forward``
  (the autocast patch), which unwrapping stashes and rewrapping restores, and
  ``_is_accelerate_prepared`` (since accelerate 1.x, on what ``prepare_model``
  returns), which makes ``prepare_model`` return a module untouched, and which
  is removed before a module is prepared again;
- a prepared dataloader's ``synchronized_generator`` and ``iteration``, which
  decide the shuffling that a training state saves, and the ``batch_sampler``
  of the DataLoader it wraps (``base_dataloader``), which a resumed epoch
  swaps for one that skips the batches already trained (``resume/data_order.py``);
- torch's ``DataLoader._iterator`` and ``_get_iterator``: the iterator of
  persistent workers, which a resumed fit starts with the generators put
  back afterwards (``resume/data_order.py``);
- skorch's ``_check_f_arguments`` and ``NeuralNet._get_module``, which
  ``save_params`` and ``load_params`` share with skorch, and
  ``ProgressBar._get_batches_per_epoch_phase``, whose count of the whole
  data's batches a rank's bar divides into its share.

A release that renames one of them must make accel_mixin fail loudly, naming
it, never degrade silently (a barrier that no longer waits, a module that is
no longer wrapped in DDP). The checks here run where the names are used;
``missing`` lists what a given accelerator lacks, for a test on the pinned
versions.
"""

import accelerate
import skorch
import torch
from skorch import utils as skorch_utils
from skorch.callbacks import ProgressBar
from skorch.net import NeuralNet
from torch.utils.data import IterableDataset

from accel_mixin.errors import InternalsChanged

__all__ = [
    "InternalsChanged",
    "batch_sampler_owner",
    "check_accelerator",
    "check_dataloader",
    "check_prepared_module",
    "check_progress_bar",
    "default_store",
    "missing",
    "start_persistent_iterator",
]

ACCELERATOR_LISTS = ("_models", "_optimizers", "_schedulers", "_dataloaders")
DATALOADER_ATTRIBUTES = ("synchronized_generator", "iteration")


def _changed(package, name, what):
    return InternalsChanged(
        f"{package} no longer has {name}, which accel_mixin uses {what}. This accel_mixin "
        f"was tested with the versions in constraints/pinned.txt; installed are torch "
        f"{torch.__version__}, accelerate {accelerate.__version__}, skorch "
        f"{skorch.__version__}. Install the pinned versions, or an accel_mixin that "
        "supports these."
    )


def _default_store_getter():
    # imported here, where a release without it gets the clear error
    try:
        from torch.distributed.distributed_c10d import _get_default_store  # pylint: disable=import-outside-toplevel
    except ImportError as exc:
        raise _changed(
            "torch",
            "torch.distributed.distributed_c10d._get_default_store",
            "for the barriers of several processes",
        ) from exc
    return _get_default_store


def default_store():
    """The process group's key-value store."""
    return _default_store_getter()()


def check_accelerator(accelerator):
    """Raise unless the accelerator keeps the lists that wrapping maintains."""
    for name in ACCELERATOR_LISTS:
        if not isinstance(getattr(accelerator, name, None), list):
            raise _changed(
                "accelerate",
                f"Accelerator.{name}",
                "to keep the prepared objects exact when unwrapping and rewrapping",
            )


def check_prepared_module(prepared, module, accelerator, wrapped):
    """Raise unless accelerate prepared ``module`` into ``prepared`` as expected.

    ``wrapped``: whether accelerate must have wrapped it (DDP). A module that
    comes back unwrapped where DDP was due has kept a mark that made
    ``prepare_model`` skip it: one that accel_mixin did not know to remove.
    """
    if wrapped and prepared is module:
        raise _changed(
            "accelerate",
            "the mark _is_accelerate_prepared on prepared modules "
            "(prepare_model returned a module unwrapped, by a mark accel_mixin "
            "does not know)",
            "to prepare a module again after unwrapping",
        )
    # getattr: a compiled module keeps the patch on the module it compiled
    if accelerator.native_amp and getattr(module, "_original_forward", None) is None:
        raise _changed(
            "accelerate",
            "the mark _original_forward on prepared modules",
            "to keep mixed precision when unwrapping and rewrapping",
        )


def check_dataloader(dataloader):
    """Raise unless a prepared training dataloader exposes its shuffling state
    (iterable data has none: it goes through accelerate's dispatcher)."""
    if isinstance(getattr(dataloader, "dataset", None), IterableDataset):
        return
    for name in DATALOADER_ATTRIBUTES:
        if not hasattr(dataloader, name):
            raise _changed(
                "accelerate",
                f"{type(dataloader).__name__}.{name}",
                "to save and restore the shuffling of the training data",
            )


def start_persistent_iterator(loader):
    """Start the iterator of the torch DataLoader ``loader``, whose workers
    persist, unless it has one; return whether it started one."""
    if not hasattr(loader, "_iterator") or not hasattr(loader, "_get_iterator"):
        raise _changed(
            "torch",
            "DataLoader._iterator and DataLoader._get_iterator",
            "to start the persistent workers of a resumed fit without drawing their seed twice",
        )
    if loader._iterator is not None:  # pylint: disable=protected-access
        return False
    # DataLoader.__iter__ resets an iterator it has, and draws nothing then
    loader._iterator = loader._get_iterator()  # pylint: disable=protected-access
    return True


def batch_sampler_owner(dataloader):
    """The torch DataLoader whose ``batch_sampler`` a prepared dataloader
    iterates.

    Raises
    ------
    ValueError
      If the data has no batch sampler (an ``IterableDataset``): batches
      cannot be skipped without loading them.

    """
    owner = getattr(dataloader, "base_dataloader", dataloader)
    if not hasattr(owner, "batch_sampler"):
        raise _changed(
            "accelerate",
            f"{type(dataloader).__name__}.base_dataloader.batch_sampler",
            "to resume an epoch without loading the batches already trained",
        )
    if owner.batch_sampler is None or isinstance(getattr(owner, "dataset", None), IterableDataset):
        raise ValueError(
            "Training states inside an epoch need map-style training data (a Dataset with "
            "__getitem__ and __len__): the batches already trained are skipped by their "
            "indices. With an IterableDataset, save at epoch ends only "
            "(TrainingCheckpoint(every_n_batches=None))."
        )
    return owner


def missing(accelerator):
    """The private names that are missing here, for an accelerator.

    Prepares a small module and dataloader on ``accelerator`` to look.
    """
    found = []
    for check in (
        _default_store_getter,
        lambda: check_accelerator(accelerator),
        lambda: _check_prepare(accelerator),
        _check_skorch,
    ):
        try:
            check()
        except InternalsChanged as exc:
            found.append(str(exc))
    return found


def _check_prepare(accelerator):
    module = torch.nn.Linear(2, 2)
    prepared = accelerator.prepare_model(module, evaluation_mode=True)
    try:
        check_prepared_module(prepared, module, accelerator, wrapped=False)
    finally:
        accelerator._models[:] = [m for m in accelerator._models if m is not module]  # pylint: disable=protected-access
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2, shuffle=True
    )
    prepared = accelerator.prepare_data_loader(data)
    accelerator._dataloaders[:] = [d for d in accelerator._dataloaders if d is not prepared]  # pylint: disable=protected-access
    check_dataloader(prepared)


def _check_skorch():
    if not callable(getattr(skorch_utils, "_check_f_arguments", None)):
        raise _changed(
            "skorch",
            "skorch.utils._check_f_arguments",
            "to read the file arguments of save_params and load_params",
        )
    if not callable(getattr(NeuralNet, "_get_module", None)):
        raise _changed(
            "skorch",
            "NeuralNet._get_module",
            "to find the modules that save_params and load_params name",
        )
    check_progress_bar()


def check_progress_bar():
    """Raise unless skorch's ProgressBar counts the batches of a phase."""
    if not callable(getattr(ProgressBar, "_get_batches_per_epoch_phase", None)):
        raise _changed(
            "skorch",
            "ProgressBar._get_batches_per_epoch_phase",
            "to make each rank's progress bar count the batches it runs",
        )
