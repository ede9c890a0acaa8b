"""``strategy-bench plot``: redraw the plots of one or several results files."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from strategy_bench.cli._args import read_or_usage_error
from strategy_bench.report import summary_table

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``plot``'s arguments: the results files and the folder for the PNGs."""
    parser.add_argument("results", nargs="+", type=Path, metavar="RESULTS.json")
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs")


def command(args: argparse.Namespace) -> int:
    """Redraw every plot of ``args.results`` side by side into ``args.out``."""
    return _plot(args.results, args.out)


def _plot(paths: Sequence[Path], out: Path | None) -> int:
    from strategy_bench.report import plot_runs, run_label

    runs = []
    for path in paths:
        payload = read_or_usage_error(path)
        label = run_label(payload)
        if len(paths) > 1:
            label = f"{path.parent.name}: {label}"
        runs.append((label, payload))
    target = out or (paths[0].parent if len(paths) == 1 else paths[0].parent / "compare")
    pngs = plot_runs(runs, target)
    for label, payload in runs:
        print(f"== {label}")
        print(summary_table(payload["results"]))
    print("plots: " + ", ".join(str(p) for p in pngs))
    return 0
