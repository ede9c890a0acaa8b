"""What an estimate steps: its options, and the points (strategy, knobs, world size)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from strategy_bench.workload import recipe_for

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


def hsdp_degrees(world: int, gpus_per_node: int) -> tuple[int, int]:
    """HSDP's ``(replicate, shard)`` as estimated: shard within a node, replicate across."""
    shard = min(gpus_per_node, world)
    return max(1, world // shard), shard


def spans_nodes(world: int, gpus_per_node: int) -> bool:
    """Whether ``world`` ranks are whole nodes, more than one: where HSDP is estimated."""
    return world > gpus_per_node and world % gpus_per_node == 0


def recipe_variants(
    recipe: Mapping[str, Any] | None,
    defaults: Sequence[tuple[str, dict[str, Any]]] = VARIANTS,
) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The ``(strategy, knobs)`` an estimate steps.

    With a recipe (``--param-dtype``, ``--reduce-dtype``, ``--activation-checkpointing``,
    ``--grad-accum``): each strategy with that recipe's knobs (:func:`recipe_for`: DDP takes
    no ``reduce_dtype``). Without one: ``defaults``.
    """
    if not recipe:
        return tuple(defaults)
    return tuple((strategy, recipe_for(strategy, recipe)) for strategy in ("ddp", "fsdp", "hsdp"))


def estimate_points(
    workloads: int,
    strategies: Sequence[str],
    world_sizes: Sequence[int],
    *,
    recipe: Mapping[str, Any] | None = None,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
) -> list[EstimatePoint]:
    """Every point of an estimate, world sizes innermost.

    HSDP points only where the world spans whole nodes, more than one
    (``world % gpus_per_node == 0`` and ``world > gpus_per_node``).
    """
    return [
        EstimatePoint(index, strategy, dict(knobs), world)
        for index in range(workloads)
        for strategy, knobs in recipe_variants(recipe)
        if strategy in strategies
        for world in world_sizes
        if strategy != "hsdp" or spans_nodes(world, gpus_per_node)
    ]
