"""The ranks are replicas: they train on the same data and hold the same
parameters.

DDP keeps the ranks' parameters identical only as long as every rank runs
the same steps on its shard of the same data. A rank that loaded other data,
a callback that changes one rank's weights, a custom ``train_step`` that
bypasses the accelerator or a nondeterministic operation breaks that without
a word: the ranks then train different models, and the run ends with the one
on the main process. Two cheap checks turn that into an error on every rank:

- ``check_same_data`` compares the length of the training data once when
  training begins. Ranks with different lengths would run different numbers
  of steps and wait for each other in DDP's all-reduce until the process
  group times out.
- ``check_replicas`` compares a fingerprint of every parameter after an
  epoch. The fingerprint of a tensor is the sum of its elements' bit patterns
  as integers, modulo 2**32: exact, independent of the order of summation
  (so of threads and kernels), and changed by any change of a single element. Buffers are
  left out: DDP broadcasts them from rank 0 anyway.

Both are one small collective that every rank joins; every rank receives the
same values and so raises the same error.
"""

import torch
from accelerate.utils import gather
from skorch.dataset import get_len

from accel_mixin.errors import DistributedError
from accel_mixin.training.net_objects import net_modules

__all__ = [
    "check_net_replicas",
    "check_replicas",
    "check_same_data",
    "check_same_steps",
    "fingerprints",
    "named_parameters",
]

# integer views of the same width as each floating point type
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _length(data):
    """The number of samples in ``data``, or -1 where it has none (iterables)."""
    if data is None:
        return -1
    try:
        return int(get_len(data))
    except (TypeError, ValueError):
        return -1


def check_same_data(accelerator, X, y=None):
    """Raise on every rank unless all ranks fit on data of the same length.

    Parameters
    ----------
    accelerator : accelerate.Accelerator
      With several processes; one process has nothing to compare.

    X, y
      What the rank passed to ``fit``.

    Raises
    ------
    DistributedError
      On every rank, naming each rank's number of samples.

    """
    mine = torch.tensor([[_length(X), _length(y)]], dtype=torch.int64, device=accelerator.device)
    everyone = gather(mine).cpu().tolist()
    if all(lengths == everyone[0] for lengths in everyone):
        return
    described = ", ".join(
        f"rank {rank}: {x} samples" + (f" and {n} targets" if n != x and n >= 0 else "")
        for rank, (x, n) in enumerate(everyone)
    )
    raise DistributedError(
        f"The ranks fit on data of different lengths ({described}). Every process must "
        "pass the whole data set to fit, the same on every rank: accelerate shards it "
        "between the processes. Load the same X and y on every rank."
    )


def check_same_steps(accelerator, iterator):
    """Raise on every rank unless all ranks take the same number of training
    steps this epoch.

    With ``even_batches=False`` the last batches are not padded, and ranks can
    get different numbers of them; DDP's all-reduce then waits forever on the
    rank with more. A no-op with even batches, which make the numbers equal,
    and for data whose number of batches is unknown (iterables).

    Raises
    ------
    DistributedError
      On every rank, naming each rank's number of batches.

    """
    if accelerator.even_batches:
        return
    try:
        mine = len(iterator)
    except TypeError:
        return
    everyone = gather(torch.tensor([mine], device=accelerator.device)).cpu().tolist()
    if len(set(everyone)) > 1:
        counts = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(everyone))
        raise DistributedError(
            f"With even_batches=False the ranks have different numbers of training batches "
            f"({counts}), and DDP needs every rank to take the same number of steps. Use "
            "DataLoaderConfiguration(even_batches=True), accelerate's default, or a training "
            "set whose size is a multiple of the batch size times the number of processes."
        )


def named_parameters(modules):
    """``(name, parameter)`` of every ``(prefix, module)``, each parameter
    once, named ``prefix.name`` (just ``name`` where the prefix is empty)."""
    seen = set()
    for prefix, module in modules:
        for name, param in module.named_parameters():
            if param not in seen:
                seen.add(param)
                yield (f"{prefix}.{name}" if prefix else name), param


def fingerprints(params):
    """One integer per tensor: the sum of its bit patterns, modulo 2**32.

    The tensor's bytes are read as 32-bit integers and summed with
    wraparound: modular sums do not depend on the order of summation, so
    equal tensors give equal fingerprints on any number of threads, and a
    change of any single element changes the sum. (Summed in int32 this is
    seven times faster than in int64 on CPUs, where int64 sums vectorize
    poorly.)
    """
    values = []
    for param in params:
        tensor = param.detach()
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        values.append(_words(tensor.reshape(-1)).sum(dtype=torch.int32))
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack(values).to(torch.int64)


def _words(flat):
    """A flat tensor's bytes as 32-bit integers, or its elements as integers
    where its bytes cannot be viewed so (an odd number of half-precision
    elements, an unaligned offset)."""
    if flat.dtype.is_floating_point or flat.dtype == torch.bool:
        try:
            return flat.view(torch.uint8).view(torch.int32)
        except RuntimeError:
            return flat.view(_BITS[flat.element_size()])
    return flat


def check_replicas(accelerator, named_params, when):
    """Raise on every rank unless every parameter is the same on all ranks.

    Parameters
    ----------
    accelerator : accelerate.Accelerator
      With several processes.

    named_params : list of (str, torch.Tensor)
      The parameters to compare, in the same order on every rank.

    when : str
      When the check runs, for the message: ``'after epoch 3'``,
      ``'when training begins'``.

    Raises
    ------
    DistributedError
      On every rank, naming the first parameter that differs and the ranks
      whose copy differs from rank 0's.

    """
    names = [name for name, _ in named_params]
    mine = fingerprints([param for _, param in named_params])
    # the count first: ranks with other architectures must not compare by position
    mine = torch.cat([torch.tensor([len(names)], dtype=torch.int64), mine.cpu()])
    everyone = gather(mine.to(accelerator.device)[None]).cpu()
    if (everyone == everyone[0]).all():
        return
    if (everyone[:, 0] != everyone[0, 0]).any():
        counts = ", ".join(f"rank {r}: {int(n)}" for r, n in enumerate(everyone[:, 0]))
        raise DistributedError(
            f"Replica check {when}: the ranks hold different numbers of "
            f"parameters ({counts}); every rank must build the same model."
        )
    differs = (everyone[:, 1:] != everyone[0, 1:]).any(dim=0)
    first = int(differs.nonzero()[0])
    ranks = [r for r in range(1, len(everyone)) if everyone[r, 1 + first] != everyone[0, 1 + first]]
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


def check_net_replicas(net, when):
    """``check_replicas`` on every parameter of the net's modules and criteria."""
    modules = ((name + "_", module) for name, module in net_modules(net))
    check_replicas(net.accelerator, list(named_parameters(modules)), when)
