"""Values described by their content: what a run identity hashes.

Two values with the same description must train the same, and two that
train differently must not share one: values are described by content,
never by address or type alone. Arrays, tensors and bytes by dtype, shape
and SHA-256; modules by architecture and ``state_dict``; estimators and
callbacks by the parameters that differ from their ``__init__`` defaults;
functions by name, defaults and closure; any other object by its class and
attributes, within ``MAX_DEPTH`` levels and ``MAX_VALUES`` values. What
cannot be so described is never guessed equal to another: it becomes
``{"undescribable": ...}`` and the ``Describer`` records why, so that
``runs`` refuses to resume such a fit.

A description never depends on chance. Random generators are described by
their state, except inside a ``Dataset``, where they are described by class
only: a Dataset that augments from a generator of its own (seeded per rank,
or not at all) is the same data on every rank and in every launch. A
Dataset's rows are read as ``distributed.sample_rows`` reads them, with every
generator set to a fixed seed and put back afterwards, so that reading them
neither depends on nor changes the random number streams of training.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

import numpy as np
import torch
from skorch.dataset import get_len
from torch.utils.data import Dataset, IterableDataset

from accel_mixin.distributed.sample_rows import (
    generator_state,
    is_generator,
    repeatable_digest,
    slot_names,
)

__all__ = [
    "MAX_DEPTH",
    "MAX_VALUES",
    "Describer",
    "fingerprint",
    "init_defaults",
    "name_of",
]

MAX_DEPTH = 8
MAX_VALUES = 100_000
_SAMPLE_ROWS = 64
_CHUNK = 64 * 2**20
_PLAIN = (type(None), bool, int, float, str)
_DEFAULT = object()
# what stands for the rows of a Dataset that reads other rows every time
_UNREPEATABLE = "rows drawn anew at every reading"

# a description: plain JSON data
Json = Union[None, bool, int, float, str, list["Json"], dict[str, "Json"]]


def name_of(obj: object) -> str:
    """The qualified name of a class or function, with its module."""
    qualname = getattr(obj, "__qualname__", type(obj).__name__)
    return f"{getattr(obj, '__module__', '')}.{qualname}"


@functools.lru_cache(maxsize=256)
def init_defaults(cls: type) -> dict[str, Any]:
    """The defaults of the ``__init__`` parameters of ``cls`` and its bases:
    the most derived class that names a parameter decides its default."""
    defaults: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        for param in parameters:
            if param.default is not param.empty:
                defaults.setdefault(param.name, param.default)
    return defaults


def _array_bytes(array: np.ndarray) -> memoryview:
    # a memoryview of a contiguous array: hashing 1 GB copies nothing
    array = np.ascontiguousarray(array)
    if not array.size:
        return memoryview(b"")
    # numpy's stubs declare its buffer protocol only from Python 3.12 on
    return memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


class Describer:
    """Describes values as plain JSON data; keeps the reasons for what it
    could not describe in ``refusals`` (``(path, reason)`` pairs)."""

    DEFAULT = _DEFAULT  # what ``unless_default`` returns for a default

    def __init__(self) -> None:
        self.refusals: list[tuple[str, str]] = []
        self._values = 0
        self._path_ids: set[int] = set()
        self._inside_datasets = 0

    def _digest(self, data: bytes | memoryview) -> str:
        """SHA-256 of ``data``, of the digests of its 64 MiB chunks where
        larger (the hash of a fit's data costs a small share of its first epoch,
        so threads would buy next to nothing)."""
        view = memoryview(data).cast("B")
        if len(view) <= _CHUNK:
            return hashlib.sha256(view).hexdigest()
        digests = (
            hashlib.sha256(view[start : start + _CHUNK]).digest()
            for start in range(0, len(view), _CHUNK)
        )
        return hashlib.sha256(b"chunks" + b"".join(digests)).hexdigest()

    def refuse(self, path: str, reason: str) -> dict[str, Json]:
        self.refusals.append((path, reason))
        return {"undescribable": reason}

    def __call__(self, value: Any, path: str = "", depth: int = 0) -> Json:
        self._values += 1
        if self._values > MAX_VALUES:
            return self.refuse(path, f"too large to describe (over {MAX_VALUES} values)")
        if depth > MAX_DEPTH:
            return self.refuse(path, f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, _PLAIN) and not isinstance(value, enum.Enum):
            return repr(value) if isinstance(value, float) else value
        if isinstance(value, (bytes, bytearray, memoryview)):
            return {"bytes": self._digest(bytes(value))}
        if isinstance(value, enum.Enum):
            return f"{name_of(type(value))}.{value.name}"
        if isinstance(value, (torch.dtype, torch.device, np.dtype)):
            return str(value)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, np.ndarray):
            return self._array(value, path, depth)
        if isinstance(value, type):
            return name_of(value)
        if id(value) in self._path_ids:
            return {"cycle": name_of(type(value))}  # a reference back up the path
        self._path_ids.add(id(value))
        dataset = isinstance(value, Dataset)
        self._inside_datasets += dataset
        try:
            return self._composite(value, path, depth + 1)
        finally:
            self._inside_datasets -= dataset
            self._path_ids.discard(id(value))

    def _composite(self, value: Any, path: str, depth: int) -> Json:
        if isinstance(value, (list, tuple)):
            return [self(item, f"{path}[{i}]", depth) for i, item in enumerate(value)]
        if isinstance(value, dict):
            return {
                str(key): self(item, f"{path}.{key}", depth)
                for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))
            }
        if isinstance(value, (set, frozenset)):
            items = [self(item, path, depth) for item in value]
            return {"set": sorted(items, key=lambda item: json.dumps(item, sort_keys=True))}
        if isinstance(value, functools.partial):  # skorch's Freezer keeps `at` so
            return {
                "partial": self(value.func, path, depth),
                "args": self(value.args, f"{path}.args", depth),
                "keywords": self(value.keywords, path, depth),
            }
        if inspect.isfunction(value):
            return self._function(value, path, depth)
        if callable(value) and hasattr(value, "__qualname__") and not hasattr(value, "__dict__"):
            return name_of(value)  # builtins, methods
        if inspect.ismethod(value):
            return name_of(value)
        out: dict[str, Json] = {"class": name_of(type(value))}
        if isinstance(value, torch.nn.Module):
            out["architecture"] = repr(value)
            out["state"] = self(value.state_dict(), f"{path}.state_dict()", depth)
            return out
        special = self._special(value, path, depth)
        if special is not None:
            out.update(special)
            return out
        get_params = getattr(value, "get_params", None)
        if callable(get_params):
            out["params"] = self.params(value, path, depth)
            return out
        attributes = _attributes(value)
        if attributes is not None:
            out["attributes"] = self(attributes, path, depth)
            return out
        text = repr(value)
        if type(value).__repr__ is not object.__repr__ and " at 0x" not in text:
            out["repr"] = text  # a value type of an extension module
            return out
        return self.refuse(
            path,
            f"a {name_of(type(value))}, which has neither get_params, attributes nor a repr "
            "without its address to describe it by",
        )

    def params(
        self, obj: Any, path: str = "", depth: int = 0, skip: Iterable[str] = ()
    ) -> dict[str, Json]:
        """The parameters of an estimator or callback that differ from the
        defaults of its class's ``__init__``, described."""
        try:
            params = obj.get_params(deep=False)
        except TypeError:
            params = obj.get_params()
        cls: type = type(obj)
        defaults = init_defaults(cls)
        out: dict[str, Json] = {}
        for key, value in sorted(params.items()):
            if key.startswith("_") or key in skip:
                continue  # private attributes change with the installed versions
            described = self.unless_default(value, defaults, key, f"{path}.{key}", depth)
            if described is not _DEFAULT:
                out[key] = described
        return out

    def unless_default(
        self, value: Any, defaults: Mapping[str, Any], key: str, path: str, depth: int = 0
    ) -> Any:
        """``value`` described, or ``_DEFAULT`` where it is the default of
        ``key`` in ``defaults``; a value that cannot be described never is."""
        default = defaults.get(key, _DEFAULT)
        if default is value:
            return _DEFAULT
        refused = len(self.refusals)
        described = self(value, path, depth)
        if default is _DEFAULT or len(self.refusals) > refused:
            return described
        scratch = Describer()
        if scratch(default) == described and not scratch.refusals:
            return _DEFAULT
        return described

    def _function(self, value: Callable[..., Any], path: str, depth: int) -> Json:
        out: dict[str, Json] = {"function": name_of(value)}
        if value.__defaults__:
            out["defaults"] = self(value.__defaults__, f"{path}.__defaults__", depth)
        if value.__kwdefaults__:
            out["kwdefaults"] = self(value.__kwdefaults__, f"{path}.__kwdefaults__", depth)
        if value.__closure__:
            cells = []
            for name, cell in zip(value.__code__.co_freevars, value.__closure__):
                try:
                    content = cell.cell_contents
                except ValueError:  # a cell not yet filled
                    content = None
                cells.append(self(content, f"{path}.<closure {name}>", depth))
            out["closure"] = cells
        return out if len(out) > 1 else out["function"]

    def _tensor(self, value: torch.Tensor, path: str) -> Json:
        try:
            tensor = value.detach()
            if tensor.layout != torch.strided:
                tensor = tensor.to_dense()
            tensor = tensor.cpu().contiguous().reshape(-1)
            data = tensor.view(torch.uint8).numpy() if tensor.numel() else np.zeros(0, np.uint8)
        except (RuntimeError, TypeError) as exc:
            return self.refuse(path, f"a tensor that cannot be read ({exc})")
        return {
            "tensor": str(value.dtype),
            "shape": list(value.shape),
            # numpy's stubs declare its buffer protocol only from Python 3.12 on
            "sha256": self._digest(memoryview(data)),  # type: ignore[arg-type]
        }

    def _array(self, value: np.ndarray, path: str, depth: int) -> Json:
        if value.dtype == object:
            return {
                "array": "object",
                "shape": list(value.shape),
                "items": self(value.ravel().tolist(), path, depth + 1),
            }
        return {
            "array": value.dtype.str if not value.dtype.fields else str(value.dtype.descr),
            "shape": list(value.shape),
            "sha256": self._digest(_array_bytes(value)),
        }

    def _special(self, value: Any, path: str, depth: int) -> dict[str, Json] | None:
        """Objects whose content is not in their attributes."""
        if is_generator(value):
            if self._inside_datasets:
                # a Dataset's generator draws its augmentations: its state
                # differs by rank and by launch, not what is trained
                return {}
            return {"state": self(generator_state(value), path, depth)}
        if hasattr(value, "tocsr") and hasattr(value, "nnz"):  # scipy.sparse
            csr = value.tocsr()
            arrays = [csr.data, csr.indices, csr.indptr]
            return {"shape": list(csr.shape), "csr": [self(a, path, depth) for a in arrays]}
        to_numpy = getattr(value, "to_numpy", None)
        if callable(to_numpy) and hasattr(value, "index"):  # pandas
            out: dict[str, Json] = {"values": self(to_numpy(), path, depth)}
            if hasattr(value, "columns"):
                out["columns"] = self(list(value.columns), path, depth)
            out["index"] = self(np.asarray(value.index), path, depth)
            return out
        return None


def _attributes(value: object) -> dict[str, Any] | None:
    """``vars()`` of an object, or its ``__slots__``; None where it has none."""
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and (attributes or not slot_names(type(value))):
        return dict(attributes)
    slots = slot_names(type(value))
    if not slots:
        return {} if isinstance(attributes, dict) else None
    return {name: getattr(value, name, None) for name in slots}


def fingerprint(data: Any, describer: Describer | None = None, path: str = "X") -> Json:
    """Type, length and a SHA-256 of training data (None for None) that
    changes when any row does: every byte of its arrays and tensors, every
    value of a list, a ``Dataset``'s attributes and 64 of its rows evenly
    spaced (rows read from elsewhere cannot all be read at every fit), read
    as ``sample_rows.repeatable_digest`` reads them: the same on every rank
    and in every launch for a Dataset that augments at random, and no draw
    taken from training. Rows that a second reading gives otherwise (drawn
    from the operating system's entropy) are left out."""
    if data is None:
        return None
    describer = Describer() if describer is None else describer
    out: dict[str, Json] = {"type": name_of(type(data))}
    try:
        out["length"] = get_len(data)
    except (TypeError, ValueError):
        pass  # an iterable
    digest = hashlib.sha256()
    _stream(data, digest, describer, path)
    out["sha256"] = digest.hexdigest()
    return out


def _stream(data: Any, digest: hashlib._Hash, describer: Describer, path: str) -> None:
    # lists of rows can be long: streamed into the hash, not described
    if isinstance(data, dict):
        digest.update(b"{%d" % len(data))
        for key in sorted(data, key=str):
            digest.update(str(key).encode() + b"\0")
            _stream(data[key], digest, describer, f"{path}[{key!r}]")
    elif isinstance(data, np.ndarray) and data.dtype == object:
        digest.update(b"o" + str(data.shape).encode())
        _stream(data.ravel().tolist(), digest, describer, path)
    elif isinstance(data, (list, tuple)):
        digest.update(b"[%d" % len(data))
        for i, item in enumerate(data):
            if isinstance(item, (_PLAIN, np.generic)):
                digest.update(repr(item).encode() + b"\0")
            else:
                _stream(item, digest, describer, f"{path}[{i}]")
    else:
        described = describer(data, path)
        if isinstance(data, Dataset) and not isinstance(data, IterableDataset):
            # a map-style Dataset has a length, which torch's base class leaves out
            n = len(data)  # type: ignore[arg-type]

            rows = np.unique(np.linspace(0, n - 1, min(n, _SAMPLE_ROWS)).round().astype(np.int64))
            # the second reading is described apart: its refusals would count twice
            describers = iter([describer, Describer()])

            def rows_described(sample: Iterable[Any]) -> list[Json]:

                describe = next(describers)
                return [describe(row, f"{path}[{i}]") for i, row in zip(rows, sample)]

            sampled = repeatable_digest(data, lambda: [data[int(i)] for i in rows], rows_described)
            described = [described, _UNREPEATABLE if sampled is None else sampled]
        digest.update(json.dumps(described, sort_keys=True).encode())
