"""FSDP2: what changes when accelerate shards the net's module.

Under accelerate's FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``)
torch's ``fully_shard`` turns the module into a sharded one in place: each
parameter becomes a ``DTensor`` holding this rank's shard, and the optimizer
is prepared together with the module so that it holds the shards. For the
net this means:

- One module with parameters is sharded. accelerate's FSDP2 prepares one
  model per call, so a second module with parameters, or a criterion with
  parameters, would train unsharded and without gradient sync: refused at
  ``initialize`` (``check_shardable``).
- There is no wrapper to take off: unwrapping leaves the module sharded, and
  rewrapping never shards again (``wrapping``).
- Files hold full tensors under the module's own keys, as a plain skorch net
  writes them. Gathering them is a collective of every rank
  (``full_states``), done before the main process writes. Loading is not:
  every rank reads the file and cuts its own shard out of it
  (``shard_like``, ``shard_optimizer_state``), so that a load that fails on
  one rank cannot leave another waiting inside a collective.
- Mixed precision is FSDP's ``MixedPrecisionPolicy``, which accelerate builds
  from its ``mixed_precision``; no autocast is added around the forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from typing import TypeGuard

    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

__all__ = [
    "check_on_shards",
    "check_shardable",
    "full_states",
    "is_sharded",
    "optimizer_state_by_position",
    "replicated",
    "reshard",
    "shard_like",
    "shard_optimizer_state",
    "sharded",
    "sharded_module_name",
]


def sharded(accelerator: Accelerator) -> bool:
    """Whether ``accelerator`` shards modules with FSDP2."""
    return bool(getattr(accelerator, "is_fsdp2", False))


def _dtensor_type() -> type[DTensor] | tuple[()]:
    try:
        from torch.distributed.tensor import DTensor  # pylint: disable=import-outside-toplevel
    except ImportError:  # a torch without DTensor shards nothing
        return ()
    return DTensor


def is_sharded(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor (a shard of a tensor spread over ranks)."""
    kind = _dtensor_type()
    return bool(kind) and isinstance(tensor, kind)


def replicated(
    named_params: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, parameter)`` pairs that every rank holds whole."""
    return [(name, param) for name, param in named_params if not is_sharded(param)]


def _parameter_count(module: torch.nn.Module) -> int:
    return sum(1 for _ in module.parameters())


def sharded_module_name(modules: Iterable[tuple[str, object]]) -> str | None:
    """Of ``modules`` (``(name, raw module)`` in the net's order), the name of
    the one FSDP2 shards: the first with parameters; None if none has."""
    for name, module in modules:
        if isinstance(module, torch.nn.Module) and _parameter_count(module):
            return name
    return None


def check_shardable(modules: list[tuple[str, object]], criteria: list[tuple[str, object]]) -> None:
    """Raise ``ValueError``, naming it, for every module or criterion with
    parameters besides the one FSDP2 shards (``(name, raw object)`` pairs)."""
    chosen = sharded_module_name(modules)
    for kind, named in (("module", modules), ("criterion", criteria)):
        for name, obj in named:
            if name == chosen or not isinstance(obj, torch.nn.Module):
                continue
            count = _parameter_count(obj)
            if count:
                raise ValueError(
                    f"Under FSDP2 the {kind} {name}_ ({type(obj).__name__}) has {count} "
                    f"parameter tensor(s), but accelerate's FSDP2 shards one module, "
                    f"{chosen}_, prepared together with its optimizer: {name}_ would train "
                    "unsharded and without gradient sync. Move its parameters into "
                    f"{chosen}_ (one torch.nn.Module holding both), or train with DDP "
                    "(an Accelerator without an FSDP plugin)."
                )


def check_on_shards(
    optimizer: torch.optim.Optimizer, module: torch.nn.Module, optimizer_attr: str, module_attr: str
) -> None:
    """Raise ``ValueError`` unless every parameter ``optimizer`` holds is one
    of the sharded ``module``'s shards."""
    reshard(module)
    shards = {id(param) for param in module.parameters()}
    strays = sum(
        1 for group in optimizer.param_groups for p in group["params"] if id(p) not in shards
    )
    if strays:
        raise ValueError(
            f"Under FSDP2 the optimizer {optimizer_attr} holds {strays} tensor(s) that are "
            f"not shards of {module_attr}, which is sharded already: they would never "
            "train. Build the optimizer on the net's parameters (net.initialize_optimizer(), "
            "or set_params(optimizer__...), which use get_all_learnable_params)."
        )


def full_states(
    module_attr: str,
    module: torch.nn.Module,
    optimizers: Mapping[str, object],
    attrs: Iterable[str],
    everywhere: bool = False,
) -> dict[str, dict[str, Any]]:
    """``{attr: full state}`` for those of ``attrs`` that are the sharded
    ``module`` (at ``module_attr``) or one of ``optimizers`` (``{attr:
    optimizer}``): the module's state dict under its own keys, optimizer
    states numbered as ``optimizer.state_dict()`` numbers them, full tensors
    on the CPU. A collective: every rank calls it. The main process gets the
    states, the others empty ones, unless ``everywhere``
    (``save_on_each_node``), where every rank gets them.
    """
    # pylint: disable=import-outside-toplevel
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
    reshard(module)
    out = {}
    for attr in attrs:
        optimizer = optimizers.get(attr)
        state: dict[str, Any]
        if attr == module_attr:
            state = get_model_state_dict(module, options=options)
        elif isinstance(optimizer, torch.optim.Optimizer):
            state = get_optimizer_state_dict(module, optimizer, options=options)
            state = optimizer_state_by_position(state) if state else state
        else:
            continue
        out[attr] = _on_cpu(state) if everywhere else state
    return out


def reshard(module: torch.nn.Module) -> None:
    """Put every sharded unit of ``module`` back to its shards.

    After a forward pass FSDP2 leaves the root unit's gathered parameters in
    place (``reshard_after_forward`` resolves to False for the root), and
    ``named_parameters`` then names those, not the shards the optimizer
    holds; torch's optimizer state dict matches the two by identity.
    """
    from torch.distributed.fsdp import FSDPModule  # pylint: disable=import-outside-toplevel

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, Mapping):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_on_cpu(item) for item in value]
    return value


def optimizer_state_by_position(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names (torch's
    ``get_optimizer_state_dict``) numbered as ``optimizer.state_dict()``
    numbers it: by position over the parameter groups, so that a plain
    optimizer over the same parameters loads it."""
    ids: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        numbered = dict(group)
        numbered["params"] = [ids.setdefault(fqn, len(ids)) for fqn in group["params"]]
        groups.append(numbered)
    by_id = {ids[fqn]: value for fqn, value in state["state"].items() if fqn in ids}
    return {"state": by_id, "param_groups": groups}


def _shard_of(full: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's shard of ``full``, laid out as the DTensor ``like``; cut
    locally, without any collective (every rank holds ``full``)."""
    from torch.distributed.tensor import distribute_tensor  # pylint: disable=import-outside-toplevel

    full = full.detach().to(device=like.device, dtype=like.dtype)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def shard_like(expected: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (full tensors) with every entry that is a DTensor in
    ``expected`` (a sharded module's state dict) cut to this rank's shard."""
    return {
        key: (_shard_of(value, expected[key]) if is_sharded(expected.get(key)) else value)
        for key, value in state.items()
    }


def shard_optimizer_state(
    optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> Mapping[str, Any]:
    """``state`` (``optimizer.state_dict()``'s numbering, full tensors) with
    the tensors of every sharded parameter cut to this rank's shard, matched
    by position as ``optimizer.load_state_dict`` matches them."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(is_sharded(p) for p in params):
        return state
    saved = [i for group in state["param_groups"] for i in group["params"]]
    by_id = dict(zip(saved, params))
    out: dict[Any, Any] = {}
    for key, values in state["state"].items():
        param = by_id.get(key)
        if param is None or not is_sharded(param) or not isinstance(values, Mapping):
            out[key] = values
            continue
        out[key] = {
            name: (
                _shard_of(value, param)
                if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape)
                else value
            )
            for name, value in values.items()
        }
    return {"state": out, "param_groups": state["param_groups"]}
