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
from torch.utils.weak import WeakTensorKeyDictionary

from dist_core import (
    all_reduce_agreed,
    collective_device,
    fsdp_mesh,
    fsdp_modules,
    mesh_device,
    replica_reduce,
    strategy_of,
    unwrap_compiled,
)

__all__ = ["count_mean", "data_parallel_size", "global_count"]


EXACT_LIMIT = 2**53
"""Counts are reduced in ``float64``, exact for every whole number up to this (a step with
more items is refused rather than rounded)."""

_VALIDATED: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
""":func:`global_count`'s results and their values: :func:`count_mean` reads a count it made
without a host sync (one per micro-batch otherwise, under CUDA)."""


def global_count(counts: Any, *, model: nn.Module) -> torch.Tensor:
    """The number of items (tokens, frames, valid positions) in this step's global batch.

    The sum of ``counts`` over this step's micro-batches and over every data-parallel rank of
    ``model``: one all-reduce per step, on the model's data-parallel group (DDP's process
    group; FSDP's mesh; HSDP's whole mesh, both dimensions), then over the live replica groups
    under fault tolerance (only the tokens of the groups that train this step). Collective:
    every rank of that group calls it once per optimizer step, before the micro-batches'
    backwards.

    Every count is summed in ``float64`` whatever its type (a ``bfloat16`` mask of 1,001 ones
    counts 1,001), and the ranks' sums are reduced in ``float64`` too, so the result is exact
    and the same on every rank whatever mix of ints, floats, NumPy numbers, tensors and empty
    lists the ranks pass. A bad count on one rank is found before the all-reduce and travels
    in it: every rank raises, none waits for the timeout.

    Args:
        counts: This rank's count: a number, a tensor (summed; a mask of any dtype), or an
            iterable of them, one per micro-batch of the step (empty: 0).
        model: The model as the trainer holds it (plain, DDP, FSDP, HSDP, compiled).

    Returns:
        A scalar tensor, the same on every rank: ``int64`` when every rank's counts are of
        integer types (ints, integer or bool tensors), else ``float64``; on the group's device.

    Raises:
        TypeError: If ``counts`` holds something that is not a number or a tensor (a bool, a
            string, a complex tensor).
        ValueError: If a count is negative or not finite, or the total is past
            :data:`EXACT_LIMIT`; on the other ranks, if any rank's counts were refused.
    """
    groups, device = _reduction(model)
    error: Exception | None = None
    local = torch.zeros(3, dtype=torch.float64, device=device)
    try:
        local = _local_sum(counts, device)
    except (TypeError, ValueError) as caught:
        error = caught
    if groups is None:
        if error is not None:
            raise error
        total, floats, bad = local.tolist()
    else:
        across = replica_reduce(model)
        total, floats, bad = all_reduce_agreed(local, error, "global_count", groups, across=across)
    if bad:
        mine = int(local[2].item()) if error is None else 0
        raise ValueError(
            "counts must be finite and >= 0: a tensor count "
            + ("on this rank" if mine else "on another rank")
            + f" summed to a negative or non-finite value (global sum {total!r}); check the "
            "masks that make the counts"
        )
    if total > EXACT_LIMIT:
        raise ValueError(
            f"global_count: the step's count {total:.6g} is past 2**53, where float64 stops "
            "counting exactly; count in larger units (sequences rather than tokens)"
        )
    result = torch.tensor(total, dtype=torch.float64 if floats else torch.int64, device=device)
    _VALIDATED[result] = total
    return result


def count_mean(loss_sum: torch.Tensor, global_count: Any, *, model: nn.Module) -> torch.Tensor:
    """The loss to call backward on: ``loss_sum / global_count``, scaled for the reduction.

    ``loss_sum`` is the sum of this micro-batch's item losses (``reduction="sum"``, masked).
    The strategies average the gradients over their data-parallel ranks (DDP's mean over
    ranks, FSDP's reduce-scatter, HSDP's over both dimensions), so the loss is multiplied by
    that number of ranks; gradients accumulated under :func:`~grad_sync.no_sync` add up before
    the one reduction. After the optimizer step the gradient is then that of
    ``sum(item losses of the global batch) / global count``, whatever the world size, the
    strategy and the accumulation. A count made by :func:`global_count` is read without a host
    sync; any other tensor costs one.

    Args:
        loss_sum: This micro-batch's summed item losses (a 0-dim floating-point tensor).
        global_count: :func:`global_count`'s result for this step (or the same number).
        model: The model as the trainer holds it.

    Returns:
        The scaled loss (a scalar tensor in ``loss_sum``'s dtype).

    Raises:
        TypeError: If ``loss_sum`` is not a 0-dim floating-point tensor, or ``global_count``
            is not a number or a one-element tensor (a bool or a string).
        ValueError: If the global count is zero (no item in the whole global batch: skip the
            step), negative, not finite, or so small that the scale overflows.
    """
    if not isinstance(loss_sum, torch.Tensor):
        raise TypeError(
            f"loss_sum must be a tensor (the summed item losses), got {type(loss_sum).__name__}"
        )
    if loss_sum.dim() != 0 or not loss_sum.is_floating_point():
        raise TypeError(
            f"loss_sum must be a 0-dim floating-point tensor (the micro-batch's summed item "
            f"losses), got shape {tuple(loss_sum.shape)} of {loss_sum.dtype}; sum it first "
            "(loss.sum())"
        )
    count = _count_value(global_count)
    if count == 0:
        raise ValueError(
            "global_count is 0: no item (token) in this step's global batch on any rank; skip "
            "the step (or its optimizer step) rather than dividing by zero"
        )
    if not math.isfinite(count) or count < 0:
        raise ValueError(f"global_count must be a positive finite number, got {count!r}")
    scale = data_parallel_size(model) / count
    if not math.isfinite(scale):
        raise ValueError(
            f"global_count {count!r} is too small: the loss scale 1/count overflows; pass "
            "the number of items (at least 1 for a whole count)"
        )
    return loss_sum * scale


def data_parallel_size(model: nn.Module) -> int:
    """The number of ranks the model's gradient reduction averages over (1 for a plain model).

    Under fault tolerance, the ranks of this step's live replica groups: a group's ranks times
    the live groups.
    """
    group, _ = _reduction(model)
    if group is None:
        return 1
    size = 1
    for part in group:
        size *= dist.get_world_size(part)
    across = replica_reduce(model)
    return size if across is None else size * across.live()


def _count_value(global_count: Any) -> float:
    """``global_count`` as a float: :func:`global_count`'s own results without a host sync."""
    if isinstance(global_count, torch.Tensor):
        known = _VALIDATED.get(global_count)  # type: ignore[no-untyped-call]
        if known is not None:
            return float(known)
        if global_count.numel() != 1 or global_count.dtype == torch.bool:
            raise TypeError(
                f"global_count must be a one-element numeric tensor (global_count()'s result), "
                f"got shape {tuple(global_count.shape)} of {global_count.dtype}"
            )
        return float(global_count.item())
    if isinstance(global_count, bool) or not isinstance(global_count, numbers.Real):
        raise TypeError(
            f"global_count must be global_count()'s result or a number, got "
            f"{type(global_count).__name__} ({global_count!r})"
        )
    return float(global_count)


def _local_sum(counts: Any, device: torch.device) -> torch.Tensor:
    """This rank's ``[sum, any float count, bad tensor counts]``, in ``float64`` on ``device``.

    Numbers are checked here; a tensor's sum is checked on its device (no host sync) and the
    verdict travels with the reduction.
    """
    items: list[Any]
    if isinstance(counts, torch.Tensor | numbers.Number):  # a bool too: refused below
        items = [counts]
    elif isinstance(counts, Iterable) and not isinstance(counts, str | bytes):
        items = list(counts)
    else:
        raise TypeError(
            f"counts must be a number, a tensor or an iterable of them (one per micro-batch), "
            f"got {type(counts).__name__}"
        )
    whole = 0
    fractions: list[float] = []
    sums: list[torch.Tensor] = []
    floats = False
    for item in items:
        if isinstance(item, bool):
            raise TypeError(f"counts holds a bool ({item!r}); each count must be a number")
        if isinstance(item, torch.Tensor):
            if item.is_complex():
                raise TypeError(f"counts holds a complex tensor ({item.dtype}); counts are real")
            floats = floats or item.is_floating_point()
            sums.append(item.sum(dtype=torch.float64).to(device))
            continue
        if isinstance(item, numbers.Integral):
            value = int(item)
            if value < 0:
                raise ValueError(f"counts must be finite and >= 0, got {value!r}")
            if value > EXACT_LIMIT:
                raise ValueError(f"counts must be at most 2**53 (exact in float64), got {value}")
            whole += value
        elif isinstance(item, numbers.Real):
            number = float(item)
            if not math.isfinite(number) or number < 0:
                raise ValueError(f"counts must be finite and >= 0, got {number!r}")
            floats = True
            fractions.append(number)
        else:
            raise TypeError(
                f"counts holds a {type(item).__name__}; each count must be a number or a tensor"
            )
    host = float(whole) + math.fsum(fractions)
    local = torch.tensor([host, float(floats), 0.0], dtype=torch.float64, device=device)
    if sums:
        stacked = torch.stack(sums)
        bad = (~torch.isfinite(stacked) | (stacked < 0)).sum(dtype=torch.float64)
        # NOTE: a bad tensor's value is kept out of the sum, so the flag, not a NaN, reports it.
        local[0] += torch.where(torch.isfinite(stacked), stacked, 0.0).sum()
        local[2] += bad
    return local


def _reduction(model: nn.Module) -> tuple[list[dist.ProcessGroup | None] | None, torch.device]:
    """The groups the model's gradient reduction spans, and the device a collective takes.

    ``None`` for the groups: no reduction (a plain model, or FSDP without a mesh).
    """
    strategy = strategy_of(model)
    if strategy == "ddp":
        ddp = unwrap_compiled(model)
        group = getattr(ddp, "process_group", None)
        return [group], collective_device(group)
    if strategy in ("fsdp", "hsdp") and fsdp_modules(model):
        mesh = fsdp_mesh(model)
        if mesh is None:
            return None, torch.device("cpu")
        device = mesh_device(mesh)
        if mesh.size() == dist.get_world_size():
            return [None], device  # one all-reduce over every rank
        return [mesh.get_group(dim) for dim in range(mesh.ndim)], device
    return None, torch.device("cpu")
