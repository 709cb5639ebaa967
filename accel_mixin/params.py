"""save_params and load_params whose files users can trust."""

import torch
from skorch.utils import _check_f_arguments, get_map_location

from accel_mixin.files import read_history, read_state, write_history, write_state
from accel_mixin.state_dict import CheckpointError, clean_state_dict, load_module_state

__all__ = ["SafeParamsMixin", "load_optimizer_state"]

_NOT_INITIALIZED = (
    "Cannot {} state of an un-initialized model. Please initialize first by calling "
    ".initialize() or by fitting the model with .fit(...)."
)
_NO_ATTRIBUTE = (
    "You are trying to {} 'f_{{name}}' but for that to work, the net needs to have an "
    "attribute called 'net.{{name}}_' that is a PyTorch Module or Optimizer; make sure "
    "that it exists and check for typos."
)


class SafeParamsMixin:
    """``save_params`` and ``load_params`` for files users can trust.

    Works with any skorch net, e.g. ``class Net(SafeParamsMixin,
    NeuralNetClassifier)``; ``AccelerateMixin`` builds on it. Compared with
    skorch's own methods:

    - Files are written atomically: to a temporary file in the target
      directory, flushed, fsynced and renamed into place. A crash or an
      error during a save leaves the previous file as it was.
    - Module keys are saved without the ``module.`` and ``_orig_mod.``
      prefixes of DDP and ``torch.compile``; loading strips such prefixes
      when every key of the file carries them.
    - Loading uses ``weights_only=True`` (or skorch's ``torch_load_kwargs``)
      and maps torch files into memory, so it adds about one file's size to
      peak memory, not two.
    - A missing, truncated or corrupt file, a directory, another
      architecture or a file with code in it raises an error that names the
      file, the key and, where the shapes differ, both shapes.

    Parameters and return values are those of
    ``skorch.net.NeuralNet.save_params`` and ``load_params``.

    """

    def save_params(
        self,
        f_params=None,
        f_optimizer=None,
        f_criterion=None,
        f_history=None,
        use_safetensors=False,
        **kwargs,
    ):
        """Save the state of the net's modules, optimizers and history.

        See ``skorch.net.NeuralNet.save_params``; files are written
        atomically and module keys carry no wrapper prefix.

        """
        kwargs_module, kwargs_other = _check_f_arguments(
            "save_params",
            f_params=f_params,
            f_optimizer=f_optimizer,
            f_criterion=f_criterion,
            f_history=f_history,
            **kwargs,
        )
        if not kwargs_module and not kwargs_other:
            if self.verbose:
                print("Nothing to save")
            return

        states = {}
        for attr, f in kwargs_module.items():
            obj = self._checked_attribute(attr, "save")
            if use_safetensors and not isinstance(obj, torch.nn.Module):
                raise ValueError(
                    f"Cannot save f_{attr[:-1]} to {f} with use_safetensors=True: "
                    "safetensors stores tensors only, and the state of an optimizer "
                    "holds other objects; save it without safetensors."
                )
            states[attr] = (
                clean_state_dict(obj) if isinstance(obj, torch.nn.Module) else obj.state_dict()
            )
        # everything is checked before the first file is written
        for attr, f in kwargs_module.items():
            write_state(states[attr], f, use_safetensors=use_safetensors)
        if kwargs_other.get("f_history") is not None:
            write_history(self.history, kwargs_other["f_history"])

    def load_params(
        self,
        f_params=None,
        f_optimizer=None,
        f_criterion=None,
        f_history=None,
        checkpoint=None,
        use_safetensors=False,
        **kwargs,
    ):
        """Load the state of the net's modules, optimizers and history.

        See ``skorch.net.NeuralNet.load_params``; loading is safe, lean and
        tolerant of wrapper prefixes, and errors name the file.

        """
        kwargs_full = {}
        if checkpoint is not None:
            if not self.initialized_:
                self.initialize()
            if f_history is None and checkpoint.f_history is not None:
                self.history = read_history(checkpoint.f_history_)
            kwargs_full.update(**checkpoint.get_formatted_files(self))
        kwargs_full.update(**kwargs)
        for key, val in (
            ("f_params", f_params),
            ("f_optimizer", f_optimizer),
            ("f_criterion", f_criterion),
            ("f_history", f_history),
        ):
            if val:
                kwargs_full[key] = val
        kwargs_module, kwargs_other = _check_f_arguments("load_params", **kwargs_full)
        if not kwargs_module and not kwargs_other:
            if self.verbose:
                print("Nothing to load")
            return

        if kwargs_other.get("f_history") is not None:
            self.history = read_history(kwargs_other["f_history"])
        map_location = get_map_location(self.device)
        self.device = self._check_device(self.device, map_location)
        for attr, f in kwargs_module.items():
            obj = self._checked_attribute(attr, "load")
            is_module = isinstance(obj, torch.nn.Module)
            if use_safetensors and not is_module:
                raise ValueError(
                    f"Cannot load f_{attr[:-1]} from {f} with use_safetensors=True: "
                    "optimizers are not saved with safetensors."
                )
            state = read_state(
                f,
                use_safetensors=use_safetensors,
                torch_load_kwargs=self.torch_load_kwargs,
                map_location=map_location,
                # an optimizer keeps the loaded tensors: copy them, do not map
                mmap=is_module,
            )
            if is_module:
                load_module_state(obj, state, source=f, name=attr)
            else:
                load_optimizer_state(obj, state, source=f, name=attr)
            del state

    def _checked_attribute(self, attr, action):
        if attr.endswith("_") and not self.initialized_:
            self.check_is_fitted([attr], msg=_NOT_INITIALIZED.format(action))
        return self._get_module(attr, msg=_NO_ATTRIBUTE.format(action))


def load_optimizer_state(optimizer, state, *, source, name):
    """``optimizer.load_state_dict(state)``, or a ``CheckpointError`` that
    names the file ``source``, the attribute ``name`` and the fix."""
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{source} does not fit {name}: {exc}. The optimizer was saved for other "
            "parameters or parameter groups: initialize the net as it was when the "
            "file was saved."
        ) from exc
