"""Torch-version differences for replica-init, kept in one place."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (the default group when ``None``)."""
    if group is None:
        return group_rank
    return int(dist.get_global_rank(group, group_rank))


def cpu_construction() -> contextlib.AbstractContextManager[object]:
    """A context in which tensor factories allocate on CPU.

    ``torch.device("cpu")`` as a context installs a torch-function mode that every factory
    call of the constructor goes through (about 5% of a small model's construction time), so
    it is entered only when an outer default device (``torch.set_default_device``) is not CPU.
    """
    get_default = getattr(torch, "get_default_device", None)  # torch >= 2.3
    if get_default is not None and get_default().type == "cpu":
        return contextlib.nullcontext()
    return torch.device("cpu")
