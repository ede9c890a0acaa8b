"""Rank functions for strategy-bench's tests that look inside one measurement."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from strategy_bench import _measure
from strategy_bench._plan import RunOptions
from strategy_bench._workload import preset_workload


def cold_wrap_groups(rank: int, world_size: int) -> dict[str, Any]:
    """Measure one FSDP point; report the groups made and destroyed (a spy), and what the
    point recorded after its cold wraps (its steps and checkpoint ran on DTensors)."""
    made: list[int] = []
    destroyed: list[int] = []
    new_group, destroy = dist.new_group, dist.destroy_process_group

    def spy_new_group(*args: Any, **kwargs: Any) -> Any:
        group = new_group(*args, **kwargs)
        made.append(id(group))
        return group

    def spy_destroy(group: Any = None) -> None:
        destroyed.append(id(group))
        destroy(group)

    dist.new_group, dist.destroy_process_group = spy_new_group, spy_destroy  # type: ignore[assignment]
    try:
        options = RunOptions(steps=1, warmup=0, batch_size=2, wrap_repeats=1)
        out = _measure.measure(preset_workload("tiny"), "fsdp", {}, options, torch.device("cpu"))
    finally:
        dist.new_group, dist.destroy_process_group = new_group, destroy  # type: ignore[assignment]
    return {
        "made": made,
        "destroyed": destroyed,
        "cold": out["wrap_cold_ms_all"],
        "ckpt_bytes": out["ckpt_bytes"],
    }
