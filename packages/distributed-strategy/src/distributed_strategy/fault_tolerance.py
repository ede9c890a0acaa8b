"""torchft's replica groups under ``prepare_model``: DDP and HSDP that train through a failure.

A replica group is one job (torchrun, or one srun step) with its own default process group;
the groups meet at torchft's lighthouse. Inside a group DDP (or FSDP2's HSDP) reduces over the
group's ranks as always; across groups each bucket (DDP's comm hook) or each reduced shard
(FSDP2's all-reduce hook) is averaged through torchft's ``Manager`` over the groups that are
live this step. A group that dies stops nobody: its step is discarded where it
was in flight, the others commit theirs, and a group that comes back heals from a live peer
(weights, optimizer state and RNG streams, through torchft's transport) before its first
step.

A trainer's loop changes in one line: ``optimizer = fault_tolerance_of(model).wrap_optimizer(
optimizer)``; ``zero_grad()`` then joins the step's quorum and ``step()`` commits it.
"""

from __future__ import annotations

import datetime
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from ddp_wrap import unwrap_ddp_module
from dist_core import fsdp_modules, log_rank0, set_replica_reduce, strategy_of
from distributed_strategy._lighthouse import group_store, replica_name
from rng_fork import RngState, capture_rng_state, restore_rng_state
from strategy_config import FaultToleranceConfig

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["FaultTolerance", "fault_tolerance_of"]

logger = logging.getLogger(__name__)

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, FaultTolerance] = weakref.WeakKeyDictionary()


class FaultTolerance:
    """This replica group's torchft ``Manager``, bound to the model ``prepare_model`` wrapped.

    Attributes:
        config: The ``fault_tolerance`` section.
        manager: torchft's ``Manager`` (quorum, commit, heal).
    """

    def __init__(
        self,
        config: FaultToleranceConfig,
        manager: Manager,
        cross: Any,
        model: nn.Module,
        device: torch.device,
    ) -> None:
        self.config = config
        self.manager = manager
        self._cross = cross
        self._device = device
        self._module = unwrap_ddp_module(model)
        self._optimizer: torch.optim.Optimizer | None = None
        self._reduced: list[tuple[torch.Tensor, torch.Tensor]] = []

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer under the manager's commit, its state healed with the model's.

        ``zero_grad()`` starts the step's quorum (a group behind the others receives the
        weights, the optimizer state and the RNG streams of a live peer there, before its
        forward): call it before each step's first forward, the first step's included.
        ``step()`` runs only if every live group's step succeeded (``manager.should_commit()``).

        Raises:
            TypeError: If ``optimizer`` is not a ``torch.optim.Optimizer``.
            RuntimeError: If an optimizer was wrapped already.
        """
        from torchft import Optimizer as ManagedOptimizer

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if self._optimizer is not None:
            raise RuntimeError(
                "wrap_optimizer was called already for this model; call it once, with the "
                "optimizer over all the model's parameters"
            )
        self._optimizer = optimizer
        self.manager.register_state_dict_fn("model_optimizer", self._load, self._state)
        managed: torch.optim.Optimizer = ManagedOptimizer(self.manager, optimizer)
        return managed

    def _state(self) -> dict[str, Any]:
        assert self._optimizer is not None
        return {
            "model": self._module.state_dict(),
            "optimizer": self._optimizer.state_dict(),
            "rng": capture_rng_state(self._device),
        }

    def _load(self, state: dict[str, Any]) -> None:
        assert self._optimizer is not None
        self._module.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        rng: RngState = state["rng"]
        if rng["device"] is not None:  # the peer's rank r streams, onto this rank's device
            rng = {**rng, "device": {**rng["device"], "index": self._device.index or 0}}
        restore_rng_state(rng)

    @property
    def step(self) -> int:
        """The last step every live group committed (the manager's, healed with the state)."""
        return int(self.manager.current_step())

    def participants(self) -> int:
        """The replica groups in this step's quorum (waits for the quorum)."""
        return int(self.manager.num_participants())

    def shutdown(self) -> None:
        """Stop the manager's servers and threads and the cross-group process group.

        The group's own (default) process group stays.
        """
        self.manager.shutdown(wait=False)
        self._cross.shutdown()

    def _reduce_shard(self, output: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: the live groups' mean of a reduced shard, in place."""
        self.manager.allreduce(output).wait()

    def _fill_unused(self) -> None:
        """At the end of a backward: the live groups' mean for what this group left unused."""
        # NOTE: DDP leaves .grad untouched for a parameter no rank of *its* group used, though
        # the cross-group reduce put the other groups' mean in its bucket slot: without this,
        # one group would step a parameter another skips, and the replicas drift. A parameter
        # no live group used gets zeros (the same on every group).
        for param, reduced in self._reduced:
            if param.grad is None:
                param.grad = reduced.detach().clone()
        self._reduced.clear()


def fault_tolerance_of(model: nn.Module) -> FaultTolerance:
    """The :class:`FaultTolerance` that ``prepare_model`` attached to ``model``.

    Raises:
        ValueError: If ``model`` was not prepared with a ``fault_tolerance`` section.
    """
    found = _ATTACHED.get(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} was not prepared with fault tolerance; set "
            "training.distributed.fault_tolerance and build it with prepare_model"
        )
    return found


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
    set_replica_reduce(model, _LiveGroups(manager))  # global_count: the live groups' tokens
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

    def __init__(self, manager: Manager) -> None:
        self._manager = manager

    def sum_(self, tensor: torch.Tensor) -> None:
        local = tensor.clone()
        self._manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM).wait()
        # NOTE: a failed reduce leaves the tensor undefined and the step uncommitted: the
        # group's own sum is kept, so a count stays a count for the step that is discarded.
        if self._manager.errored() is not None:
            tensor.copy_(local)

    def live(self) -> int:
        return int(self._manager.num_participants())


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
