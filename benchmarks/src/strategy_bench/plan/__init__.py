"""What a run or sweep measures: its points, in order."""

from __future__ import annotations

from strategy_bench.plan._plan import Config, Plan
from strategy_bench.plan._sweep import sweep_configs, sweep_points

__all__ = [
    "Config",
    "Plan",
    "sweep_configs",
    "sweep_points",
]
