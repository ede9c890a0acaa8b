"""The wraps being compared: ours (ddp-wrap, fsdp-wrap) and raw torch on the same module."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from distributed_strategy import (
    select_shard_targets,
    torch_dtype,
    wrap_module_ddp,
    wrap_module_fsdp,
)
from strategy_bench._knobs import wrap_knobs

STRATEGIES = ("ddp", "fsdp")


def ours(
    strategy: str,
    module: nn.Module,
    device: torch.device,
    knobs: Mapping[str, Any],
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Wrap with our wrapper: ``wrap_module_ddp`` or ``wrap_module_fsdp``.

    ``knobs`` may hold the step's knobs too (``grad_accum``, ...); only the wrapper's are used.
    """
    knobs = wrap_knobs(knobs)
    if strategy == "ddp":
        kwargs: dict[str, Any] = _ddp_knobs(knobs)
        if group is not None:
            kwargs["process_group"] = group
        return wrap_module_ddp(module, device=device, **kwargs)
    return wrap_module_fsdp(module, device=device, mesh=_mesh(device, group), **knobs)


def raw(
    strategy: str,
    module: nn.Module,
    device: torch.device,
    knobs: Mapping[str, Any],
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Wrap with plain torch, as a trainer without our packages would."""
    knobs = wrap_knobs(knobs)
    if strategy == "ddp":
        ids = {"device_ids": [device.index], "output_device": device.index}
        kwargs: dict[str, Any] = {**_ddp_knobs(knobs), "process_group": group}
        if device.type == "cuda":
            kwargs.update(ids)
        with warnings.catch_warnings():  # torch 2.13's broadcast_buffers deprecation
            warnings.simplefilter("ignore", FutureWarning)
            return DistributedDataParallel(module, **kwargs)
    policy = MixedPrecisionPolicy(
        param_dtype=torch_dtype(knobs.get("param_dtype")),
        reduce_dtype=torch_dtype(knobs.get("reduce_dtype")),
    )
    reshard = bool(knobs.get("reshard_after_forward", True))
    mesh = _mesh(device, group)
    for sub in select_shard_targets(module, None):
        fully_shard(sub, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return module


def _ddp_knobs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    return {"broadcast_buffers": False, **knobs}


def _mesh(device: torch.device, group: dist.ProcessGroup | None) -> DeviceMesh:
    if group is None:
        return init_device_mesh(device.type, (dist.get_world_size(),))
    return DeviceMesh.from_group(group, device.type)
