"""Torch-version differences for ddp-wrap, kept in one place."""

from __future__ import annotations

import inspect
import warnings
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

_DDP = TypeVar("_DDP", bound=DistributedDataParallel)

# torch 2.13 deprecates ``broadcast_buffers`` in favour of ``forward_sync_buffers``, whose
# ``False`` still syncs buffers at init. The reference semantics (no buffer sync at init nor
# in forward) are still only reachable through ``broadcast_buffers=False``.
HAS_FORWARD_SYNC_BUFFERS = (
    "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
)
_DEPRECATION = r"`broadcast_buffers` is deprecated"


def construct_ddp(
    cls: type[_DDP], module: nn.Module, *, broadcast_buffers: bool, **kwargs: Any
) -> _DDP:
    """Construct ``cls(module, ...)`` with the reference buffer semantics and no warning.

    ``broadcast_buffers=False``: buffers are synced neither at init nor before each forward.
    ``broadcast_buffers=True``: synced at init and before each forward.
    """
    if not HAS_FORWARD_SYNC_BUFFERS:
        return cls(module, broadcast_buffers=broadcast_buffers, **kwargs)
    if broadcast_buffers:
        return cls(module, forward_sync_buffers=True, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATION, category=FutureWarning)
        return cls(module, broadcast_buffers=False, **kwargs)


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass in this thread.

    Activation checkpointing recomputes forwards there, under grad, outside DDP's forward.
    torch has no public spelling of this; without the private one, report ``False``.
    """
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1
