"""What the init phase holds per rank, host and device, for each build source.

The rules of the pipeline (``prepare_model``), applied to a model's sizes read on the meta
device: DDP puts a full replica on every device; FSDP never does (``source="local"``: each
rank builds the whole model on its host and moves it unit by unit, so the device holds its
shards plus one unit in transit; ``source="rank0"``: only rank 0 builds on its host, and
rank 0's tensors are streamed into the shards in bounded buckets; rank 0 also moves each unit
of its host copy as it shards it, as under "local").
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from fsdp_wrap import select_shard_targets
from replica_init import BROADCAST_BUCKET_BYTES, stream_bucket_bytes
from strategy_bench.measure import local_bytes


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """A model's sizes before it is wrapped: all its tensors, its largest tensor and unit."""

    whole: int
    largest_tensor: int
    largest_unit: int

    @classmethod
    def of(cls, model: nn.Module) -> ModelSizes:
        """Read ``model``'s sizes (meta is fine); call it before the wrap shards it."""
        tensors = _unique([*model.parameters(), *model.buffers()])
        return cls(
            whole=local_bytes(tensors),
            largest_tensor=max((local_bytes([t]) for t in tensors), default=0),
            largest_unit=largest_unit_bytes(model),
        )


def init_peaks(
    sizes: ModelSizes, strategy: str, shard_bytes: int, world_size: int
) -> dict[str, dict[str, int]]:
    """Per source, the init phase's peak bytes: ``host_rank0``, ``host_other``, ``device``.

    Args:
        sizes: The unwrapped model's sizes.
        strategy: ``"ddp"`` or ``"fsdp"``.
        shard_bytes: What one rank holds of the parameters and buffers once sharded (FSDP).
        world_size: The ranks the model is sharded over (the stream's bucket bound).

    Returns:
        ``{"local": {...}, "rank0": {...}}``, each with the host peak of rank 0 and of the
        other ranks and the device peak of a rank (tensors only: no CUDA context, no NCCL).
    """
    whole = sizes.whole
    if strategy == "ddp":
        # The other ranks receive rank 0's tensors in coalesced buckets.
        bucket = min(whole, max(sizes.largest_tensor, BROADCAST_BUCKET_BYTES))
        return {
            "local": {"host_rank0": whole, "host_other": whole, "device": whole},
            "rank0": {"host_rank0": whole, "host_other": 0, "device": whole + bucket},
        }
    return {
        "local": {
            "host_rank0": whole,
            "host_other": whole,
            "device": shard_bytes + sizes.largest_unit,
        },
        "rank0": {
            "host_rank0": whole,
            "host_other": 0,
            # Rank 0 moves each unit as it shards it (as under "local"); then every rank
            # receives the stream, one bucket (or the largest tensor) at a time.
            "device": shard_bytes
            + max(
                sizes.largest_unit,
                sizes.largest_tensor,
                stream_bucket_bytes(whole, world_size),
            ),
        },
    }


def largest_unit_bytes(model: nn.Module) -> int:
    """The bytes of the largest FSDP unit's own tensors (its sub-units' not counted).

    The most a rank holds in transit while ``fully_shard`` moves a unit to the device.
    """
    units = [*select_shard_targets(model, None), model]
    owner: dict[int, int] = {}
    for index, unit in enumerate(units):  # children first: a tensor stays with its first unit
        for tensor in [*unit.parameters(), *unit.buffers()]:
            owner.setdefault(id(tensor), index)
    sizes = [0] * len(units)
    for tensor in _unique([*model.parameters(), *model.buffers()]):
        sizes[owner[id(tensor)]] += local_bytes([tensor])
    return max(sizes)


def _unique(tensors: list[Any]) -> list[Any]:
    return list({id(t): t for t in tensors}.values())
