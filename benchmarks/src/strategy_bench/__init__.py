"""strategy-bench: DDP vs FSDP vs HSDP: throughput, wrap overhead, init, memory, cost.

The command line (``strategy-bench run | sweep | estimate | plot``) is the main interface;
the names below let a script drive the same measurements.
"""

from __future__ import annotations

from strategy_bench.cli import main
from strategy_bench.plan import sweep_points
from strategy_bench.report import recommend
from strategy_bench.results import SCHEMA, read_results
from strategy_bench.workload import PRESETS, BenchTransformer, Preset

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
