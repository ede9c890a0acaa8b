"""Torch-version differences (and the private FSDP2/DDP state read) for grad-sync, in one place."""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel


def fsdp_param_groups(module: FSDPModule) -> list[Any]:
    """The FSDP2 parameter groups of one module (none for a module without parameters)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13: a list
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # torch 2.6 - 2.12: one group or None
    return [] if group is None else [group]


def requires_gradient_sync(module: FSDPModule) -> bool:
    """What ``set_requires_gradient_sync`` last set on ``module`` (``True`` by default)."""
    return all(bool(group.reduce_grads) for group in fsdp_param_groups(module))


def ddp_forward_has_run(ddp: DistributedDataParallel) -> bool:
    """Whether DDP has run a forward (its lazy initialisation happens in the first one)."""
    return bool(getattr(ddp, "_lazy_init_ran", True))
