"""The strategy-knob sweep: which points, in which order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from strategy_bench._errors import BenchUsageError
from strategy_bench.plan._plan import Config
from strategy_bench.workload import knob_key, recipe_for

DDP_BUCKETS_MB = (1, 25, 100)
GRAD_ACCUM = 4
"""Micro-batches per optimizer step at the sweep's gradient-accumulation points."""


def sweep_points(bf16: bool, hsdp: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The sweep's points, most informative first.

    First each strategy at its defaults (the DDP-vs-FSDP answer; HSDP too when ``hsdp``: a
    world of at least 4 ranks), then the knobs that move
    step time or memory the most (FSDP resharding and mixed precision, DDP's bucket views),
    then DDP bucket sizes and static graph, then combinations. Each point changes the
    defaults one knob at a time, so every difference has one cause.
    """
    points: list[tuple[str, dict[str, Any]]] = [
        ("ddp", {}),
        ("fsdp", {}),
        *([("hsdp", {})] if hsdp else []),
        ("fsdp", {"reshard_after_forward": False}),
    ]
    if bf16:
        points.append(("fsdp", {"param_dtype": "bf16", "reduce_dtype": "fp32"}))
    points += [
        ("fsdp", {"activation_checkpointing": "full"}),
        ("fsdp", {"offload": "cpu"}),
        ("ddp", {"compile": True}),
        ("fsdp", {"compile": True}),
        ("ddp", {"grad_accum": GRAD_ACCUM}),
        ("fsdp", {"grad_accum": GRAD_ACCUM}),
        ("ddp", {"activation_checkpointing": "full"}),
        ("fsdp", {"activation_checkpointing": "selective"}),
        ("ddp", {"gradient_as_bucket_view": True}),
        *[("ddp", {"bucket_cap_mb": mb}) for mb in DDP_BUCKETS_MB if mb != 25],
        ("ddp", {"static_graph": True}),
        ("ddp", {"gradient_as_bucket_view": True, "static_graph": True}),
    ]
    if bf16:
        points.append(
            (
                "fsdp",
                {"reshard_after_forward": False, "param_dtype": "bf16", "reduce_dtype": "fp32"},
            )
        )
    return points


def sweep_configs(
    workloads: int,
    bf16: bool,
    *,
    knobs: Sequence[str] | None = None,
    hsdp: bool = False,
    recipe: Mapping[str, Any] | None = None,
) -> list[Config]:
    """Every point for every workload: the most informative points first, for each workload.

    Args:
        workloads: How many workloads the sweep covers.
        bf16: Whether the device computes in bfloat16 (the mixed-precision points).
        knobs: ``--knobs``: keep only the points that set one of these knobs, and each
            strategy at its defaults (the baseline they are judged against).
        hsdp: Add HSDP at its defaults (the world has at least 4 ranks).
        recipe: Knobs every point starts from (``--param-dtype`` ...): a point's own knob
            wins; points the recipe makes the same are swept once.

    Raises:
        BenchUsageError: If a name in ``knobs`` is not a knob of the sweep.
    """
    points = sweep_points(bf16, hsdp)
    if knobs is not None:
        known = sorted({name for _, point in points for name in point})
        unknown = [name for name in knobs if name not in known]
        if unknown:
            raise BenchUsageError(
                f"--knobs: unknown knob {unknown[0]!r}; the sweep's knobs are {', '.join(known)}"
            )
        points = [
            (s, point) for s, point in points if not point or any(name in point for name in knobs)
        ]
    if recipe:
        merged: dict[tuple[Any, ...], tuple[str, dict[str, Any]]] = {}
        for strategy, point in points:
            with_recipe = {**recipe_for(strategy, recipe), **point}
            merged.setdefault((strategy, knob_key(with_recipe)), (strategy, with_recipe))
        points = list(merged.values())
    return [
        Config(workload=index, strategy=strategy, knobs=point)
        for strategy, point in points
        for index in range(workloads)
    ]
