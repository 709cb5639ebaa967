"""Every private name of torch, accelerate and skorch that accel_mixin uses.

Each is used because no public API does the job; a release that renames one
must make accel_mixin fail loudly, naming it, never degrade silently. The
helpers check where they are used; ``missing`` lists what is gone, for a test
on the pinned versions.

- torch: ``distributed_c10d._get_default_store`` (the store of the barriers),
  ``DataLoader._iterator``/``_get_iterator`` (persistent workers), a state
  dict's ``_metadata``, a compiled module's ``_orig_mod``;
- accelerate: ``Accelerator._models``, ``_optimizers``, ``_schedulers``,
  ``_dataloaders`` (kept holding exactly what is wrapped), the module marks
  ``_original_forward`` and ``_is_accelerate_prepared``, a prepared
  dataloader's ``synchronized_generator``, ``iteration`` and
  ``base_dataloader.batch_sampler``;
- accelerate: ``optimizer.is_lomo_available``, which ``AcceleratedOptimizer.step``
  calls twice per step, each time an ``importlib`` search of ``sys.path``
  (``cache_lomo_check``; an optimisation: where the name is gone, nothing is
  cached and nothing else changes);
- skorch: ``utils._check_f_arguments``, ``ProgressBar._get_batches_per_epoch_phase``,
  ``DistributedHistory._history``, ``EpochScoring._scoring`` (scored on the
  main process) and ``_record_score`` (its score recorded on every rank), and
  ``callbacks.scoring._cache_net_forward_iter``.

skorch's own ``NeuralNet`` methods that the mixin overrides and calls through
``super()`` are its extension points, not listed: ``_validate_params``,
``_initialize_callbacks``, ``_step_optimizer``, ``_zero_grad_optimizer``,
``_get_module``, ``_check_device``, ``_set_training``, and the net's
``_modules``, ``_criteria``, ``_optimizers`` registries.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import accelerate
import accelerate.optimizer
import skorch
import torch
import torch.distributed.distributed_c10d as c10d
from accelerate.data_loader import DataLoaderDispatcher
from skorch import utils as skorch_utils
from skorch.callbacks import EpochScoring, ProgressBar
from skorch.callbacks import scoring as skorch_scoring
from torch.utils.data import DataLoader, Dataset, IterableDataset

from accel_mixin.errors import InternalsChanged

if TYPE_CHECKING:
    from accelerate import Accelerator
    from skorch import NeuralNet
    from skorch.history import DistributedHistory, History

__all__ = [
    "InternalsChanged",
    "accelerator_list",
    "batch_sampler_owner",
    "batches_per_epoch_phase",
    "cache_lomo_check",
    "cached_forward_iter",
    "check_accelerator",
    "check_dataloader",
    "check_f_arguments",
    "check_prepared_module",
    "compiled_inner",
    "copy_state_dict",
    "default_store",
    "dispatches",
    "drop_dataloader",
    "missing",
    "pop_marks",
    "put_marks",
    "record_score",
    "score_of",
    "start_persistent_iterator",
    "wrapped_history",
]

_LISTS = {"module": "_models", "criterion": "_models", "optimizer": "_optimizers"}
_LISTS.update(scheduler="_schedulers", dataloader="_dataloaders")
# the autocast patch of ``forward`` and the flag that makes ``prepare`` skip a module
_MARKS = ("forward", "_original_forward", "_is_accelerate_prepared")
_SCORES = "to score cached predictions once, on the main process"
# the private functions used: (owner, name, what they are used for)
_PRIVATE: dict[str, tuple[Any, str, str]] = {
    "store": (c10d, "_get_default_store", "for the barriers of several processes"),
    "f_arguments": (
        skorch_utils,
        "_check_f_arguments",
        "to read the file arguments of save_params and load_params",
    ),
    "batches": (
        ProgressBar,
        "_get_batches_per_epoch_phase",
        "to make each rank's progress bar count the batches it runs",
    ),
    "forward_iter": (skorch_scoring, "_cache_net_forward_iter", _SCORES),
    "scoring": (EpochScoring, "_scoring", _SCORES),  # ScoringBase's, in skorch 1.4
    "record": (EpochScoring, "_record_score", _SCORES),
}

# what ``pop_marks`` took off: each module with its attributes
Marks = list[tuple[torch.nn.Module, dict[str, Any]]]


class BatchSamplerOwner(Protocol):
    """The torch DataLoader that ``batch_sampler_owner`` returns: one whose
    batch sampler is there."""

    @property
    def batch_sampler(self) -> Iterable[list[int]]: ...


def _require(present: object, package: str, name: str, what: str) -> None:
    """Raise, naming ``name``, unless ``present``."""
    if not present:
        raise InternalsChanged(
            f"{package} no longer has {name}, which accel_mixin uses {what}. This accel_mixin "
            f"was tested with the versions in constraints/pinned.txt; installed are torch "
            f"{torch.__version__}, accelerate {accelerate.__version__}, skorch "
            f"{skorch.__version__}. Install the pinned versions, or an accel_mixin that "
            "supports these."
        )


def _private(key: str) -> Any:
    """The private function ``_PRIVATE[key]`` names; raise, naming it, where it is gone."""
    owner, name, what = _PRIVATE[key]
    found = getattr(owner, name, None)
    package = (owner.__module__ if isinstance(owner, type) else owner.__name__).split(".")[0]
    _require(callable(found), package, f"{owner.__name__}.{name}", what)
    return found


def default_store() -> c10d.Store:
    """The process group's key-value store."""
    return _private("store")()


def check_accelerator(accelerator: Accelerator) -> None:
    """Raise unless the accelerator keeps the lists that wrapping maintains."""
    for name in sorted(set(_LISTS.values())):
        present = isinstance(getattr(accelerator, name, None), list)
        what = "to keep the prepared objects exact when unwrapping and rewrapping"
        _require(present, "accelerate", f"Accelerator.{name}", what)


def accelerator_list(accelerator: Accelerator, kind: str) -> list[Any]:
    """The accelerator's list of prepared objects of ``kind`` ('module', ...)."""
    return getattr(accelerator, _LISTS[kind])


def drop_dataloader(accelerator: Accelerator, dataloader: DataLoader) -> None:
    """Take ``dataloader`` off the accelerator's list of prepared dataloaders."""
    dataloaders = accelerator_list(accelerator, "dataloader")
    dataloaders[:] = [dl for dl in dataloaders if dl is not dataloader]


def pop_marks(obj: torch.nn.Module) -> Marks:
    """Remove accelerate's marks from a raw module (a compiled one keeps part
    on its ``_orig_mod``); return them for ``put_marks``."""
    targets: list[torch.nn.Module] = [obj] + [
        t for t in (vars(obj).get("_modules", {}).get("_orig_mod"),) if t
    ]
    patched = any("_original_forward" in vars(t) for t in targets)
    # only the forward that accelerate patched is ours to remove
    keys = _MARKS if patched else ("_is_accelerate_prepared",)
    marks = [(t, {k: vars(t).pop(k) for k in keys if k in vars(t)}) for t in targets]
    original = next((m["_original_forward"] for _, m in marks if "_original_forward" in m), None)
    if original is not None and getattr(original, "__func__", None) is not type(obj).forward:
        vars(obj)["forward"] = original  # the instance's own forward (torch.compile's)
    return marks


def put_marks(marks: Marks) -> None:
    for target, attrs in marks:
        vars(target).update(attrs)


def check_prepared_module(
    prepared: torch.nn.Module, module: torch.nn.Module, accelerator: Accelerator, wrapped: bool
) -> None:
    """Raise unless accelerate prepared ``module`` into ``prepared`` with the
    marks unwrapping relies on, and into a wrapper where ``wrapped`` (DDP)."""
    _require(
        not (wrapped and prepared is module),
        "accelerate",
        "the mark _is_accelerate_prepared on prepared modules (prepare_model returned "
        "a module unwrapped, by a mark accel_mixin does not know)",
        "to prepare a module again after unwrapping",
    )
    # getattr: a compiled module keeps the patch on the module it compiled
    _require(
        not accelerator.native_amp or getattr(module, "_original_forward", None) is not None,
        "accelerate",
        "the mark _original_forward on prepared modules",
        "to keep mixed precision when unwrapping and rewrapping",
    )


def dispatches(dataloader: DataLoader) -> bool:
    """Whether ``dataloader`` is accelerate's ``DataLoaderDispatcher``: the
    main process reads every batch and sends each rank its part."""
    # type(): accelerate's loaders report their base DataLoader's __class__
    return issubclass(type(dataloader), DataLoaderDispatcher)


def check_dataloader(dataloader: DataLoader) -> None:
    """Raise unless a prepared training dataloader exposes its shuffling state
    (iterable data has none; a dispatching one draws it on the main process
    alone, in its own sampler)."""
    if isinstance(getattr(dataloader, "dataset", None), IterableDataset):
        return
    names = ("iteration",) if dispatches(dataloader) else ("synchronized_generator", "iteration")
    for name in names:
        what = "to save and restore the shuffling of the training data"
        _require(
            hasattr(dataloader, name), "accelerate", f"{type(dataloader).__name__}.{name}", what
        )


def start_persistent_iterator(loader: DataLoader) -> bool:
    """Start the iterator of ``loader``, whose workers persist, unless it has
    one; return whether it started one."""
    _require(
        hasattr(loader, "_iterator") and hasattr(loader, "_get_iterator"),
        "torch",
        "DataLoader._iterator and DataLoader._get_iterator",
        "to start the persistent workers of a resumed fit without drawing their seed twice",
    )
    if loader._iterator is not None:  # pylint: disable=protected-access
        return False
    # DataLoader.__iter__ resets an iterator it has, and draws nothing then
    loader._iterator = loader._get_iterator()  # pylint: disable=protected-access
    return True


def batch_sampler_owner(dataloader: DataLoader) -> BatchSamplerOwner:
    """The torch DataLoader whose ``batch_sampler`` a prepared dataloader
    iterates; ValueError for data without one (an ``IterableDataset``)."""
    owner: Any = getattr(dataloader, "base_dataloader", dataloader)
    _require(
        hasattr(owner, "batch_sampler"),
        "accelerate",
        f"{type(dataloader).__name__}.base_dataloader.batch_sampler",
        "to resume an epoch without loading the batches already trained",
    )
    if dispatches(dataloader):
        raise ValueError(
            "Training states inside an epoch need each rank to skip the batches it "
            "trained, and with DataLoaderConfiguration(dispatch_batches=True) the main "
            "process reads the batches of every rank. Leave dispatch_batches at its "
            "default, or save at epoch ends only (TrainingCheckpoint(every_n_batches=None))."
        )
    if owner.batch_sampler is None or isinstance(getattr(owner, "dataset", None), IterableDataset):
        raise ValueError(
            "Training states inside an epoch need map-style training data (a Dataset with "
            "__getitem__ and __len__), whose batches already trained are skipped by their "
            "indices, or a stream that records where it stopped: an IterableDataset with "
            "state_dict() and load_state_dict(state), trained with "
            "TrainingCheckpoint(every_n_batches=...) or "
            "DataLoaderConfiguration(use_stateful_dataloader=True). Otherwise save at epoch "
            "ends only (TrainingCheckpoint(every_n_batches=None))."
        )
    return owner


def compiled_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module that torch.compile wrapped in ``module``, or None."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def copy_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A shallow copy of ``state_dict`` that keeps torch's ``_metadata``."""
    metadata = getattr(state_dict, "_metadata", None)
    copy = OrderedDict(state_dict)
    if metadata is not None:
        # an attribute torch sets on its state dicts and leaves out of their type
        copy._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]  # pylint: disable=protected-access
    return copy


def check_f_arguments(caller: str, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """skorch's ``_check_f_arguments``, shared by ``save_params`` and ``load_params``."""
    return _private("f_arguments")(caller, **kwargs)


def batches_per_epoch_phase(
    progress_bar: ProgressBar, net: NeuralNet | None, dataset: Dataset | None, training: bool
) -> int:
    """skorch's count of a ProgressBar's batches of one phase of the whole data."""
    _private("batches")
    return progress_bar._get_batches_per_epoch_phase(net, dataset, training)  # pylint: disable=protected-access


def cached_forward_iter(
    net: NeuralNet, use_caching: bool | str, y_pred: list[Any]
) -> AbstractContextManager[NeuralNet]:
    """skorch's context within which ``net.forward_iter`` yields ``y_pred``."""
    return _private("forward_iter")(net, use_caching, y_pred)


def score_of(callback: EpochScoring, net: NeuralNet, X: Any, y: Any) -> Any:
    """The score an ``EpochScoring`` computes of ``X`` and ``y`` (``_scoring``)."""
    _private("scoring")
    return callback._scoring(net, X, y)  # pylint: disable=protected-access


def record_score(callback: EpochScoring, history: History, score: Any) -> None:
    """Record ``score`` as ``EpochScoring.on_epoch_end`` records the score it
    computed (``_record_score``): the score, and whether it is the best."""
    _private("record")
    callback._record_score(history, score)  # pylint: disable=protected-access


def wrapped_history(history: DistributedHistory) -> History:
    """The plain ``History`` inside skorch's ``DistributedHistory``."""
    what = "to record into its plain History"
    _require(hasattr(history, "_history"), "skorch", "DistributedHistory._history", what)
    return history._history  # pylint: disable=protected-access


def missing(accelerator: Accelerator) -> list[str]:
    """The private names missing here; prepares a small module and dataloader
    on ``accelerator`` to look."""
    found = []
    skorch_names = [key for key in _PRIVATE if key != "store"]
    for check in (
        lambda: _private("store"),
        lambda: _check_prepare(accelerator),
        lambda: [_private(key) for key in skorch_names],
    ):
        try:
            check()
        except InternalsChanged as exc:
            found.append(str(exc))
    return found


def _check_prepare(accelerator: Accelerator) -> None:
    check_accelerator(accelerator)
    module = torch.nn.Linear(2, 2)
    prepared = accelerator.prepare_model(module, evaluation_mode=True)
    try:
        check_prepared_module(prepared, module, accelerator, wrapped=False)
    finally:
        models = accelerator_list(accelerator, "module")
        models[:] = [m for m in models if m is not module]
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2, shuffle=True
    )
    prepared = accelerator.prepare_data_loader(data)
    drop_dataloader(accelerator, prepared)
    check_dataloader(prepared)


def cache_lomo_check() -> None:
    """Answer accelerate's per-step question, whether ``lomo_optim`` is
    installed, once per process.

    ``AcceleratedOptimizer.step`` asks it twice per step, each time searching
    ``sys.path`` (about 0.25 ms here): a tenth of a step of the small models
    skorch users train. The answer changes only if the package is installed
    while training runs.
    """
    optimizer = accelerate.optimizer
    check = getattr(optimizer, "is_lomo_available", None)
    if check is None or getattr(check, "cache_info", None) is not None:
        return
    optimizer.is_lomo_available = functools.lru_cache(maxsize=1)(check)
