"""torchft's replica groups under ``prepare_model``: DDP and HSDP that train through a failure.

A replica group is one job (torchrun, or one srun step) with its own default process group;
the groups meet at torchft's lighthouse. Inside a group DDP (or FSDP2's HSDP) reduces over the
group's ranks as always; across groups each bucket (DDP's comm hook) or each reduced shard
(FSDP2's all-reduce hook) is averaged through torchft's ``Manager`` over the groups that are
live this step. A group that dies stops nobody: its step is discarded where it
was in flight, the others commit theirs, and a group that comes back heals from a live peer
(weights, optimizer state and RNG streams, through torchft's transport) before its first
step.

A trainer takes :class:`FaultTolerance` from :func:`fault_tolerance_of`: ``wrap_optimizer``
(``zero_grad()`` joins the step's quorum, ``step()`` commits it), ``samples`` (this rank's
share of the committed step), and what follows each commit: ``record_samples`` (which samples
each step trained, sample-order's log) and ``save_on_commit`` / ``resume`` (checkpoints with
the manager's state). The engine's wiring (hooks, the Manager) is in ``_ft_wiring``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from checkpoint_io import CheckpointManager
from ddp_wrap import unwrap_ddp_module
from dist_core import agree
from distributed_strategy._lighthouse import replica_name
from rng_fork import RngState, capture_rng_state, restore_rng_state
from sample_order import SampleLog, SampleOrder
from strategy_config import FaultToleranceConfig

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["FaultTolerance", "fault_tolerance_of"]


_MANAGER_KEY = "torchft"  # the manager's state in a checkpoint's stateful objects

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
        self._model = model
        self._module = unwrap_ddp_module(model)
        self._saving: tuple[CheckpointManager, dict[str, Any]] | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._reduced: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._record: tuple[SampleOrder, SampleLog | None] | None = None

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer under the manager's commit, its state healed with the model's.

        ``zero_grad()`` starts the step's quorum (a group behind the others receives the
        weights, the optimizer state and the RNG streams of a live peer there, before its
        forward): call it before each step's first forward, the first step's included.
        ``step()`` runs only if this group's step succeeded on all its ranks, its cross-group
        reduces included (torchft's ``should_commit``, agreed inside the group; a group whose
        reduce failed discards its step while the others may commit theirs).

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
        handle = self

        class _Committing(ManagedOptimizer):  # type: ignore[misc]  # torchft is untyped here
            def step(self, closure: object = None) -> None:
                if closure is not None:
                    raise ValueError("an optimizer closure is not supported under torchft")
                if self.manager.should_commit():  # this group's step succeeded everywhere
                    self.optim.step()
                    handle._committed(int(self.manager.current_step()) - 1)
                else:
                    handle._discarded()

        managed: torch.optim.Optimizer = _Committing(self.manager, optimizer)
        return managed

    def samples(self, order: SampleOrder, step: int | None = None) -> list[int]:
        """This rank's samples of ``step`` (default: the step being trained) under ``order``.

        The replica groups split each global batch by ``replica_id`` (all
        ``replica_groups`` of them, live or not: a group that is down leaves its share
        untrained, never moved to another), and a group's ranks split its share. The data
        position is the step, so a group that heals, or a run that resumes, reads on in the
        same order.

        Raises:
            ValueError: As :meth:`SampleOrder.shard`, e.g. a global batch that
                ``replica_groups`` times the group's ranks does not divide.
        """
        ranks = dist.get_world_size()
        return order.shard(
            self.step if step is None else step,
            rank=self.config.replica_id * ranks + dist.get_rank(),
            world_size=self.config.replica_groups * ranks,
        )

    def record_samples(self, order: SampleOrder, folder: str | os.PathLike[str]) -> None:
        """From now on, record each committed step's samples in ``folder`` (sample-order's log).

        The group's rank 0 appends the group's share (what :meth:`samples` gives its ranks)
        to ``FOLDER/replica_<id>.jsonl`` once the step commits; ``read_sample_log(folder,
        order)`` then names, step by step, what was trained and what was lost.

        Raises:
            ValueError: If ``order``'s global batch cannot be split over the groups' ranks.
        """
        self.samples(order, 0)  # the split checked now, not at the first commit
        writer = replica_name(self.config)  # the group's name at the lighthouse, one spelling
        self._record = (order, SampleLog(folder, writer=writer) if dist.get_rank() == 0 else None)

    def save_on_commit(
        self, checkpoints: CheckpointManager, *, stateful: Mapping[str, Any] | None = None
    ) -> None:
        """Checkpoint through the manager's commit: after each committed step, ``maybe_save``.

        A checkpoint is written only once this group committed the step (never a step it
        rolled back), numbered by the steps committed, with the manager's own state
        (as torchft requires) beside the model, the optimizer and ``stateful``. Each group
        writes its own ``checkpoints.root``; a checkpoint loads without torchft too.

        Raises:
            RuntimeError: Before :meth:`wrap_optimizer`.
            ValueError: If ``stateful`` uses the name ``"torchft"``.
        """
        self._saving = (checkpoints, self._with_manager(stateful))

    def resume(
        self, checkpoints: CheckpointManager, *, stateful: Mapping[str, Any] | None = None
    ) -> int:
        """``checkpoints.resume`` with the manager's state: the step this group resumes from.

        A group that restarts resumes its last complete checkpoint, then heals from a live
        peer at its first quorum if the others are ahead.

        Raises:
            RuntimeError: Before :meth:`wrap_optimizer`.
            ValueError: If ``stateful`` uses the name ``"torchft"``.
        """
        with_manager = self._with_manager(stateful)
        return checkpoints.resume(self._model, self._optimizer, stateful=with_manager)

    def _with_manager(self, stateful: Mapping[str, Any] | None) -> dict[str, Any]:
        if self._optimizer is None:
            raise RuntimeError("call wrap_optimizer(optimizer) first: its state is checkpointed")
        if stateful is not None and _MANAGER_KEY in stateful:
            raise ValueError(
                f"stateful={{{_MANAGER_KEY!r}: ...}} names the manager's own state; rename it"
            )
        return {**(stateful or {}), _MANAGER_KEY: self.manager}

    def _committed(self, step: int) -> None:
        """After ``step`` committed: its samples into the record, then the checkpoint."""
        order, log = self._record or (None, None)
        failure: OSError | None = None
        if order is not None and log is not None:  # the group's rank 0
            groups = self.config.replica_groups
            try:
                log.write(step, order.shard(step, rank=self.config.replica_id, world_size=groups))
            except OSError as error:  # (a full disk): every rank of the group raises it
                failure = error
        if order is not None:
            agree(failure, f"recording the samples of step {step}")
        if self._saving is not None:
            checkpoints, stateful = self._saving
            checkpoints.maybe_save(step + 1, self._model, self._optimizer, stateful=stateful)

    def _discarded(self) -> None:
        """After a step this group discarded: a stop signal is still honoured."""
        # NOTE: the state is the committed one, at ``step``; maybe_save at a step that is not a
        # multiple of ``every`` saves only when a rank got a stop signal (every multiple was
        # saved at its commit already), so a group that cannot commit still stops cleanly.
        step = self.step
        if self._saving is not None and step % self._saving[0].every:
            checkpoints, stateful = self._saving
            checkpoints.maybe_save(step, self._model, self._optimizer, stateful=stateful)

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
        """The steps this group committed (the manager's, healed with the state)."""
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
