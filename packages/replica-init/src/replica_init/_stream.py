"""Stream rank 0's whole tensors into every rank's shards, a bounded bucket at a time.

What torch's ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``
does, with its per-tensor broadcast replaced by packed buckets: a model of thousands of small
tensors pays one collective per bucket instead of one per tensor, and no bucket holds more
than its bound (a larger tensor goes alone). Each rank keeps only its own part of each
tensor, cut by torch's ``distribute_tensor`` (no communication) on the parameter's own mesh
and placements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

STREAM_BUCKET_BYTES = 32 * 2**20
"""The largest packed buffer of the stream from rank 0 into the shards (a larger tensor goes
alone): each rank holds at most one such buffer beside its shards. See
:func:`stream_bucket_bytes` for the bound on small models."""


def stream_bucket_bytes(model_bytes: int, world_size: int) -> int:
    """The stream's bucket bound for a model of ``model_bytes`` on ``world_size`` ranks.

    :data:`STREAM_BUCKET_BYTES`, or half of one rank's share of the model if that is less, so
    that a rank's shards plus the bucket in transit stay below the whole model even for a
    small model on few ranks (a tensor larger than the bound still travels alone).
    """
    return max(1, min(STREAM_BUCKET_BYTES, model_bytes // (2 * max(1, world_size))))


def stream_from_rank0(
    targets: Sequence[tuple[str, torch.Tensor]],
    full: Mapping[str, torch.Tensor] | None,
    device: torch.device,
    *,
    bucket_bytes: int = STREAM_BUCKET_BYTES,
) -> None:
    """Overwrite every rank's ``targets`` with their part of rank 0's whole tensors.

    Args:
        targets: Every rank's ``(name, tensor)`` to fill, in the same order on every rank
            (:func:`stream_targets`): sharded ``DTensor`` parameters (filled with this rank's
            part) or plain tensors (filled whole). Rank 0's are left as they are: they were
            cut from the tensors it sends.
        full: On rank 0, each target's name -> the whole tensor (any device); ``None``
            elsewhere.
        device: Where the packed buckets travel (this rank's device).
        bucket_bytes: The largest packed buffer.
    """
    if dist.get_world_size() == 1:
        return  # rank 0's shards were cut from the tensors it would send: nothing to copy
    sending = dist.get_rank() == 0
    with torch.no_grad():
        for bucket in _buckets([tensor for _, tensor in targets], bucket_bytes):
            named = [targets[index] for index in bucket]
            dtype = named[0][1].dtype
            if sending:
                assert full is not None
                parts = [full[name].detach().reshape(-1) for name, _ in named]
                flat = parts[0] if len(parts) == 1 else torch.cat(parts)
                flat = flat.to(device=device, dtype=dtype)
            else:
                numel = sum(tensor.numel() for _, tensor in named)  # a DTensor's is global
                flat = torch.empty(numel, dtype=dtype, device=device)
            dist.broadcast(flat, src=0)
            if not sending:
                offset = 0
                for _, target in named:
                    whole = flat[offset : offset + target.numel()].view(target.shape)
                    offset += target.numel()
                    _fill(target, whole)
            del flat


def stream_targets(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every parameter and buffer of ``model``, each once, by name.

    Tied tensors appear once (under their first name in sorted order); the order is the same
    on every rank that holds the same structure, sharded or not.
    """
    entries: list[tuple[str, torch.Tensor]] = [*model.named_parameters(remove_duplicate=False)]
    entries += [*model.named_buffers(remove_duplicate=False)]
    seen: set[int] = set()
    unique: list[tuple[str, torch.Tensor]] = []
    for name, tensor in sorted(entries, key=lambda entry: entry[0]):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique.append((name, tensor))
    return unique


def _fill(target: torch.Tensor, whole: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        part = distribute_tensor(
            whole, target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
        target.to_local().copy_(part)
    else:
        target.copy_(whole)


def _buckets(targets: Sequence[torch.Tensor], limit: int) -> list[list[int]]:
    """Consecutive runs of same-dtype targets, each run's whole bytes within ``limit``."""
    buckets: list[list[int]] = []
    used = 0
    for index, tensor in enumerate(targets):
        size = tensor.numel() * tensor.element_size()
        if buckets and targets[buckets[-1][0]].dtype == tensor.dtype and used + size <= limit:
            buckets[-1].append(index)
            used += size
        else:
            buckets.append([index])
            used = size
    return buckets
