"""What an estimate steps: its options, and the points (strategy, knobs, world size)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

DEFAULT_WORLD_SIZES = (2, 8, 64, 512)

VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("ddp", {}),
    ("fsdp", {}),
    ("hsdp", {}),
    ("fsdp", {"reshard_after_forward": False}),
    ("fsdp", {"param_dtype": "bf16", "reduce_dtype": "fp32"}),
)
"""The points estimated by default: each strategy at its defaults (HSDP where the world spans
more than one node), then FSDP's two knobs that change memory and communication the most."""

DEFAULT_GPUS_PER_NODE = 8

CHECKPOINTED: tuple[tuple[str, dict[str, Any]], ...] = (
    ("ddp", {"activation_checkpointing": True}),
    ("fsdp", {"activation_checkpointing": True}),
)
"""Added by ``--activation-checkpointing``."""


@dataclasses.dataclass(frozen=True)
class EstimateOptions:
    """The step every point estimates.

    Attributes:
        batch_size: Samples per rank per micro-batch.
        dtype: ``"fp32"``, or ``"bf16"`` for bf16 autocast (fp32 master weights), as ``run``.
        gpus_per_node: Ranks per node: a collective whose ranks share a node stays inside
            it; HSDP shards within a node and replicates across the nodes.
    """

    batch_size: int = 8
    dtype: str = "fp32"
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE


@dataclasses.dataclass(frozen=True)
class EstimatePoint:
    """One row to estimate: a workload (index), a strategy, its knobs and a world size."""

    workload: int
    strategy: str
    knobs: dict[str, Any]
    world_size: int


def spans_nodes(world: int, gpus_per_node: int) -> bool:
    """Whether ``world`` ranks are whole nodes, more than one: where HSDP is estimated."""
    return world > gpus_per_node and world % gpus_per_node == 0


def estimate_points(
    workloads: int,
    strategies: Sequence[str],
    world_sizes: Sequence[int],
    *,
    activation_checkpointing: bool = False,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
) -> list[EstimatePoint]:
    """Every point of an estimate, world sizes innermost.

    HSDP points only where the world spans whole nodes, more than one
    (``world % gpus_per_node == 0`` and ``world > gpus_per_node``).
    """
    variants = VARIANTS + (CHECKPOINTED if activation_checkpointing else ())
    return [
        EstimatePoint(index, strategy, dict(knobs), world)
        for index in range(workloads)
        for strategy, knobs in variants
        if strategy in strategies
        for world in world_sizes
        if strategy != "hsdp" or spans_nodes(world, gpus_per_node)
    ]
