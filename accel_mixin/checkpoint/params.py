"""save_params and load_params whose files users can trust."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import torch

from accel_mixin.checkpoint import atomic_files as _files
from accel_mixin.checkpoint import remote_files, storage
from accel_mixin.checkpoint.weights import (
    File,
    check_readable,
    clean_state_dict,
    describe_content,
    history_error,
    load_module_state,
    read_error,
)
from accel_mixin.distributed.sharding import shard_optimizer_state
from accel_mixin.errors import CheckpointError
from accel_mixin.internals import check_f_arguments

if TYPE_CHECKING:
    from skorch.callbacks import Checkpoint

    # to the type checker the mixin is the skorch net it is mixed into
    from skorch.net import NeuralNet as _Net
else:
    _Net = object

# what skorch's save_params and load_params adapt to: the object of an
# attribute (``module_``, ``optimizer_``) -> what they call state_dict on
_Adapter = Callable[[str, Any], Any]


class SafeParamsMixin(_Net):
    """``save_params`` and ``load_params`` for files users can trust.

    Works with any skorch net, e.g. ``class Net(SafeParamsMixin,
    NeuralNetClassifier)``; ``AccelerateMixin`` builds on it. skorch's own
    methods run (and so do overrides of them on a class below this one),
    with what they read and write adapted:

    - Files are written atomically: skorch writes them under temporary
      names in their target directories; once all of them are complete they
      are fsynced and renamed into place together. A crash or an error
      during a save leaves the previous files as they were.
    - A file name may be an fsspec URL (``s3://bucket/params.pt``): the file
      is written locally and uploaded once complete, in one upload, and
      read from a local copy (``checkpoint.remote_files``).
    - Module keys are saved without the ``module.`` and ``_orig_mod.``
      prefixes of DDP and ``torch.compile``; loading strips such prefixes
      when every key of the file carries them.
    - Loading uses ``weights_only=True`` (or skorch's ``torch_load_kwargs``)
      and maps module files into memory, so it adds about one file's size
      to peak memory, not two.
    - A missing, truncated or corrupt file, a directory, another
      architecture or a file with code in it raises an error that names the
      file, the key and, where the shapes differ, both shapes.

    Parameters and return values are those of
    ``skorch.net.NeuralNet.save_params`` and ``load_params``.

    """

    # skorch's parameter, which load_params adapts for the time it runs
    torch_load_kwargs: dict[str, Any] | None

    def save_params(
        self,
        f_params: File | None = None,
        f_optimizer: File | None = None,
        f_criterion: File | None = None,
        f_history: File | None = None,
        use_safetensors: bool = False,
        **kwargs: File | None,
    ) -> None:
        """Save the state of the net's modules, optimizers and history.

        See ``skorch.net.NeuralNet.save_params``, which this calls with
        temporary files beside the targets, renamed into place together.

        """
        files = dict(
            f_params=f_params,
            f_optimizer=f_optimizer,
            f_criterion=f_criterion,
            f_history=f_history,
            **kwargs,
        )
        files = {key: storage.local(f) for key, f in files.items()}
        for attr, f in check_f_arguments("save_params", **files)[0].items():
            obj = self.__dict__.get(attr)  # a missing one: skorch's error
            if use_safetensors and obj is not None and not isinstance(obj, torch.nn.Module):
                raise ValueError(
                    f"Cannot save f_{attr[:-1]} to {f} with use_safetensors=True: "
                    "safetensors stores tensors only, and the state of an optimizer "
                    "holds other objects; save it without safetensors."
                )
        named = {key: f for key, f in files.items() if isinstance(f, (str, os.PathLike))}
        gathered = self.__dict__.get(_GATHERED, {})
        with (
            # a URL's file is written here, then uploaded (remote_files)
            remote_files.uploaded(named) as named,
            _files.atomic_files(named.values()) as temporaries,
            ExitStack() as opened,
            self._accessing(lambda attr, obj: _Saving(obj, gathered.get(attr))),
        ):
            by_name = dict(zip(named, temporaries))
            files.update(by_name)
            if use_safetensors:  # by name, safetensors would rename a temporary file of its own
                for key in set(named) - {"f_history"}:
                    files[key] = opened.enter_context(open(by_name[key], "wb"))
            super().save_params(use_safetensors=use_safetensors, **files)

    def load_params(
        self,
        f_params: File | None = None,
        f_optimizer: File | None = None,
        f_criterion: File | None = None,
        f_history: File | None = None,
        checkpoint: Checkpoint | None = None,
        use_safetensors: bool = False,
        **kwargs: File | None,
    ) -> None:
        """Load the state of the net's modules, optimizers and history.

        See ``skorch.net.NeuralNet.load_params``, which this calls; loading is
        safe and tolerant of wrapper prefixes, and errors name the file.

        """
        given = dict(
            kwargs,
            f_params=f_params,
            f_optimizer=f_optimizer,
            f_criterion=f_criterion,
            f_history=f_history,
        )
        if any(isinstance(f, str) and "://" in f for f in given.values()):
            # file:// as a path; other URLs read from local copies, errors naming the URLs
            given = {key: storage.local(f) for key, f in given.items()}
            with remote_files.fetched(given) as fetched:
                SafeParamsMixin.load_params(
                    self, checkpoint=checkpoint, use_safetensors=use_safetensors, **fetched
                )
            return
        explicit = dict(kwargs, f_params=f_params, f_optimizer=f_optimizer, f_criterion=f_criterion)

        def files() -> dict[str, File]:
            # as skorch resolves them, once it read a checkpoint's history,
            # which its file names may be formatted with
            resolved = dict(kwargs)
            if checkpoint is not None:
                resolved = dict(checkpoint.get_formatted_files(self), **kwargs)
            resolved.update({key: val for key, val in explicit.items() if val})
            return check_f_arguments("load_params", **resolved)[0]

        f_history_read = f_history
        if f_history is None and checkpoint is not None and checkpoint.f_history is not None:
            f_history_read = checkpoint.f_history_
        check_readable(f_history_read)  # skorch reads it first
        # skorch takes torch_load_kwargs once for every file: a dict of ours,
        # in which module files get mmap=True and optimizer files (whose
        # tensors the optimizer keeps) do not
        user_kwargs = self.torch_load_kwargs
        load_kwargs = {"weights_only": True} if user_kwargs is None else dict(user_kwargs)
        loading = _Loading(files, f_history_read, use_safetensors, load_kwargs)
        weights_only = load_kwargs.get("weights_only")
        self.torch_load_kwargs = load_kwargs
        with self._accessing(loading.adapter):
            try:
                super().load_params(
                    f_params=f_params,
                    f_optimizer=f_optimizer,
                    f_criterion=f_criterion,
                    f_history=f_history,
                    checkpoint=checkpoint,
                    use_safetensors=use_safetensors,
                    **kwargs,
                )
            except Exception as exc:  # pylint: disable=broad-except
                error = loading.error(exc, weights_only)
                if error is None or error is exc:
                    raise
                raise error from exc
            finally:
                self.torch_load_kwargs = user_kwargs

    def _saving_gathered(self, states: dict[str, dict[str, Any]]) -> AbstractContextManager[None]:
        """Within the block ``save_params`` writes ``states[attr]`` (full
        states gathered from a sharded module) in place of ``attr``'s own."""
        return self._holding(_GATHERED, states)

    def _accessing(self, adapter: _Adapter) -> AbstractContextManager[None]:
        """Within the block ``_get_module`` returns ``adapter(attr, obj)``."""
        return self._holding(_ADAPTER, adapter)

    @contextmanager
    def _holding(self, key: str, value: object) -> Iterator[None]:
        self.__dict__[key] = value
        try:
            yield
        finally:
            self.__dict__.pop(key, None)

    def _get_module(self, name: str, msg: str) -> Any:
        module = super()._get_module(name, msg)
        adapter = self.__dict__.get(_ADAPTER)
        return module if adapter is None else adapter(name, module)


_ADAPTER = "_accel_mixin_params_adapter"
_GATHERED = "_accel_mixin_gathered_states"


class _Saving:
    """What skorch's save_params saves: module keys without wrapper prefixes,
    or the full state gathered from a sharded module or its optimizer."""

    def __init__(self, obj: Any, gathered: dict[str, Any] | None = None) -> None:
        self._obj, self._state = obj, gathered

    def state_dict(self) -> dict[str, Any]:
        # skorch asks twice per file: the second time gets the first's
        if self._state is None:
            obj = self._obj
            self._state = (
                clean_state_dict(obj) if isinstance(obj, torch.nn.Module) else obj.state_dict()
            )
        return self._state


class _Loading:
    """Where skorch's load_params loads: checked loads, and the file a failure is about."""

    def __init__(
        self,
        files: Callable[[], dict[str, File]],
        f_history: File | None,
        use_safetensors: bool,
        load_kwargs: dict[str, Any],
    ) -> None:
        self._files = files
        self.files: dict[str, File] | None = None
        self.f_history = f_history
        self.use_safetensors = use_safetensors
        self.load_kwargs = load_kwargs
        self.mmap = "mmap" not in load_kwargs  # unless the user decides
        self.reading: File | None = None  # the file skorch reads now

    def adapter(self, attr: str, obj: Any) -> _Loader:  # skorch reads the file next
        if self.files is None:
            self.files = self._files()
        self.reading = self.files.get(attr)
        check_readable(self.reading)
        if self.mmap:
            self.load_kwargs.pop("mmap", None)
            if isinstance(obj, torch.nn.Module) and _is_zip(self.reading):
                self.load_kwargs["mmap"] = True
        return _Loader(self, attr, obj)

    def error(self, exc: BaseException, weights_only: bool | None) -> CheckpointError | None:
        if self.reading is not None:
            return read_error(
                self.reading, exc, weights_only=weights_only, use_safetensors=self.use_safetensors
            )
        if self.f_history is not None:
            return history_error(self.f_history, exc)
        return None


def _is_zip(f: File | None) -> bool:
    return isinstance(f, (str, os.PathLike)) and zipfile.is_zipfile(f)


class _Loader:
    def __init__(self, loading: _Loading, attr: str, obj: Any) -> None:
        self._loading, self._attr, self._obj = loading, attr, obj

    def state_dict(self) -> dict[str, Any]:
        return self._obj.state_dict()

    def load_state_dict(self, state: object) -> None:
        source, self._loading.reading = self._loading.reading, None
        if isinstance(self._obj, torch.nn.Module):
            load_module_state(self._obj, state, source=source, name=self._attr)
        else:
            load_optimizer_state(self._obj, state, source=source, name=self._attr)


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, state: object, *, source: object, name: str
) -> None:
    """``optimizer.load_state_dict(state)``, or a ``CheckpointError`` that
    names the file ``source``, the attribute ``name`` and the fix."""
    if not (isinstance(state, Mapping) and "param_groups" in state and "state" in state):
        raise CheckpointError(
            f"{source} is not an optimizer state for {name}: it holds "
            f"{describe_content(state)}; save it with net.save_params(f_optimizer=...) or "
            "torch.save(optimizer.state_dict(), path)."
        )
    try:
        # an optimizer of a sharded module (FSDP2) takes this rank's shards;
        # torch types its argument a dict, and copies it as any mapping
        # that has copy() (torch.load gives dicts)
        optimizer.load_state_dict(shard_optimizer_state(optimizer, state))  # type: ignore[arg-type]

    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{source} does not fit {name}: {exc}. The optimizer was saved for other "
            "parameters or parameter groups: initialize the net as it was when the "
            "file was saved."
        ) from exc
