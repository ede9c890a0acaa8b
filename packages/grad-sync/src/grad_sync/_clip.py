"""``clip_grad_norm``: the whole model's gradient norm, the same on every rank and strategy."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dist_core import mesh_device


def clip_grad_norm(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``model`` in place to a total norm of ``max_norm``.

    The total norm is over the gradients of the whole model, whatever the strategy: under
    FSDP2 each rank holds a shard of each gradient (a ``DTensor``), and the shards' norms are
    reduced across the ranks before clipping, so every rank returns and clips with the same
    value; under DDP (after the reduction) and in a single process that saw the global batch
    the gradients are whole, and the norm is the same (to floating-point tolerance).

    Args:
        model: The model as the trainer holds it (plain, DDP, FSDP2, compiled).
        max_norm: The largest allowed total norm (> 0).
        norm_type: The p of the p-norm: a float > 0, or ``math.inf`` / ``"inf"``.
        error_if_nonfinite: Raise if the total norm is nan or inf (as in torch); otherwise
            the non-finite norm is returned and the gradients are scaled as torch does.
        foreach: Use the faster foreach kernels (``None``: torch's default for the device).

    Returns:
        The total norm before clipping, a scalar tensor (a plain tensor under every strategy).

    Raises:
        TypeError: If ``model`` is not a module.
        ValueError: If ``max_norm`` or ``norm_type`` is out of range.
        RuntimeError: If ``error_if_nonfinite`` and the total norm is not finite.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"clip_grad_norm needs an nn.Module, got {type(model).__name__}")
    p = _check_norm_type(norm_type)
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}; e.g. 1.0")
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for param in model.parameters():  # one walk; .grad is read once per parameter
        grad = param.grad
        if grad is not None:
            params.append(param)
            grads.append(grad)
    if not params:
        return torch.tensor(0.0)
    total = _total_norm(grads, p, foreach)
    # torch's own norm of sharded gradients is a replicated DTensor: every rank's value, read
    # without communication; the clip takes the DTensor itself, as raw FSDP2's does
    full = total.full_tensor() if isinstance(total, DTensor) else total
    if error_if_nonfinite and not bool(torch.isfinite(full)):  # before any gradient changes
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients of {type(model).__name__} is "
            f"non-finite ({full.item()}), so it cannot be clipped; look for the nan/inf "
            "gradient, or pass error_if_nonfinite=False to get the norm back without an error"
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return full


def _total_norm(grads: list[torch.Tensor], p: float, foreach: bool | None) -> torch.Tensor:
    """The p-norm of all ``grads`` together; sharded (``DTensor``) ones reduced over their mesh.

    Whole gradients go through torch's ``get_total_norm``, and so do sharded ones where it can
    take them (:func:`_torch_reduces`; a finite p): a replicated ``DTensor`` comes back.
    Otherwise sharded ones are grouped by mesh and sharded dimensions: each rank takes the norm
    of its local shards (empty ones left out), and the p-th powers (or, for ``inf``, the
    maxima) are all-reduced over the mesh dimensions they are sharded on. (torch's
    ``get_total_norm`` on the ``DTensor``s themselves fails for the inf norm when a rank's
    shard is empty, as FSDP2's shards of small tensors are.)
    """
    inf = math.isinf(p)
    whole: list[torch.Tensor] = []
    sharded: dict[tuple[Any, tuple[int, ...]], list[torch.Tensor]] = {}
    for grad in grads:
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            whole.append(grad.full_tensor())  # rare: a reduction still pending
        elif isinstance(grad, DTensor):
            dims = tuple(i for i, pl in enumerate(grad.placements) if pl.is_shard())
            sharded.setdefault((grad.device_mesh, dims), []).append(grad.to_local())
        else:
            whole.append(grad)
    if not sharded:  # DDP, one process: torch's own computation, nothing added
        return torch.nn.utils.get_total_norm(whole, p, False, foreach)
    if not whole and not inf and _torch_reduces(sharded):
        # NOTE: torch's own norm of the DTensor gradients, so that the clip (and the weights)
        # are bit-identical to raw FSDP2's clip_grad_norm_; the reduction below differs from
        # it in the last bit on some steps (its per-rank sums are added in another order).
        return torch.nn.utils.get_total_norm(grads, p, False, foreach)
    device = next(iter(sharded.values()))[0].device
    total = _power(whole, p, foreach, device)
    for (mesh, dims), local in sharded.items():
        part = _power(local, p, foreach, device)
        reduced = part.to(reduce_device(mesh, part.device))  # a scalar: nothing to speak of
        for dim in dims:
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            dist.all_reduce(reduced, op=op, group=mesh.get_group(dim))
        part = reduced.to(device)
        total = torch.maximum(total, part) if inf else total + part
    return total if inf else total.pow(1.0 / p)


def _torch_reduces(sharded: dict[tuple[Any, tuple[int, ...]], list[torch.Tensor]]) -> bool:
    """Whether torch's ``get_total_norm`` can take these ``DTensor`` gradients as they are.

    One mesh and sharding, and the shards on the mesh's device type (an offloaded host shard
    over an NCCL mesh is refused by the group: :func:`reduce_device` moves its scalar).

    NOTE: every rank must answer alike, or the ranks would enter different collectives: so
    nothing here reads a rank's own shard sizes (empty shards differ across ranks; they only
    matter to the inf norm, which never comes here). The mesh, the sharding and the offload
    are the same wrap on every rank.
    """
    if len(sharded) != 1:
        return False
    ((mesh, _), local) = next(iter(sharded.items()))
    device_type = str(mesh.device_type)
    return all(t.device.type == device_type for t in local)


def reduce_device(mesh: Any, where: torch.device) -> torch.device:
    """Where the norm of shards held at ``where`` is all-reduced over ``mesh``: its device type.

    FSDP2's CPU offload keeps the shards (and their gradients) in host memory while the mesh,
    and so its process group, is CUDA's: an NCCL group refuses host tensors (pytorch/pytorch
    148532). The partial norm is a scalar, so it goes to this rank's device of the mesh's type
    for the reduction; on a CPU mesh it stays where it is.
    """
    return where if where.type == str(mesh.device_type) else mesh_device(mesh)


def _power(
    tensors: list[torch.Tensor], p: float, foreach: bool | None, device: Any
) -> torch.Tensor:
    """``max |t|`` over ``tensors`` for the inf norm, else ``sum |t|^p``; 0 when all are empty."""
    present = [t for t in tensors if t.numel() > 0]
    if not present:
        return torch.zeros((), device=device)
    norm = torch.nn.utils.get_total_norm(present, p, False, foreach).to(device)
    return norm if math.isinf(p) else norm.pow(p)


def _check_norm_type(norm_type: object) -> float:
    if isinstance(norm_type, str) and norm_type.strip().lower() == "inf":
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, int | float) or not norm_type > 0:
        raise ValueError(
            f"norm_type must be a positive number or 'inf', got {norm_type!r}; e.g. 2.0"
        )
    return float(norm_type)
