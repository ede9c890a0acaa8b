"""``wrap_module_ddp`` and the unwrap helpers."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_wrap import _compat
from ddp_wrap._delegate import DelegatingDistributedDataParallel
from dist_core import DeviceLike, check_wrap_preconditions, log_rank0

logger = logging.getLogger(__name__)

# Arguments that wrap_module_ddp sets itself.
_RESERVED = {
    "device_ids": "device",
    "output_device": "device",
    "forward_sync_buffers": "broadcast_buffers",
    "module": "the first argument",
}


def wrap_module_ddp(
    module: nn.Module,
    *,
    device: DeviceLike,
    broadcast_buffers: bool = False,
    forward_methods: Iterable[str] = (),
    check_trainable: bool = True,
    detect_bypass: bool = True,
    **ddp_kwargs: Any,
) -> DelegatingDistributedDataParallel:
    """Wrap ``module`` in :class:`DelegatingDistributedDataParallel` once its preconditions hold.

    Checks, in this order: the process group is initialized (``RuntimeError``); at least one
    parameter is trainable (``ValueError``); a CUDA ``device`` has a concrete index
    (``ValueError``); every parameter is on ``device`` (``ValueError`` naming the first one that
    is not). A CUDA device gets ``device_ids=[index]`` and ``output_device=index``; a CPU device
    (gloo) gets neither.

    Args:
        module: The model, already on ``device``, with its trainable policy applied.
        device: This rank's device: ``torch.device``, string, or int (CUDA index).
        broadcast_buffers: ``False`` (the reference): buffers are synced neither at init nor
            before each forward. ``True``: synced from rank 0 at init and before each forward.
        forward_methods: Methods of ``module`` to route through DDP's forward.
        check_trainable: Raise at the next forward if the set of trainable parameters changes.
        detect_bypass: Raise when a delegated method runs a trainable submodule under grad.
        **ddp_kwargs: Passed to ``DistributedDataParallel`` (``find_unused_parameters``,
            ``gradient_as_bucket_view``, ``static_graph``, ``bucket_cap_mb``, ...).

    Returns:
        The wrapper; the model's attributes stay reachable through it.

    Raises:
        TypeError: If ``module`` is not a module, an argument has the wrong type, or
            ``ddp_kwargs`` holds an argument this function sets itself.
        RuntimeError: If the process group is not initialized.
        ValueError: See the checks above; or a forward method name is DDP's own.
        AttributeError: If a forward method name is not an attribute of ``module``.
    """
    target = check_wrap_preconditions(module, device, wrapper="wrap_module_ddp")
    for key in ddp_kwargs:
        if key in _RESERVED:
            raise TypeError(f"wrap_module_ddp sets {key!r} itself; pass {_RESERVED[key]} instead")
    if not isinstance(broadcast_buffers, bool):
        raise TypeError(f"broadcast_buffers must be a bool, got {broadcast_buffers!r}")
    names = tuple(forward_methods)  # checked by the wrapper before DDP is constructed
    if target.type == "cuda":
        ddp_kwargs = {**ddp_kwargs, "device_ids": [target.index], "output_device": target.index}
    wrapped = _compat.construct_ddp(
        DelegatingDistributedDataParallel,
        module,
        broadcast_buffers=broadcast_buffers,
        forward_methods=names,
        check_trainable=check_trainable,
        detect_bypass=detect_bypass,
        **ddp_kwargs,
    )
    if logger.isEnabledFor(logging.INFO):  # the counts walk every parameter: only if shown
        log_rank0(
            logger,
            logging.INFO,
            "wrapped %s in DDP on %s x %d rank(s): %d of %d parameters trainable, "
            "broadcast_buffers=%s, forward methods %s",
            type(module).__name__,
            target.type,
            dist.get_world_size(),
            sum(p.numel() for p in module.parameters() if p.requires_grad),
            sum(p.numel() for p in module.parameters()),
            broadcast_buffers,
            list(names),
        )
    return wrapped


def unwrap_ddp_module(module: nn.Module) -> nn.Module:
    """The DDP wrapper's ``.module``; any other module is returned as it is.

    Args:
        module: A model, wrapped in DDP or not.

    Returns:
        The wrapped module of a ``DistributedDataParallel`` (of any subclass), else ``module``.
    """
    if isinstance(module, DistributedDataParallel):
        inner: nn.Module = module.module
        return inner
    return module
