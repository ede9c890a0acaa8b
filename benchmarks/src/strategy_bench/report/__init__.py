"""What a person reads: tables, plots, report.md, the sweep's recommendation."""

from __future__ import annotations

from strategy_bench.report._estimate_plots import plot_estimate, plot_largest, plot_timeline
from strategy_bench.report._estimate_report import write_estimate_report
from strategy_bench.report._plots import plot_runs, plot_sweep, run_label
from strategy_bench.report._published_plot import plot_published
from strategy_bench.report._recommend import budgeted, recommend, yaml_section
from strategy_bench.report._report import ONE_RANK_NOTE, verdict, write_report
from strategy_bench.report._table import (
    agreement_table,
    cost_table,
    estimate_table,
    failure_table,
    largest_table,
    plan_lines,
    recommendation_table,
    summary_table,
)

__all__ = [
    "ONE_RANK_NOTE",
    "agreement_table",
    "budgeted",
    "cost_table",
    "estimate_table",
    "failure_table",
    "largest_table",
    "plan_lines",
    "plot_estimate",
    "plot_largest",
    "plot_published",
    "plot_runs",
    "plot_sweep",
    "plot_timeline",
    "recommend",
    "recommendation_table",
    "run_label",
    "summary_table",
    "verdict",
    "write_estimate_report",
    "write_report",
    "yaml_section",
]
