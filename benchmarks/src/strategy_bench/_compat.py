"""The private torch APIs that ``strategy-bench estimate`` needs, in one place.

torch ships a fake process-group backend (every collective returns at once, no peer) and
fake tensors (shapes, dtypes and devices without storage) under private module paths; both
are what torch's own estimators use (``torch.distributed._tools``, torchtitan's memory
estimator). Should they move, only this module changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["FakeTensorMode", "fake_process_group", "storage_key"]


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """Be rank 0 of a fake default process group of ``world_size`` ranks while the block runs.

    Collectives on it complete immediately without moving data, so a model can be wrapped
    (and stepped on fake tensors) as one rank of a world that does not exist.

    Raises:
        RuntimeError: If a process group is already initialized in this process.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "strategy-bench estimate runs under a fake process group of its own; a process "
            "group is already initialized in this process (run the estimate in a fresh process)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def storage_key(tensor: torch.Tensor) -> int:
    """An identity for ``tensor``'s storage, valid while the storage lives (real, meta or fake)."""
    return int(StorageWeakRef(tensor.untyped_storage()).cdata)  # type: ignore[no-untyped-call]
