"""Process-group facts every stage needs: is there a group, this rank, rank-0 logging."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether the default process group is initialized in this process."""
    return dist.is_available() and dist.is_initialized()


def require_process_group(caller: str, *, instead: str = "") -> None:
    """Raise unless the default process group is initialized.

    Args:
        caller: The public function named in the message, e.g. ``"wrap_module_ddp"``.
        instead: An alternative to suggest, appended to the message (``"or use source='local'"``).

    Raises:
        RuntimeError: ``"<caller> requires an initialized process group; ..."``.
    """
    if not is_distributed():
        tail = f", {instead}" if instead else ""
        raise RuntimeError(
            f"{caller} requires an initialized process group; call "
            "torch.distributed.init_process_group() (e.g. under torchrun) first" + tail
        )


def bound_device(group: dist.ProcessGroup | None = None) -> torch.device | None:
    """The device ``group`` (``None``: the default group) was bound to, or ``None``.

    ``init_process_group(device_id=...)`` binds the default group to this rank's device; an
    object collective under NCCL stages on the current device, which must then be that one
    (a rank whose current device is wrong would otherwise hang or fail in it).
    """
    if not is_distributed():
        return None
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    return bound if isinstance(bound, torch.device) else None


def names_nccl(backend: str) -> bool:
    """Whether a backend string uses NCCL: ``"nccl"`` or a per-device ``"cpu:gloo,cuda:nccl"``."""
    return any(part.rpartition(":")[2].strip().lower() == "nccl" for part in backend.split(","))


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor collective on ``group`` takes its tensors.

    This rank's current CUDA device under a backend that names NCCL, else the host. Host
    tensors (a CPU-offloaded shard) are copied there first: an NCCL group refuses them.
    """
    if names_nccl(str(dist.get_backend(group))) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank() -> int:
    """This process's rank in the default group; ``0`` without a group."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The default group's size; ``1`` without a group."""
    return dist.get_world_size() if is_distributed() else 1


def log_rank0(logger: logging.Logger, level: int, message: str, *args: Any) -> None:
    """Log once per job: on rank 0 of the default group (or in a process without a group).

    Every stage logs its one summary line through this, so a 64-rank job prints it once.
    Arguments are formatted lazily, as with ``logger.log``.
    """
    if rank() == 0:
        logger.log(level, message, *args)
