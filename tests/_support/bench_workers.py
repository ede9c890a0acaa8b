"""Rank functions for strategy-bench's tests that look inside one measurement."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from strategy_bench import _measure
from strategy_bench._plan import RunOptions
from strategy_bench._workload import preset_workload


def cold_wrap_groups(rank: int, world_size: int) -> dict[str, Any]:
    """Run the wrap timings of one point; report the groups made and destroyed (a spy)."""
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
        point = _measure._Point(
            preset_workload("tiny"), "ddp", {}, RunOptions(wrap_repeats=1), torch.device("cpu")
        )
        out: dict[str, Any] = {}
        _measure._wrap(point, point.workload.factory(**point.workload.init_params), out)
    finally:
        dist.new_group, dist.destroy_process_group = new_group, destroy  # type: ignore[assignment]
    return {"made": made, "destroyed": destroyed, "cold": out["wrap_cold_ms_all"]}
