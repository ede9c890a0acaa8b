"""Wiring torchft's ``Manager`` into a wrapped model: the cross-group reduction hooks.

DDP: a comm hook averages each bucket over the group, then over the live groups. FSDP2 (HSDP
inside the group): an all-reduce hook on every unit averages each reduced shard over the live
groups. dist-core's ``replica_reduce`` then spans the live groups (``global_count``,
``replica_drift``).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from dist_core import fsdp_modules, log_rank0, set_replica_reduce, strategy_of
from distributed_strategy._lighthouse import group_store, replica_name
from distributed_strategy.fault_tolerance import _ATTACHED, FaultTolerance
from strategy_config import FaultToleranceConfig

if TYPE_CHECKING:
    from torchft import Manager

logger = logging.getLogger(__name__)


def attach_fault_tolerance(
    model: nn.Module, config: FaultToleranceConfig, device: torch.device
) -> FaultTolerance:
    """Start this group's ``Manager`` and average the gradients across the live groups.

    DDP: a comm hook on each bucket. FSDP2 (HSDP inside the group, or FSDP over it): an
    all-reduce hook on each FSDP module, after the group's own reduction.

    The group's store is its default process group's (:func:`group_store`); the cross-group
    process group is gloo on the CPU and NCCL on CUDA.
    """
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    strategy = strategy_of(model)
    ddp = strategy == "ddp"
    # NOTE: the groups reduce DDP's buckets element by element, so every group must hold the
    # same layout. DDP rebuilds its buckets after its first backward unless it looks for
    # unused parameters without a static graph; a group that heals mid-run is then in its
    # first step while its peers are past theirs. strategy-config's ddp_options set it.
    if ddp and (
        not getattr(model, "find_unused_parameters", False) or getattr(model, "static_graph", True)
    ):
        raise RuntimeError(
            "fault tolerance needs DDP built with find_unused_parameters=True and "
            "static_graph=False (a fixed bucket layout in every replica group); wrap it with "
            "DistributedConfig.ddp_options()"
        )
    timeout = datetime.timedelta(seconds=config.timeout_s)
    store_addr, store_port = group_store()  # checked before the build by check_lighthouse
    cross = ProcessGroupNCCL(timeout) if device.type == "cuda" else ProcessGroupGloo(timeout)
    manager = Manager(
        pg=cross,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=config.min_replica_size,
        # NOTE: the quorum (and a heal) completes in zero_grad, before the forward: a healed
        # group then trains in the same step, and no state dict is read mid-forward.
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=config.quorum_timeout_s),
        connect_timeout=datetime.timedelta(seconds=config.connect_timeout_s),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=config.lighthouse,
        replica_id=replica_name(config),
    )
    handle = FaultTolerance(config, manager, cross, model, device)
    # global_count: the live groups' tokens; replica_drift: the live groups compared
    set_replica_reduce(model, _LiveGroups(manager, cross, device, config.replica_id))
    if ddp:
        model.register_comm_hook(handle, _managed_hook(dist.get_world_size()))  # type: ignore[operator]
    else:
        # NOTE: FSDP2 hands the hook each unit's reduced shard (after HSDP's in-group
        # all-reduce); rank r of every group holds shard r of the same units, so the groups
        # reduce the same layout. A unit reduces only the parameters that have a gradient:
        # every group must give a unit's parameters gradients alike.
        for unit in fsdp_modules(model):
            unit.set_all_reduce_hook(handle._reduce_shard)
    _ATTACHED[model] = handle
    log_rank0(
        logger,
        logging.INFO,
        "fault tolerance (%s): replica group %d of %d at lighthouse %s, %d rank(s) in this "
        "group, a step commits with >= %d live group(s)",
        strategy.upper(),
        config.replica_id,
        config.replica_groups,
        config.lighthouse,
        dist.get_world_size(),
        config.min_replica_size,
    )
    return handle


class _LiveGroups:
    """dist-core's ``ReplicaReduce`` over the groups in torchft's quorum this step."""

    def __init__(self, manager: Manager, cross: Any, device: torch.device, replica_id: int) -> None:
        self._manager = manager
        self._cross = cross
        self._device = device  # the cross-group process group's: NCCL on CUDA, gloo on CPU
        self._replica_id = replica_id

    def sum_(self, tensor: torch.Tensor) -> None:
        # NOTE: the sum runs on a copy on the cross group's device, the same path on CPU and
        # CUDA: ``tensor`` takes the result only if the reduce succeeded, so a failed one
        # leaves the group's own values (a count stays a count for the step discarded). On
        # NCCL, wait() does not block the host and a failure only marks the cross group
        # errored (torchft aborts it from a timer): its errored() synchronizes first.
        summed = tensor.to(self._device, copy=True)
        self._manager.allreduce(summed, reduce_op=dist.ReduceOp.SUM).wait()
        if self._manager.errored() is None and self._cross.errored() is None:
            tensor.copy_(summed)

    def live(self) -> int:
        return int(self._manager.num_participants())

    def position(self) -> int:
        position = self._manager.participating_rank()
        if position is None:
            raise RuntimeError(
                f"replica group {self._replica_id} is not in this step's quorum (it is healing); "
                "compare the groups after its first committed step"
            )
        return int(position)

    def replica_id(self) -> int:
        return self._replica_id


def _managed_hook(
    group_size: int,
) -> Callable[[FaultTolerance, Any], torch.futures.Future[torch.Tensor]]:
    """DDP's comm hook: the group's mean, then the mean over the live groups."""

    def hook(handle: FaultTolerance, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        # At the backward's end (after DDP's own callback): the first run fills, the rest find
        # the list empty.
        Variable._execution_engine.queue_callback(handle._fill_unused)
        handle._reduced.extend(zip(bucket.parameters(), bucket.gradients(), strict=True))
        buffer = bucket.buffer()
        if group_size > 1:
            dist.all_reduce(buffer)
            buffer.div_(group_size)
        # NOTE: waited here, never chained: a peer that dies mid-reduce makes torchft's work
        # fail, which it records (the step then does not commit) instead of raising into
        # backward; the bucket's future is always completed.
        handle.manager.allreduce(buffer).wait()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    # DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
    hook.__annotations__.update(
        {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}  # type: ignore[attr-defined]
    )
    return hook
