"""``strategy-bench sweep``: the knob sweep under a time budget, and its recommendation."""

from __future__ import annotations

import argparse

from strategy_bench.cli import run
from strategy_bench.cli._args import add_run_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``sweep``'s arguments: the shared run group, the budgets and the knobs."""
    add_run_arguments(parser)
    parser.set_defaults(time_budget=900.0)
    parser.add_argument(
        "--max-points",
        type=int,
        default=None,
        metavar="N",
        help="measure only the first N points (most informative first); list the rest as skipped",
    )
    parser.add_argument(
        "--knobs",
        nargs="+",
        default=None,
        metavar="KNOB",
        help=(
            "sweep only the points that set one of these knobs (and each strategy at its "
            "defaults), e.g. grad_accum activation_checkpointing compile (default: every point)"
        ),
    )
    parser.add_argument(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help=(
            "the recommendation must fit this peak memory per rank (e.g. 40GiB, 512MiB), "
            "applied to the allocator's reserved peak; leave room for the CUDA context and "
            "NCCL's buffers, which no allocator statistic shows"
        ),
    )


def command(args: argparse.Namespace) -> int:
    """Measure the sweep's points as ``run`` does (``run.plan_run`` knows the sweep's)."""
    return run.command(args)
