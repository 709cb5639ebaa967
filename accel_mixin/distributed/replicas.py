"""The ranks are replicas: they train on the same data and hold the same
parameters.

DDP keeps the ranks' parameters identical only while every rank runs the
same steps on its shard of the same data; other data on one rank, a callback
that changes one rank's weights or a ``train_step`` that bypasses the
accelerator break that silently. Small collectives turn it into the same
error on every rank: the length of the data and the values of 64 of its
rows when training begins, the number of batches without even batches (DDP
would hang), and after an epoch a fingerprint of every parameter (the sum
of its bit patterns modulo 2**32: exact, order-free, changed by any
element; buffers are DDP's, from rank 0). Rows are read with every random
generator at a fixed seed (``distributed.sample_rows``): a Dataset that
augments at random is the same data on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from skorch.dataset import get_len
from skorch.utils import multi_indexing

from accel_mixin.distributed.sample_rows import repeatable_digest
from accel_mixin.errors import DistributedError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from accel_mixin.distributed.object_gather import Gather

__all__ = [
    "check_replicas",
    "check_same_data",
    "check_same_steps",
    "compare_replicas",
    "fingerprints",
    "named_parameters",
    "replica_fingerprints",
]

# integer views of the same width as each floating point type
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _length(data: Any) -> int:
    """The number of samples in ``data``, or -1 where it has none (iterables)."""
    try:
        return -1 if data is None else int(get_len(data))
    except (TypeError, ValueError):
        return -1


# the rows whose contents the ranks compare, evenly spread
_SAMPLED_ROWS = 64


def _feed(digest: hashlib.blake2b, data: Any) -> bool:
    """Hash ``data`` (arrays, tensors, mappings and sequences of them); False
    where it holds something else, whose bytes could differ between ranks."""
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().numpy()
    if isinstance(data, np.ndarray):
        if data.dtype == object:
            return False
        digest.update(np.ascontiguousarray(data).tobytes())
        return True
    if isinstance(data, Mapping):
        return all(_feed(digest, data[key]) for key in sorted(data, key=str))
    if isinstance(data, (list, tuple)):
        return all(_feed(digest, item) for item in data)
    return data is None


def _hashed(sampled: Iterable[Any]) -> int:
    digest = hashlib.blake2b(digest_size=8)
    if not all(_feed(digest, data) for data in sampled):
        return -1
    return int.from_bytes(digest.digest(), "little") >> 1


def _sample_digest(X: Any, y: Any, n: int) -> int:
    """A 63-bit digest of the same rows of ``X`` and ``y`` on every rank, or
    -1 where they cannot be hashed alike: rows are read as
    ``sample_rows.repeatable_digest`` reads them, so a Dataset that augments
    at random, with each rank's own seeds, gives the same digest on every
    rank, and one whose rows differ at every reading gives -1."""
    if n <= 0:
        return -1
    rows = np.unique(np.linspace(0, n - 1, min(n, _SAMPLED_ROWS)).astype(np.int64))

    def read() -> list[Any]:
        return [None if data is None else multi_indexing(data, rows) for data in (X, y)]

    try:
        digest = repeatable_digest((X, y), read, _hashed)
    except Exception:  # pylint: disable=broad-except
        return -1  # a dataset type skorch does not index: only lengths are compared
    return -1 if digest is None else digest


def check_same_data(X: Any, y: Any, gather: Gather) -> None:
    """Raise ``DistributedError`` on every rank, naming each rank's number of
    samples, unless all ranks fit on data of the same length, and unless the
    same 64 rows hold the same values on every rank. One ``gather``."""
    n = _length(X)
    everyone = gather("same data", [n, _length(y), _sample_digest(X, y, n)])
    if any(lengths[:2] != everyone[0][:2] for lengths in everyone):
        described = ", ".join(
            f"rank {rank}: {x} samples" + (f" and {m} targets" if m != x and m >= 0 else "")
            for rank, (x, m, _) in enumerate(everyone)
        )
        raise DistributedError(
            f"The ranks fit on data of different lengths ({described}). Every process must "
            "pass the whole data set to fit, the same on every rank: accelerate shards it "
            "between the processes. Load the same X and y on every rank."
        )
    digests = [digest for _, _, digest in everyone]
    if -1 not in digests and len(set(digests)) > 1:
        differ = ", ".join(str(rank) for rank, d in enumerate(digests) if d != digests[0])
        raise DistributedError(
            f"The ranks fit on different data: the same rows of X or y hold other values on "
            f"rank(s) {differ} than on rank 0. Every process must pass the same X and y: "
            "accelerate shards them between the processes. Preprocessing fitted on each rank "
            "can differ between ranks (a Hugging Face tokenizer's training is not "
            "deterministic): fit it once and load the same fitted one on every rank."
        )


def check_same_steps(accelerator: Accelerator, iterator: Iterable[Any], gather: Gather) -> None:
    """Raise ``DistributedError`` on every rank unless all take the same number
    of training batches: without even batches DDP would wait forever on the
    rank with more. A no-op with even batches and for iterables; else one
    ``gather``."""
    if accelerator.even_batches:
        return
    try:
        # an iterable without a length raises the TypeError caught below
        mine = len(iterator)  # type: ignore[arg-type]

    except TypeError:
        return
    everyone = [n for (n,) in gather("same steps", [mine])]
    if len(set(everyone)) > 1:
        counts = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(everyone))
        raise DistributedError(
            f"With even_batches=False the ranks have different numbers of training batches "
            f"({counts}), and DDP needs every rank to take the same number of steps. Use "
            "DataLoaderConfiguration(even_batches=True), accelerate's default, or a training "
            "set whose size is a multiple of the batch size times the number of processes."
        )


def named_parameters(
    modules: Iterable[tuple[str, torch.nn.Module]],
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(prefix.name, parameter)`` of every ``(prefix, module)``, each parameter once."""
    seen: set[torch.nn.Parameter] = set()
    for prefix, module in modules:
        for name, param in module.named_parameters():
            if param not in seen:
                seen.add(param)
                yield (f"{prefix}.{name}" if prefix else name), param


def fingerprints(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """One integer per tensor: its bytes as 32-bit integers summed with
    wraparound (in int32: int64 sums vectorize poorly on CPUs)."""
    values = []
    for param in params:
        tensor = param.detach()
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        values.append(_words(tensor.reshape(-1)).sum(dtype=torch.int32))
    return torch.stack(values).to(torch.int64) if values else torch.zeros(0, dtype=torch.int64)


def _words(flat: torch.Tensor) -> torch.Tensor:
    """A flat tensor's bytes as 32-bit integers, or its elements as integers where
    its bytes cannot be viewed so (an odd number of halves, an unaligned offset)."""
    if flat.dtype.is_floating_point or flat.dtype == torch.bool:
        try:
            return flat.view(torch.uint8).view(torch.int32)
        except RuntimeError:
            return flat.view(_BITS[flat.element_size()])
    return flat


def replica_fingerprints(named_params: Sequence[tuple[str, torch.Tensor]]) -> list[int]:
    """This rank's part of a replica check: one fingerprint per parameter."""
    return cast("list[int]", fingerprints([param for _, param in named_params]).tolist())


def compare_replicas(everyone: Sequence[Sequence[int]], names: Sequence[str], when: str) -> None:
    """Raise ``DistributedError`` naming the first parameter that differs and
    when (``'after epoch 3'``), unless every rank's fingerprints (``everyone``,
    in rank order; ``names`` are this rank's parameters) are the same."""
    counts = [len(mine) for mine in everyone]
    if any(count != counts[0] for count in counts):
        # ranks with other architectures must not compare by position
        listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise DistributedError(
            f"Replica check {when}: the ranks hold different numbers of "
            f"parameters ({listed}); every rank must build the same model."
        )
    table = torch.tensor(everyone, dtype=torch.int64).reshape(len(everyone), counts[0])
    if (table == table[0]).all():
        return
    differs = (table != table[0]).any(dim=0)
    first = int(differs.nonzero()[0])
    ranks = [r for r in range(1, len(table)) if table[r, first] != table[0, first]]
    raise DistributedError(
        f"Replica check {when}: parameter '{names[first]}' differs between "
        f"ranks (rank(s) {ranks} differ from rank 0; {int(differs.sum())} of {len(names)} "
        "parameters differ), so the processes no longer train one model. Something changed "
        "the parameters of some ranks only: a callback (LoadInitState ignores a load that "
        "failed on some ranks), a custom train_step that bypasses the accelerator, a module "
        "without trainable parameters initialized differently on each rank (seed it), or "
        "data that differ between ranks. Set replica_check_every=0 to train without this "
        "check."
    )


def check_replicas(
    named_params: Sequence[tuple[str, torch.Tensor]], when: str, gather: Gather
) -> None:
    """Raise ``DistributedError`` on every rank, naming the first parameter that
    differs and when (``'after epoch 3'``), unless all ranks hold the same.
    One ``gather``: lists of other lengths gather whole, so ranks with other
    models are named with their parameter counts."""
    everyone = gather("replica check", replica_fingerprints(named_params))
    compare_replicas(everyone, [name for name, _ in named_params], when)
