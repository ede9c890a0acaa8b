"""Broadcast a model's tensors in few collectives: same-dtype tensors packed into buckets."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

BROADCAST_BUCKET_BYTES = 128 * 2**20
"""The largest packed buffer of a coalesced broadcast (``source="rank0"`` full replicas): each
rank holds one such temporary copy at a time."""


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    *,
    src: int,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = BROADCAST_BUCKET_BYTES,
) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, bucket by bucket.

    Tensors of one dtype and device are packed into flat buffers of at most ``bucket_bytes``
    (a larger tensor goes alone, as it is): one collective per bucket instead of one per
    tensor, which is what a model of thousands of small tensors needs (NCCL and gloo each pay a
    fixed cost per call). The bits are those of a per-tensor broadcast.

    Args:
        tensors: The tensors to overwrite in place (the same shapes and dtypes on every rank,
            in the same order).
        src: The global rank whose values everyone receives.
        group: The process group; ``None`` is the default group.
        bucket_bytes: The largest packed buffer.
    """
    sending = dist.get_rank() == src
    with torch.no_grad():
        for bucket in _buckets(tensors, bucket_bytes):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                dist.broadcast(bucket[0], src=src, group=group)
                continue
            if sending:
                flat = torch.cat([tensor.reshape(-1) for tensor in bucket])
            else:
                numel = sum(tensor.numel() for tensor in bucket)
                flat = torch.empty(numel, dtype=bucket[0].dtype, device=bucket[0].device)
            dist.broadcast(flat, src=src, group=group)
            if not sending:
                offset = 0
                for tensor in bucket:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of tensors that share dtype and device, each run within ``limit``."""
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    for tensor in tensors:
        kind = (tensor.dtype, tensor.device)
        size = tensor.numel() * tensor.element_size()
        bucket, used = open_buckets.get(kind, ([], 0))
        if bucket and used + size > limit:
            yield bucket
            bucket, used = [], 0
        bucket.append(tensor)
        open_buckets[kind] = (bucket, used + size)
    for bucket, _ in open_buckets.values():
        if bucket:
            yield bucket
