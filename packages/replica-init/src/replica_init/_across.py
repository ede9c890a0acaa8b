"""Replica groups beyond the process group (fault tolerance): do the groups hold the same state?

Each live group's rank r holds the same tensors as every other group's rank r (the whole model
under DDP, the same shards under FSDP inside a group). The comparison travels through the one
reduction the groups share (dist-core's ``ReplicaReduce``, a sum): every group writes its id
and its per-tensor digests into its own row of a table that is zero elsewhere, and the sum is
every group's row, exactly (each digest cut into 16-bit pieces, held exactly in float64).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from dist_core import ReplicaReduce, collective_device, is_distributed

_PIECES = 4  # 16-bit pieces of a digest compared (64 bits of its sha256)


@dataclasses.dataclass(frozen=True)
class GroupsCompared:
    """What the groups' rows said, the same on every rank of every live group.

    Attributes:
        groups: The replica ids of this step's live groups, by their place in the quorum.
        differing: The ids of the groups whose copy differs from the first group's.
        tensor: The first differing tensor's index in the compared list, or ``None``.
    """

    groups: list[int]
    differing: list[int]
    tensor: int | None


def compare_groups(across: ReplicaReduce, digests: list[tuple[str, str]]) -> GroupsCompared:
    """Compare this rank's ``(key, digest)`` list with every live group's same rank.

    Collective over the live groups (rank r with rank r) and then over this group's process
    group (a rank's verdict is its group's: the first differing tensor on any rank, every
    group that differs on any rank).

    Raises:
        RuntimeError: If the groups changed while they were compared (a row missing or
            doubled: a group died or joined mid-call); call it again at the next step.
    """
    live, place = across.live(), across.position()
    width = 2 + _PIECES * len(digests)  # present, replica id, the digests' pieces
    table = torch.zeros(live, width, dtype=torch.float64)
    table[place, 0] = 1.0
    table[place, 1] = float(across.replica_id())
    table[place, 2:] = torch.tensor([_pieces(d) for _, d in digests], dtype=torch.float64).view(-1)
    across.sum_(table)  # (the reduction moves it to the groups' device and back)
    # NOTE: every row holds exactly one group's values only if every group added its own row
    # once; a reduction that failed (a peer died) leaves this group's row alone. The group's
    # ranks agree on that before any of them raises (none is left in the all-reduce below).
    broken = not (torch.isfinite(table).all() and bool((table[:, 0] == 1).all()))
    pieces = table[:, 2:].view(live, len(digests), _PIECES)
    unequal = (pieces != pieces[0]).any(dim=2)  # [group, tensor]
    verdict = torch.cat(
        [
            torch.tensor([float(broken)], dtype=torch.float64),
            unequal.any(dim=1).to(torch.float64),
            _first_true(unequal.any(dim=0)).view(1),
        ]
    )
    if is_distributed() and dist.get_world_size() > 1:  # this group's ranks: one verdict
        on_device = verdict.to(collective_device(None))
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
        verdict = on_device.cpu()
    if verdict[0]:
        raise RuntimeError(
            f"the replica groups changed while they were compared (rows present on this rank: "
            f"{table[:, 0].tolist()} of {live}); call replica_drift again at the next step"
        )
    first = int(-verdict[-1].item())
    ids = [int(v) for v in table[:, 1].tolist()]
    return GroupsCompared(
        groups=ids,
        differing=[ids[g] for g, flag in enumerate(verdict[1:-1].tolist()) if flag],
        tensor=None if first == _NONE else first,
    )


_NONE = 1 << 40  # no differing tensor (stored negated: a MAX of negatives is a MIN)


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    """Minus the first index where ``flags`` holds, or minus :data:`_NONE`."""
    found = torch.nonzero(flags)
    return torch.tensor(-float(found[0, 0]) if len(found) else -float(_NONE), dtype=torch.float64)


def _pieces(digest: str) -> list[float]:
    """The first 64 bits of a hex digest as four 16-bit integers (exact in float64)."""
    return [float(int(digest[i : i + 4], 16)) for i in range(0, 4 * _PIECES, 4)]
