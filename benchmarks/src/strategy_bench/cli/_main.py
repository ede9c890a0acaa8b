"""The ``strategy-bench`` command: its parser and the dispatch to each command."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from strategy_bench._errors import BenchUsageError
from strategy_bench.cli import estimate, plot, run, sweep
from strategy_bench.cli._args import USAGE_EXIT, Parser
from strategy_bench.launch import configure_logging


def parser() -> Parser:
    """The whole command line: one subcommand per module of this package."""
    top = Parser(
        prog="strategy-bench",
        description="DDP vs FSDP vs HSDP: step throughput, wrap overhead, init, memory, cost.",
    )
    commands = top.add_subparsers(dest="command", required=True, parser_class=Parser)
    run.add_arguments(commands.add_parser("run", help="measure every strategy x model"))
    sweep.add_arguments(
        commands.add_parser("sweep", help="sweep the strategy knobs and recommend a config")
    )
    estimate.add_arguments(
        commands.add_parser(
            "estimate",
            help="per-rank memory and communication at world sizes not at hand (no GPU needed)",
        )
    )
    plot.add_arguments(
        commands.add_parser("plot", help="redraw plots from results files, side by side")
    )
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    args = parser().parse_args(argv)
    configure_logging()
    commands = {"run": run.command, "sweep": sweep.command, "estimate": estimate.command}
    try:
        return commands.get(args.command, plot.command)(args)
    except BenchUsageError as error:
        sys.stderr.write(f"strategy-bench: error: {error}\n")
        return USAGE_EXIT
