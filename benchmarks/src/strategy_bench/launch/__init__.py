"""Starting the ranks (spawned or torchrun), the per-rank worker, the time budget."""

from __future__ import annotations

from strategy_bench.launch._launch import end_process, launch, under_torchrun
from strategy_bench.launch._worker import configure_logging

__all__ = [
    "configure_logging",
    "end_process",
    "launch",
    "under_torchrun",
]
