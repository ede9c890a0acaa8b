"""On demand during training: do the replicas still agree, and if not, where and on whom."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dist_core import is_distributed, local_tensor, strategy_of, unwrap_compiled, unwrap_model
from replica_init._fingerprint import combine, digest_entry, named_state_tensors


@dataclasses.dataclass(frozen=True)
class DriftReport:
    """What :func:`replica_drift` found.

    Attributes:
        compared: The replicated tensors compared on each rank (0: nothing is replicated,
            e.g. FSDP over one mesh dimension, or one process).
        group_ranks: The global ranks compared with each other (this rank's replica group).
        drifted: Whether any replica differs.
        tensor: The first differing parameter or buffer (``param:name``), or ``None``.
        ranks: The global ranks whose copy of ``tensor`` differs from the group's first rank.
        max_abs_diff: The largest absolute difference of ``tensor`` from the first rank's copy.
        grad_norms: Each rank's norm of its local gradients as they stand (by position in
            ``group_ranks``; ``None`` where a rank holds none): right after a backward run
            under ``no_sync(model)`` they are the gradients before the reduction.
    """

    compared: int
    group_ranks: list[int]
    drifted: bool
    tensor: str | None = None
    ranks: list[int] = dataclasses.field(default_factory=list)
    max_abs_diff: float | None = None
    grad_norms: list[float | None] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        if not self.compared:
            return "replica drift: nothing replicated to compare"
        if not self.drifted:
            return (
                f"replica drift: none ({self.compared} tensors agree on ranks {self.group_ranks})"
            )
        return (
            f"replica drift: {self.tensor} differs on ranks {self.ranks} from rank "
            f"{self.group_ranks[0]} (max |diff| {self.max_abs_diff:.3g}); local grad norms "
            f"{self.grad_norms}"
        )


def replica_drift(model: nn.Module) -> DriftReport:
    """Compare every rank's copy of the replicated state by digest; name the first difference.

    Replicated: a DDP model's parameters and buffers (every rank of its group); an HSDP
    model's local shards across the replicate dimension (each shard group's ranks hold
    different shards, each replica the same ones). An FSDP model over one dimension and a
    plain model in one process replicate nothing: the report says so (``compared == 0``).

    Cheap enough for every N steps: each rank hashes its tensors and one gather of
    ``(fingerprint, grad norm)`` decides; only on a difference are the per-tensor digests
    gathered, and then the one differing tensor, for its largest difference. Collective over
    the replica group (every rank calls it at the same step).

    Args:
        model: The model as the trainer holds it (plain, DDP, FSDP, HSDP, compiled).

    Returns:
        The report; ``str(report)`` is one line for a log.
    """
    group, tensors = _replicated(model)
    norm = _grad_norm(model)
    if group is None or not is_distributed():
        return DriftReport(compared=0, group_ranks=[0], drifted=False, grad_norms=[norm])
    members = dist.get_process_group_ranks(group)
    digests = [digest_entry(name, tensor) for name, tensor in tensors]
    fingerprints: list[tuple[str, float | None]] = [("", None)] * len(members)
    dist.all_gather_object(fingerprints, (combine(digests), norm), group=group)
    norms = [value for _, value in fingerprints]
    if len({fingerprint for fingerprint, _ in fingerprints}) == 1:
        return DriftReport(len(tensors), members, drifted=False, grad_norms=norms)
    everyone: list[list[tuple[str, str]]] = [[] for _ in members]
    dist.all_gather_object(everyone, digests, group=group)
    index, differing = _first_difference(everyone)
    name, tensor = tensors[index]
    worst = _max_abs_diff(tensor, group, len(members))
    return DriftReport(
        len(tensors),
        members,
        drifted=True,
        tensor=name,
        ranks=[members[position] for position in differing],
        max_abs_diff=worst,
        grad_norms=norms,
    )


def _replicated(
    model: nn.Module,
) -> tuple[dist.ProcessGroup | None, list[tuple[str, torch.Tensor]]]:
    """The replica group and this rank's replicated tensors, sorted by name."""
    strategy = strategy_of(model)
    named = list(named_state_tensors(unwrap_model(model)))
    if strategy == "ddp":
        return getattr(unwrap_compiled(model), "process_group", None) or dist.group.WORLD, named
    if strategy == "hsdp":
        mesh = next(t.device_mesh for _, t in named if isinstance(t, DTensor))
        local = [(name, local_tensor(t)) for name, t in named]
        return mesh.get_group(0), local  # HSDP's mesh: (replicate, shard)
    return None, []


def _grad_norm(model: nn.Module) -> float | None:
    grads = []
    for param in model.parameters():
        grad = param.grad
        if grad is not None:
            grads.append(local_tensor(grad).detach())
    if not grads:
        return None
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))


def _first_difference(everyone: list[list[tuple[str, str]]]) -> tuple[int, list[int]]:
    """The first tensor whose digest differs (its index), and who differs from the first rank."""
    for index, first in enumerate(everyone[0]):
        others = [rank for rank, digests in enumerate(everyone) if digests[index] != first]
        if others:
            return index, others
    return 0, []


def _max_abs_diff(tensor: torch.Tensor, group: dist.ProcessGroup, size: int) -> float:
    """The largest absolute difference of ``tensor`` from the group's first rank's copy."""
    mine = tensor.detach().contiguous()
    copies = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(copies, mine, group=group)
    first = copies[0].double()
    return max(float((copy.double() - first).abs().max()) for copy in copies)
