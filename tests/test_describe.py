"""Values described by their content, one kind at a time: what a run
identity hashes (``accel_mixin.resume.describe``)."""

import enum
import functools
import hashlib
import inspect

import numpy as np
import pytest
import torch

from accel_mixin.resume import describe
from accel_mixin.resume.describe import Describer, fingerprint, init_defaults


def described(value):
    """``value`` described, and what the describer refused on the way."""
    describer = Describer()
    return describer(value, "value"), describer.refusals


# --- limits -------------------------------------------------------------------


def test_data_larger_than_a_chunk_is_hashed_by_the_digests_of_its_chunks(monkeypatch):
    monkeypatch.setattr(describe, "_CHUNK", 4)
    chunks = [b"abcd", b"efgh", b"ij"]
    expected = hashlib.sha256(
        b"chunks" + b"".join(hashlib.sha256(chunk).digest() for chunk in chunks)
    ).hexdigest()
    assert described(b"abcdefghij") == ({"bytes": expected}, [])
    assert described(bytearray(b"abcd")) == ({"bytes": hashlib.sha256(b"abcd").hexdigest()}, [])
    assert described(b"abcdefghij")[0] != described(b"abcdefghik")[0]


def test_more_values_than_max_values_are_refused(monkeypatch):
    monkeypatch.setattr(describe, "MAX_VALUES", 4)
    out, refusals = described([10, 11, 12, 13, 14])
    reason = "too large to describe (over 4 values)"
    assert out == [10, 11, 12, {"undescribable": reason}, {"undescribable": reason}]
    assert refusals == [("value[3]", reason), ("value[4]", reason)]


def test_values_nested_deeper_than_max_depth_are_refused():
    nested = "bottom"
    for _ in range(describe.MAX_DEPTH + 1):
        nested = [nested]
    out, refusals = described(nested)
    assert refusals == [("value" + "[0]" * 9, f"nested more than {describe.MAX_DEPTH} levels deep")]
    for _ in range(describe.MAX_DEPTH + 1):
        (out,) = out
    assert out == {"undescribable": f"nested more than {describe.MAX_DEPTH} levels deep"}


# --- values described by name --------------------------------------------------


class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 2


def test_enums_dtypes_devices_and_classes_are_described_by_name():
    assert described(Color.RED) == ("test_describe.Color.RED", [])
    assert described(Level.HIGH) == ("test_describe.Level.HIGH", [])  # not the int 2
    assert described(torch.float16)[0] == "torch.float16"
    assert described(torch.device("cpu"))[0] == "cpu"
    assert described(np.dtype("int32"))[0] == "int32"
    assert described(torch.nn.Linear)[0] == "torch.nn.modules.linear.Linear"


def test_builtins_are_described_by_their_qualified_name():
    assert described(len) == ("builtins.len", [])
    assert described([len, max])[0] == ["builtins.len", "builtins.max"]


# --- containers -----------------------------------------------------------------


def test_a_reference_back_up_the_path_is_a_cycle_and_a_shared_one_is_not():
    loop = [1]
    loop.append(loop)
    assert described(loop) == ([1, {"cycle": "builtins.list"}], [])
    shared = [2]
    assert described([shared, shared]) == ([[2], [2]], [])


def test_sets_are_described_whatever_their_order():
    assert described({3, 1, 2}) == ({"set": [1, 2, 3]}, [])
    assert described(frozenset({"b", "a"}))[0] == {"set": ["a", "b"]}
    assert described({1, 2})[0] != described({1, 3})[0]


# --- functions ---------------------------------------------------------------------


def scaled(x, factor):
    return x * factor


def shifter(offset):
    def shift(x, scale=2.0, *, clip=None):
        return x * scale + offset

    return shift


def described_before_its_cell_is_filled():
    def late_reader():
        return late

    out = described(late_reader)
    late = 1
    return out


def test_a_partial_is_described_by_its_function_arguments_and_keywords():
    out, _ = described(functools.partial(scaled, 3, factor=2))
    assert out == {"partial": "test_describe.scaled", "args": [3], "keywords": {"factor": 2}}
    assert (
        described(functools.partial(scaled, factor=3))[0]
        != described(functools.partial(scaled, factor=2))[0]
    )


def test_a_function_is_described_by_its_defaults_keyword_defaults_and_closure():
    out, refusals = described(shifter(1))
    assert out == {
        "function": "test_describe.shifter.<locals>.shift",
        "defaults": ["2.0"],
        "kwdefaults": {"clip": None},
        "closure": [1],
    }
    assert not refusals
    assert described(shifter(2))[0]["closure"] == [2]
    assert described(scaled)[0] == "test_describe.scaled"  # nothing but its name


def test_a_closure_cell_not_yet_filled_is_described_as_none():
    out, refusals = described_before_its_cell_is_filled()
    assert out == {
        "function": "test_describe.described_before_its_cell_is_filled.<locals>.late_reader",
        "closure": [None],
    }
    assert not refusals


# --- objects -------------------------------------------------------------------------


class OldStyleParams:
    """An estimator whose get_params takes no ``deep``."""

    def __init__(self, alpha=1.0, beta=None):
        self.alpha, self.beta = alpha, beta

    def get_params(self):
        return {"alpha": self.alpha, "beta": self.beta, "_cache": object()}


class Point:
    __slots__ = ("x", "y")

    def __init__(self, x):
        self.x = x  # y is never set


class Opaque:
    __slots__ = ()


def test_an_estimator_is_described_by_the_params_that_differ_from_its_defaults():
    out, refusals = described(OldStyleParams(alpha=2.0))
    # beta is its default, _cache private: neither is described
    assert out == {"class": "test_describe.OldStyleParams", "params": {"alpha": "2.0"}}
    assert not refusals


def test_an_object_with_slots_is_described_by_them():
    out, _ = described(Point(3))
    assert out == {"class": "test_describe.Point", "attributes": {"x": 3, "y": None}}


def test_an_object_with_neither_params_attributes_nor_a_clean_repr_is_refused():
    out, refusals = described([Opaque()])
    reason = (
        "a test_describe.Opaque, which has neither get_params, attributes nor a repr "
        "without its address to describe it by"
    )
    assert out == [{"undescribable": reason}]
    assert refusals == [("value[0]", reason)]


class Table:
    """pandas' interface: ``to_numpy``, an ``index``, and ``columns`` for a frame."""

    def __init__(self, values, index, columns=None):
        self._values, self.index = values, index
        if columns is not None:
            self.columns = columns

    def to_numpy(self):
        return self._values


def test_a_frame_and_a_series_are_described_by_values_columns_and_index():
    values = np.arange(4.0).reshape(2, 2)
    frame, _ = described(Table(values, index=[10, 20], columns=["a", "b"]))
    assert frame == {
        "class": "test_describe.Table",
        "values": described(values)[0],
        "columns": ["a", "b"],
        "index": described(np.array([10, 20]))[0],
    }
    series, _ = described(Table(values[0], index=[10, 20]))
    assert "columns" not in series and series["values"] == described(values[0])[0]
    other_index, _ = described(Table(values, index=[10, 21], columns=["a", "b"]))
    assert other_index != frame


def test_a_scipy_sparse_matrix_is_described_by_its_csr_arrays():
    sparse = pytest.importorskip("scipy.sparse")
    dense = np.array([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
    csr, refusals = described(sparse.csr_matrix(dense))
    assert csr["shape"] == [2, 3] and not refusals
    data, indices, indptr = csr["csr"]
    assert data == described(np.array([1.0, 2.0, 3.0]))[0]
    assert indptr["shape"] == [3] and indices["shape"] == [3]
    assert described(sparse.coo_matrix(dense))[0]["csr"] == csr["csr"]  # the same values
    dense[1, 2] = 4.0
    assert described(sparse.csr_matrix(dense))[0]["csr"] != csr["csr"]


# --- arrays and tensors ----------------------------------------------------------------


def test_an_object_array_is_described_item_by_item():
    out, refusals = described(np.array([1, "a", None], dtype=object))
    assert out == {"array": "object", "shape": [3], "items": [1, "a", None]}
    assert not refusals


def test_a_structured_array_names_its_fields():
    array = np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")])
    out, _ = described(array)
    assert out["array"] == "[('a', '<i4'), ('b', '<f8')]" and out["shape"] == [2]
    assert out["sha256"] == hashlib.sha256(array.tobytes()).hexdigest()
    renamed = array.view([("c", "<i4"), ("b", "<f8")])  # the same bytes
    assert described(renamed)[0]["array"] == "[('c', '<i4'), ('b', '<f8')]"


def test_a_sparse_tensor_is_described_as_its_dense_values():
    dense = torch.tensor([[0.0, 1.5], [2.0, 0.0]])
    assert described(dense.to_sparse()) == described(dense)


def test_a_tensor_that_cannot_be_read_is_refused():
    out, refusals = described(torch.empty(3, device="meta"))
    assert out["undescribable"].startswith("a tensor that cannot be read (")
    assert refusals == [("value", out["undescribable"])]


# --- init defaults and fingerprints -------------------------------------------------------


class Base:
    def __init__(self, a=1, b=2):
        self.a, self.b = a, b


class Extension(Base):
    # as an extension type's __init__ may be: a builtin without a signature
    __init__ = next


def test_init_defaults_skip_an_init_without_a_signature():
    with pytest.raises(ValueError):
        inspect.signature(Extension.__dict__["__init__"])
    assert init_defaults(Extension) == {"a": 1, "b": 2}


def test_a_fingerprint_of_an_object_array_or_a_list_of_arrays_changes_with_any_value():
    items = np.empty(2, dtype=object)
    items[:] = [np.zeros(3), "label"]
    base = fingerprint(items)
    assert base["length"] == 2
    assert fingerprint(items.copy()) == base
    changed = items.copy()
    changed[0] = np.array([0.0, 0.0, 1.0])
    assert fingerprint(changed)["sha256"] != base["sha256"]
    assert fingerprint(list(items))["sha256"] != base["sha256"]  # a list is not an array
    arrays = [np.zeros(2), np.ones(2)]
    assert fingerprint(arrays) == fingerprint([a.copy() for a in arrays])
    assert fingerprint(arrays)["sha256"] != fingerprint([np.zeros(2), np.zeros(2)])["sha256"]
