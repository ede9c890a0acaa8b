"""The command line: one module per command (run, sweep, estimate, plot)."""

from __future__ import annotations

from strategy_bench.cli._main import main, parser

__all__ = ["main", "parser"]
