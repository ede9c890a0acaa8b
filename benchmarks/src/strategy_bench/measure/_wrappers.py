"""The wraps being compared: ours (ddp-wrap, fsdp-wrap) and raw torch on the same module."""

from __future__ import annotations

import itertools
import os
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
    SUPPORTED_DISTRIBUTED_STRATEGIES,
    DistributedConfig,
    wrap_module_ddp,
    wrap_module_fsdp,
)
from fsdp_wrap import hsdp_mesh, offload_policy, select_shard_targets, torch_dtype
from strategy_bench._errors import BenchUsageError
from strategy_bench.workload import ddp_wrap_knobs, fsdp_wrap_knobs

STRATEGIES = tuple(sorted(SUPPORTED_DISTRIBUTED_STRATEGIES))
"""What ``--strategies`` takes: DDP, FSDP, and HSDP (FSDP over a 2-D mesh, see
:func:`hsdp_shape`)."""

SHARDED = ("fsdp", "hsdp")
"""The strategies whose parameters are sharded (never whole on the device)."""

HSDP_MIN_WORLD = 4
"""HSDP points need at least 2 replicas of 2 shards."""


def hsdp_shape(world: int) -> tuple[int, int]:
    """The bench's HSDP mesh, ``(replicate, shard)``, for ``world`` ranks.

    Under torchrun across nodes, the config's rule: shard within a node
    (``LOCAL_WORLD_SIZE``), replicate across the nodes. On one host (spawned ranks, or
    torchrun on one node) the ranks are split into 2 pretend nodes, so that HSDP differs from
    FSDP: 4 ranks run as 2 x 2.

    Raises:
        BenchUsageError: Fewer than :data:`HSDP_MIN_WORLD` ranks, or an odd number on one
            host.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if 0 < local < world:
        return DistributedConfig(strategy="hsdp").hsdp_mesh_shape(world, local)
    if world < HSDP_MIN_WORLD or world % 2:
        raise BenchUsageError(
            f"HSDP needs at least {HSDP_MIN_WORLD} ranks, an even number on one host (2 x "
            f"world/2), got a world of {world}; use --world-size 4, or leave hsdp out of "
            "--strategies"
        )
    return 2, world // 2


def ours(
    strategy: str,
    module: nn.Module,
    device: torch.device,
    knobs: Mapping[str, Any],
    group: dist.ProcessGroup | None = None,
    *,
    hsdp: tuple[int, int] | None = None,
    made: list[dist.ProcessGroup] | None = None,
) -> nn.Module:
    """Wrap with our wrapper: ``wrap_module_ddp`` or ``wrap_module_fsdp``.

    ``knobs`` may hold the step's knobs too (``grad_accum``, ...); only the wrapper's are used.
    ``hsdp`` is HSDP's mesh shape when not :func:`hsdp_shape`'s (the estimate's nodes).
    ``made`` collects the process groups a cold wrap creates (the caller destroys them).
    """
    if strategy == "ddp":
        kwargs: dict[str, Any] = _ddp_knobs(knobs)
        if group is not None:
            kwargs["process_group"] = group
        return wrap_module_ddp(module, device=device, **kwargs)
    mesh = _mesh(strategy, device, group, hsdp, made)
    return wrap_module_fsdp(module, device=device, mesh=mesh, **fsdp_wrap_knobs(strategy, knobs))


def raw(
    strategy: str,
    module: nn.Module,
    device: torch.device,
    knobs: Mapping[str, Any],
    group: dist.ProcessGroup | None = None,
    *,
    made: list[dist.ProcessGroup] | None = None,
) -> nn.Module:
    """Wrap with plain torch, as a trainer without our packages would (``made``: see ours)."""
    if strategy == "ddp":
        ids = {"device_ids": [device.index], "output_device": device.index}
        kwargs: dict[str, Any] = {**_ddp_knobs(knobs), "process_group": group}
        if device.type == "cuda":
            kwargs.update(ids)
        with warnings.catch_warnings():  # torch 2.13's broadcast_buffers deprecation
            warnings.simplefilter("ignore", FutureWarning)
            return DistributedDataParallel(module, **kwargs)
    fsdp = fsdp_wrap_knobs(strategy, knobs)
    policy = MixedPrecisionPolicy(
        param_dtype=torch_dtype(fsdp.get("param_dtype")),
        reduce_dtype=torch_dtype(fsdp.get("reduce_dtype")),
    )
    mesh = _mesh(strategy, device, group, None, made)
    reshard = bool(fsdp.get("reshard_after_forward", True))
    host = offload_policy(device, fsdp["offload"])  # what a trainer passes for offload
    for unit in select_shard_targets(module, None):
        fully_shard(
            unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=host
        )
    # the root as a trainer calls it: torch's own rule (kept gathered from the forward to the
    # backward) unless resharding is off; an explicit True would regather it every backward
    if reshard:
        fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=host)
    else:
        fully_shard(
            module, mesh=mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=host
        )
    return module


def _ddp_knobs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    return {"broadcast_buffers": False, **ddp_wrap_knobs(knobs)}


_MESHES: dict[tuple[Any, str, tuple[int, ...]], DeviceMesh] = {}
_COLD_MESHES = itertools.count()


def _mesh(
    strategy: str,
    device: torch.device,
    group: dist.ProcessGroup | None,
    shape: tuple[int, int] | None = None,
    made: list[dist.ProcessGroup] | None = None,
) -> DeviceMesh:
    """FSDP's 1-D mesh over ``group`` (default: the world), or HSDP's 2-D one.

    The run's mesh is built once per default group, strategy and shape, and kept: where CUDA
    is available and the default group is gloo (CPU runs on a GPU host), ``init_device_mesh``
    would make a new group for every wrap. A cold wrap (``group`` given)
    times building a mesh of its own, named ``coldN`` (HSDP: ``coldN_replicate``,
    ``coldN_shard``), whose new subgroups are appended to ``made`` for the caller to destroy
    right after the wrap. The name keeps it apart: torch (2.13) compares meshes by ranks,
    layout, device type and names, not by their groups, so an unnamed cold mesh equal to the
    run's could reach the run's DTensors through torch's caches and, once its group is
    destroyed, break their collectives. A ``shape`` given (the estimate's, one fake group per
    point) is built each time.
    """
    if strategy == "hsdp" and shape is not None:
        return hsdp_mesh(device, replicate=shape[0], shard=shape[1])
    if group is not None:
        name = f"cold{next(_COLD_MESHES)}"
        if strategy != "hsdp":
            return DeviceMesh.from_group(group, device.type, mesh_dim_names=(name,))
        cold = init_device_mesh(
            device.type,
            hsdp_shape(dist.get_world_size()),
            mesh_dim_names=(f"{name}_replicate", f"{name}_shard"),
        )
        if made is not None:  # a dimension as large as the world reuses the default group
            world = dist.distributed_c10d._get_default_group()
            made += [g for g in (cold.get_group(0), cold.get_group(1)) if g is not world]
        return cold
    hsdp = hsdp_shape(dist.get_world_size()) if strategy == "hsdp" else None
    size: tuple[int, ...] = hsdp or (dist.get_world_size(),)
    key = (dist.distributed_c10d._get_default_group(), device.type, size)
    if key not in _MESHES:
        _MESHES[key] = (
            init_device_mesh(device.type, size)
            if hsdp is None
            else hsdp_mesh(device, replicate=hsdp[0], shard=hsdp[1])
        )
    return _MESHES[key]
