"""On demand during training: do the replicas still agree, and if not, where and on whom."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn

from dist_core import (
    collective_device,
    fsdp_mesh,
    is_distributed,
    local_tensor,
    replica_reduce,
    strategy_of,
    unwrap_compiled,
    unwrap_model,
)
from replica_init._across import compare_groups
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
        groups: Under fault tolerance, the replica ids of the live replica groups compared
            (rank r of each with rank r of the others); ``[]`` otherwise.
        groups_drifted: The replica ids whose copy differs from the first group's.
    """

    compared: int
    group_ranks: list[int]
    drifted: bool
    tensor: str | None = None
    ranks: list[int] = dataclasses.field(default_factory=list)
    max_abs_diff: float | None = None
    grad_norms: list[float | None] = dataclasses.field(default_factory=list)
    groups: list[int] = dataclasses.field(default_factory=list)
    groups_drifted: list[int] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        where = f"ranks {self.group_ranks}"
        if self.groups:
            where += f" of replica groups {self.groups}"
        if not self.compared:
            return "replica drift: nothing replicated to compare"
        if not self.drifted:
            return f"replica drift: none ({self.compared} tensors agree on {where})"
        if self.groups_drifted:
            return (
                f"replica drift: {self.tensor} differs in replica groups {self.groups_drifted} "
                f"from group {self.groups[0]} ({where})"
            )
        return (
            f"replica drift: {self.tensor} differs on ranks {self.ranks} from rank "
            f"{self.group_ranks[0]} (max |diff| {self.max_abs_diff:.3g}); local grad norms "
            f"{self.grad_norms}"
        )


def replica_drift(model: nn.Module) -> DriftReport:
    """Compare every rank's copy of the replicated state by digest; name the first difference.

    Under fault tolerance (a model whose sums span replica groups, dist-core's
    ``replica_reduce``) the live groups are compared too: rank r of every group holds the
    same tensors, and the report names the groups that differ. Call it at the same step on
    every rank of every live group, after the step's quorum (e.g. after ``zero_grad``).

    Replicated: a DDP model's parameters and buffers (every rank of its group); an HSDP
    model's local shards across the replicate dimension (each shard group's ranks hold
    different shards, each replica the same ones). An FSDP model over one dimension and a
    plain model in one process replicate nothing: the report says so (``compared == 0``).

    Cheap enough for every N steps: each rank hashes its tensors and one gather of
    ``(fingerprint, grad norm)`` decides. Only on a difference does more travel: the group's
    first rank broadcasts its per-tensor digests (one MIN all-reduce finds the first differing
    tensor), then that tensor in fixed-size chunks (each rank takes its largest difference as
    they pass: extra memory is one chunk, whatever the tensor's size and the group's), and one
    MAX all-reduce gathers who differs and by how much. Host-resident shards (CPU offload)
    travel through the group's device. Collective over the replica group (every rank calls it
    at the same step).

    Args:
        model: The model as the trainer holds it (plain, DDP, FSDP, HSDP, compiled).

    Returns:
        The report; ``str(report)`` is one line for a log.
    """
    group = _replica_group(model)
    across = replica_reduce(model)
    # this rank's tensors (its shards under FSDP), each hashed once for both comparisons
    tensors = [(n, local_tensor(t)) for n, t in named_state_tensors(unwrap_model(model))]
    within = group is not None and is_distributed()
    digests = [digest_entry(n, t) for n, t in tensors] if within or across is not None else []
    report = _within_group(model, group if within else None, tensors, digests)
    if across is None:
        return report
    found = compare_groups(across, digests)
    return dataclasses.replace(
        report,
        compared=max(report.compared, len(tensors)),
        drifted=report.drifted or bool(found.differing),
        tensor=report.tensor or (None if found.tensor is None else tensors[found.tensor][0]),
        groups=found.groups,
        groups_drifted=found.differing,
    )


def _within_group(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    tensors: list[tuple[str, torch.Tensor]],
    digests: list[tuple[str, str]],
) -> DriftReport:
    """The comparison over the model's own replica group (``None``: nothing replicated)."""
    norm = _grad_norm(model)
    if group is None:
        return DriftReport(compared=0, group_ranks=[0], drifted=False, grad_norms=[norm])
    members = dist.get_process_group_ranks(group)
    fingerprints: list[tuple[str, float | None]] = [("", None)] * len(members)
    dist.all_gather_object(fingerprints, (combine(digests), norm), group=group)
    norms = [value for _, value in fingerprints]
    if len({fingerprint for fingerprint, _ in fingerprints}) == 1:
        return DriftReport(len(tensors), members, drifted=False, grad_norms=norms)
    device = collective_device(group)
    first: list[object] = [digests]
    dist.broadcast_object_list(first, group=group, group_src=0)
    reference: list[tuple[str, str]] = first[0]  # type: ignore[assignment]
    mine = next(
        (i for i, (a, b) in enumerate(zip(digests, reference, strict=True)) if a != b), len(tensors)
    )
    found = torch.tensor([mine], dtype=torch.int64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MIN, group=group)
    index = int(found.item())
    name, tensor = tensors[index]
    verdict = torch.zeros(len(members) + 1, dtype=torch.float64, device=device)
    verdict[dist.get_rank(group)] = float(digests[index] != reference[index])
    verdict[-1] = _max_abs_diff(tensor, group, device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    *flags, worst = verdict.tolist()
    return DriftReport(
        len(tensors),
        members,
        drifted=True,
        tensor=name,
        ranks=[members[position] for position, flag in enumerate(flags) if flag],
        max_abs_diff=worst,
        grad_norms=norms,
    )


def _replica_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The group whose ranks hold the same tensors: DDP's, or HSDP's replicate dimension."""
    strategy = strategy_of(model)
    if strategy == "ddp":
        return getattr(unwrap_compiled(model), "process_group", None) or dist.group.WORLD
    if strategy == "hsdp":
        mesh = fsdp_mesh(model)
        assert mesh is not None  # strategy_of read "hsdp" from it
        return mesh.get_group(0)  # HSDP's mesh: (replicate, shard)
    return None


def _grad_norm(model: nn.Module) -> float | None:
    """The 2-norm of this rank's local gradients, in float64, with one host read per device."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None:
            grad = local_tensor(param.grad).detach()
            grad = torch.view_as_real(grad) if grad.is_complex() else grad  # the same norm
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    if not by_kind:
        return None
    squares = 0.0
    for grads in by_kind.values():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
        squares += float(torch.linalg.vector_norm(torch.stack(norms)).item()) ** 2
    return math.sqrt(squares)


CHUNK_BYTES = 64 << 20
"""The most bytes of a differing tensor in flight at once while its difference is measured."""


def _max_abs_diff(
    tensor: torch.Tensor, group: dist.ProcessGroup, device: torch.device
) -> torch.Tensor:
    """The largest absolute difference of ``tensor`` from the group's first rank's copy.

    The first rank broadcasts its copy chunk by chunk through one buffer on ``device``; each
    rank folds its own difference into a scalar there: this rank's difference, a ``float64``
    scalar on ``device`` (no host sync).
    """
    flat = tensor.detach().reshape(-1)
    # NOTE: a chunk's float64 (or complex128) temporaries, not its raw bytes, bound the memory
    chunk = max(1, CHUNK_BYTES // 16)
    wide = torch.promote_types(flat.dtype, torch.float64)
    buffer = torch.empty(min(chunk, flat.numel()), dtype=flat.dtype, device=device)
    worst = torch.zeros((), dtype=torch.float64, device=device)
    first = dist.get_rank(group) == 0
    for begin in range(0, flat.numel(), chunk):
        part = flat[begin : begin + chunk]
        theirs = buffer[: part.numel()]
        if first:
            theirs.copy_(part)
        # as bytes: NCCL has no int16, uint16 or bool, and the bytes are all that is compared
        dist.broadcast(theirs.view(torch.uint8), group=group, group_src=0)
        if not first:
            difference = (part.to(device).to(wide) - theirs.to(wide)).abs().amax()
            worst = torch.maximum(worst, difference.to(torch.float64))
    # NOTE: a NaN difference is reported as inf: NCCL's MAX of a NaN is not defined.
    return torch.nan_to_num(worst, nan=math.inf)
