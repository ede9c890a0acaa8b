"""Replica groups beyond the process group: a reduction across groups that another engine runs.

Under torchft each replica group is its own job with its own process group, and the groups
meet through torchft's ``Manager``. A model wrapped that way carries a :class:`ReplicaReduce`:
whatever sums over the model's data-parallel ranks (``global_count``, ``data_parallel_size``)
sums over the live groups after its own process group, and ``replica_drift`` compares the
groups as well as the ranks.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch import nn

from dist_core._wrapped import unwrap_compiled


class ReplicaReduce(Protocol):
    """The reduction across replica groups (the same call on every rank of every live group)."""

    def sum_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over this step's live replica groups (on any device).

        A reduction that fails (a peer died mid-call) leaves this group's own values.
        """

    def live(self) -> int:
        """The replica groups in this step."""

    def position(self) -> int:
        """This group's place among this step's live groups, ``0 .. live() - 1``."""

    def replica_id(self) -> int:
        """This group's id (the same on every rank of the group)."""


_ACROSS: weakref.WeakKeyDictionary[nn.Module, ReplicaReduce] = weakref.WeakKeyDictionary()


def set_replica_reduce(model: nn.Module, reduce: ReplicaReduce) -> None:
    """Make ``model``'s data-parallel sums span the replica groups ``reduce`` joins."""
    _ACROSS[unwrap_compiled(model)] = reduce


def replica_reduce(model: nn.Module) -> ReplicaReduce | None:
    """The reduction across ``model``'s replica groups, or ``None`` (one group: the usual case)."""
    return _ACROSS.get(unwrap_compiled(model))
