"""Losses over variable-length data: normalised by the global count of items, any strategy.

With padding and variable lengths, ``loss.mean()`` on each rank, averaged by the gradient
reduction and divided by the accumulation steps, weights each token by the inverse of its own
micro-batch's token count: the gradient then depends on how the global batch was split, so
it changes with the world size and the accumulation. :func:`global_count` counts the items of
the whole global batch once per step; :func:`count_mean` turns each micro-batch's summed loss
into the loss whose stepped gradient is that of ``sum(item losses) / global count``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dist_core import fsdp_modules, strategy_of, unwrap_compiled

__all__ = ["count_mean", "data_parallel_size", "global_count"]


def global_count(counts: Any, *, model: nn.Module) -> torch.Tensor:
    """The number of items (tokens, frames, valid positions) in this step's global batch.

    The sum of ``counts`` over this step's micro-batches and over every data-parallel rank of
    ``model``: one all-reduce per step, on the model's data-parallel group (DDP's process
    group; FSDP's mesh; HSDP's whole mesh, both dimensions). Collective: every rank of that
    group calls it once per optimizer step, before the micro-batches' backwards.

    Args:
        counts: This rank's count: a number, a tensor (summed), or an iterable of them, one
            per micro-batch of the step.
        model: The model as the trainer holds it (plain, DDP, FSDP, HSDP, compiled).

    Returns:
        A scalar tensor, the same on every rank: ``int64`` when every count is an integer,
        else ``float64``; on the group's device.

    Raises:
        TypeError: If ``counts`` holds something that is not a number or a tensor.
        ValueError: If a count is negative or not finite.
    """
    local = _local_sum(counts)
    group, device = _reduction(model)
    total = torch.tensor(local, dtype=torch.int64 if isinstance(local, int) else torch.float64)
    if group is None:
        return total
    total = total.to(device)
    for part in group:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=part)
    return total


def count_mean(loss_sum: torch.Tensor, global_count: Any, *, model: nn.Module) -> torch.Tensor:
    """The loss to call backward on: ``loss_sum / global_count``, scaled for the reduction.

    ``loss_sum`` is the sum of this micro-batch's item losses (``reduction="sum"``, masked).
    The strategies average the gradients over their data-parallel ranks (DDP's mean over
    ranks, FSDP's reduce-scatter, HSDP's over both dimensions), so the loss is multiplied by
    that number of ranks; gradients accumulated under :func:`~grad_sync.no_sync` add up before
    the one reduction. After the optimizer step the gradient is then that of
    ``sum(item losses of the global batch) / global count``, whatever the world size, the
    strategy and the accumulation.

    Args:
        loss_sum: This micro-batch's summed item losses (a scalar tensor).
        global_count: :func:`global_count`'s result for this step (or the same number).
        model: The model as the trainer holds it.

    Returns:
        The scaled loss (a scalar tensor in ``loss_sum``'s dtype).

    Raises:
        TypeError: If ``loss_sum`` is not a tensor.
        ValueError: If the global count is zero (no item in the whole global batch: skip the
            step), negative or not finite.
    """
    if not isinstance(loss_sum, torch.Tensor):
        raise TypeError(
            f"loss_sum must be a tensor (the summed item losses), got {type(loss_sum).__name__}"
        )
    count = float(global_count.item() if isinstance(global_count, torch.Tensor) else global_count)
    if count == 0:
        raise ValueError(
            "global_count is 0: no item (token) in this step's global batch on any rank; skip "
            "the step (or its optimizer step) rather than dividing by zero"
        )
    if not math.isfinite(count) or count < 0:
        raise ValueError(f"global_count must be a positive finite number, got {count!r}")
    return loss_sum * (data_parallel_size(model) / count)


def data_parallel_size(model: nn.Module) -> int:
    """The number of ranks the model's gradient reduction averages over (1 for a plain model)."""
    group, _ = _reduction(model)
    if group is None:
        return 1
    size = 1
    for part in group:
        size *= dist.get_world_size(part)
    return size


def _local_sum(counts: Any) -> int | float:
    items: Iterable[Any]
    if isinstance(counts, torch.Tensor | numbers.Number):  # a bool too: refused below
        items = [counts]
    elif isinstance(counts, Iterable) and not isinstance(counts, str | bytes):
        items = list(counts)
    else:
        raise TypeError(
            f"counts must be a number, a tensor or an iterable of them (one per micro-batch), "
            f"got {type(counts).__name__}"
        )
    total: int | float = 0
    for item in items:
        value: int | float
        if isinstance(item, bool):
            raise TypeError(f"counts holds a bool ({item!r}); each count must be a number")
        if isinstance(item, torch.Tensor):
            whole = not item.is_floating_point() and not item.is_complex()
            value = int(item.sum().item()) if whole else float(item.sum().item())
        elif isinstance(item, int):
            value = item
        elif isinstance(item, numbers.Real):
            value = float(item)
        else:
            raise TypeError(
                f"counts holds a {type(item).__name__}; each count must be a number or a tensor"
            )
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"counts must be finite and >= 0, got {value!r}")
        total += value
    return total


def _reduction(model: nn.Module) -> tuple[list[dist.ProcessGroup | None] | None, torch.device]:
    """The groups the model's gradient reduction spans, and the device a collective takes.

    ``None`` for the groups: no reduction (a plain model, or FSDP without a mesh).
    """
    strategy = strategy_of(model)
    if strategy == "ddp":
        ddp = unwrap_compiled(model)
        group = getattr(ddp, "process_group", None)
        device = next((p.device for p in ddp.parameters()), torch.device("cpu"))
        return [group], _backend_device(group, device)
    if strategy in ("fsdp", "hsdp") and fsdp_modules(model):
        mesh = _mesh(model)
        if mesh is None:
            return None, torch.device("cpu")
        device = torch.device(mesh.device_type)
        if device.type != "cpu":
            index = torch.get_device_module(device.type).current_device()
            device = torch.device(device.type, index)
        if mesh.size() == dist.get_world_size():
            return [None], device  # one all-reduce over every rank
        return [mesh.get_group(dim) for dim in range(mesh.ndim)], device
    return None, torch.device("cpu")


def _mesh(model: nn.Module) -> DeviceMesh | None:
    for param in model.parameters():
        if isinstance(param, DTensor):
            return param.device_mesh
    return None


def _backend_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """The parameters' device where the group's backend needs it (NCCL), else the host."""
    backend = dist.get_backend(group)
    if device.type != "cpu" and "gloo" not in str(backend):
        return device
    return torch.device("cpu")
