"""Torch-version differences for replica-init, kept in one place."""

from __future__ import annotations

import torch.distributed as dist


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (the default group when ``None``)."""
    if group is None:
        return group_rank
    return int(dist.get_global_rank(group, group_rank))
