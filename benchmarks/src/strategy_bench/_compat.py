"""The private torch APIs that ``strategy-bench`` needs, in one place.

torch ships a fake process-group backend (every collective returns at once, no peer) and
fake tensors (shapes, dtypes and devices without storage) under private module paths; both
are what torch's own estimators use (``torch.distributed._tools``, torchtitan's memory
estimator). Should they move, only this module changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = [
    "FakeTensorMode",
    "all_gather_single",
    "collective_group",
    "fake_process_group",
    "fsdp_gather_outputs",
    "reduce_scatter_single",
    "storage_key",
    "unset_fake_temporarily",
]


def _renamed(name: str, before: str) -> Callable[..., object]:
    """``torch.distributed``'s function ``name``, or ``before`` on a torch that lacks it.

    torch 2.13 deprecates ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` for
    ``all_gather_single`` and ``reduce_scatter_single`` (same arguments: output, input);
    torch 2.11, the lent GPU machines', has only the former.
    """
    found: Callable[..., object] = getattr(dist, name, None) or getattr(dist, before)
    return found


all_gather_single = _renamed("all_gather_single", "all_gather_into_tensor")
"""An all-gather into one output tensor: ``(output, input, group=...)``."""

reduce_scatter_single = _renamed("reduce_scatter_single", "reduce_scatter_tensor")
"""A reduce-scatter into one output tensor: ``(output, input, group=...)``."""


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """Be rank 0 of a fake default process group of ``world_size`` ranks while the block runs.

    Collectives on it complete immediately without moving data, so a model can be wrapped
    (and stepped on fake tensors) as one rank of a world that does not exist.

    Raises:
        RuntimeError: If a process group is already initialized in this process.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "strategy-bench estimate runs under a fake process group of its own; a process "
            "group is already initialized in this process (run the estimate in a fresh process)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def storage_key(tensor: torch.Tensor | torch.UntypedStorage) -> int:
    """An identity for a storage (or a tensor's), valid while it lives (real, meta or fake)."""
    storage = tensor.untyped_storage() if isinstance(tensor, torch.Tensor) else tensor
    return int(StorageWeakRef(storage).cdata)  # type: ignore[no-untyped-call]


def fsdp_gather_outputs(model: nn.Module) -> list[torch.Tensor]:
    """The tensors FSDP2 all-gathers each unit's parameters into, for every unit of ``model``.

    Their storages are resized in place (to the unsharded size when a unit is gathered, to 0
    when it is resharded), so a memory tracker reads their current size rather than seeing
    an allocation. torch 2.13 keeps a list of parameter groups per unit; earlier versions
    one group (``_fsdp_param_group``).
    """
    outputs: list[torch.Tensor] = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [] if single is None else [single]
        for group in groups:
            for param in group.fsdp_params:
                outputs.extend(param.all_gather_outputs)
    return outputs


def collective_group(func: Any, args: tuple[object, ...]) -> dist.ProcessGroup | None:
    """The process group a c10d op's arguments name, or ``None``.

    The eager c10d ops (what DDP's reducer and FSDP2 issue) carry the group as a boxed
    TorchScript object; the functional ones by name, in their ``group_name`` argument (found
    by the op's schema: a reduce op's name is a string too).
    """
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
            return dist.ProcessGroup.unbox(arg)
    resolve: Any = getattr(dist.distributed_c10d, "_resolve_process_group", None)
    schema = getattr(func, "_schema", None)
    names = [argument.name for argument in schema.arguments] if schema is not None else []
    if resolve is None or "group_name" not in names:
        return None
    index = names.index("group_name")
    if index >= len(args) or not isinstance(args[index], str):
        return None
    try:
        group: dist.ProcessGroup = resolve(args[index])
    except (KeyError, RuntimeError, ValueError):
        return None
    return group
