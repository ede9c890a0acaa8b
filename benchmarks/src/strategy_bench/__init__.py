"""strategy-bench: DDP vs FSDP step throughput, wrap overhead, init time and memory.

The command line (``strategy-bench run | sweep | plot``) is the main interface; the names
below let a script drive the same measurements.
"""

from __future__ import annotations

from strategy_bench._cli import main
from strategy_bench._presets import PRESETS, BenchTransformer, Preset
from strategy_bench._results import SCHEMA, read_results
from strategy_bench._sweep import recommend, sweep_points

__all__ = [
    "PRESETS",
    "SCHEMA",
    "BenchTransformer",
    "Preset",
    "main",
    "read_results",
    "recommend",
    "sweep_points",
]
