"""``estimate``'s step time: its arguments, its time model, and the rows accumulation adds."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from strategy_bench._errors import BenchUsageError
from strategy_bench.cli._args import read_or_usage_error
from strategy_bench.estimate import (
    DATASHEET_MFU,
    DEFAULT_CHECKPOINT_EVERY_S,
    DEFAULT_HEAL_S,
    DEFAULT_INTER_NODE_GBPS,
    DEFAULT_RESTART_S,
    DeviceMemory,
    EstimateOptions,
    TimeModel,
    accumulation_points,
    annotate_fits,
    calibrated_model,
    check_failure_args,
    check_train_tokens,
    datasheet_model,
    run_estimate,
)
from strategy_bench.results import OK
from strategy_bench.workload import WorkloadSpec


def add_time_arguments(parser: argparse.ArgumentParser) -> None:
    """The time model's and the training cost's arguments (``--calibrate`` and the rest)."""
    parser.add_argument(
        "--calibrate",
        type=Path,
        nargs="+",
        default=None,
        metavar="RESULTS.json",
        help=(
            "predict the step time from runs on the target kind of host: compute from their "
            "world-size-1 points, links from their comm probe (a run on 2+ ranks)"
        ),
    )
    defaults = ", ".join(f"{gpu} {mfu:g}" for gpu, (mfu, _) in DATASHEET_MFU.items())
    parser.add_argument(
        "--assumed-mfu",
        type=float,
        default=None,
        metavar="F",
        help="without --calibrate: the model FLOPs utilisation a step reaches on --gpu, as "
        "published runs report it (model FLOPs per second over the bf16 peak, recompute not "
        "counted: a checkpointed step is predicted at the same MFU, its recompute inside the "
        f"figure). Default: the GPU's published figure ({defaults}; sources in "
        "docs/benchmarks.md)",
    )
    parser.add_argument(
        "--train-tokens",
        type=float,
        default=None,
        metavar="N",
        help="tokens to train on (1e12 is one trillion): each row gets the days and GPU-hours "
        "at its predicted rate, and the recommendation names the fastest and the cheapest run "
        "that fits (needs --gpu or --calibrate)",
    )
    parser.add_argument(
        "--gpu-hour-price",
        type=float,
        default=None,
        metavar="P",
        help="with --train-tokens: the price of one GPU for one hour; each row gets the cost",
    )
    parser.add_argument(
        "--gpu-mtbf-hours",
        type=float,
        default=None,
        metavar="H",
        help="with --train-tokens: mean hours between failures of one GPU (its node's share "
        "included); each row gets the run's failures and its days and GPU-hours when a failure "
        "restarts the job from its last checkpoint, or heals one replica group (torchft: DDP, "
        "HSDP)",
    )
    parser.add_argument(
        "--checkpoint-every-s",
        type=float,
        default=DEFAULT_CHECKPOINT_EVERY_S,
        metavar="S",
        help=f"with --gpu-mtbf-hours: seconds between checkpoints (default "
        f"{DEFAULT_CHECKPOINT_EVERY_S:g}; a restart repeats half of it)",
    )
    parser.add_argument(
        "--restart-s",
        type=float,
        default=DEFAULT_RESTART_S,
        metavar="S",
        help=f"with --gpu-mtbf-hours: seconds from a failure to the restarted job's first step "
        f"(default {DEFAULT_RESTART_S:g}: the scheduler, the processes, the load)",
    )
    parser.add_argument(
        "--heal-s",
        type=float,
        default=DEFAULT_HEAL_S,
        metavar="S",
        help=f"with --gpu-mtbf-hours: seconds from a failure to the failed group's first "
        f"committed step, healed from a live peer (default {DEFAULT_HEAL_S:g})",
    )
    parser.add_argument(
        "--inter-node-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help=f"network bandwidth per GPU across nodes, Gb/s (default {DEFAULT_INTER_NODE_GBPS:g} "
        "without --calibrate; with it, the probe's)",
    )


def time_model(args: argparse.Namespace, device: DeviceMemory | None) -> TimeModel | None:
    """The time model the arguments ask for: calibrated, from the datasheet, or none.

    Raises:
        BenchUsageError: A bad ``--inter-node-gbps``, ``--assumed-mfu``, ``--train-tokens``,
            ``--gpu-hour-price``, ``--gpu-mtbf-hours`` or its times, or calibration results
            without what the model needs.
    """
    if args.inter_node_gbps is not None and not args.inter_node_gbps > 0:
        raise BenchUsageError(f"--inter-node-gbps must be positive, got {args.inter_node_gbps:g}")
    try:
        check_train_tokens(args.train_tokens, args.gpu_hour_price)
        check_failure_args(
            args.gpu_mtbf_hours, args.train_tokens, args.checkpoint_every_s, args.restart_s,
            args.heal_s,
        )  # fmt: skip
    except ValueError as error:
        raise BenchUsageError(str(error)) from None
    if args.train_tokens is not None and not args.calibrate and not args.gpu:
        raise BenchUsageError(
            f"--train-tokens {args.train_tokens:g} needs a predicted rate: give --gpu NAME "
            "(datasheet) or --calibrate RESULTS.json"
        )
    if args.calibrate:
        return calibrated_model(
            [read_or_usage_error(path) for path in args.calibrate],
            inter_node_gbps=args.inter_node_gbps,
            gpus_per_node=args.gpus_per_node,
            names=[str(path) for path in args.calibrate],
        )
    return datasheet_model(
        device.name if device is not None and args.gpu else None,
        args.dtype,
        assumed_mfu=args.assumed_mfu,
        inter_node_gbps=args.inter_node_gbps,
        gpus_per_node=args.gpus_per_node,
    )


def accumulated_rows(
    specs: Sequence[WorkloadSpec],
    rows: Sequence[dict[str, Any]],
    options: EstimateOptions,
    device: DeviceMemory,
    *,
    jobs: int,
    progress: Callable[[int, int, dict[str, Any]], None] | None = None,
    pool: Executor | None = None,
) -> list[dict[str, Any]]:
    """Each point that does not fit, again with gradient accumulation at the same global batch.

    ``grad_accum=k`` over micro-batches of ``batch / k`` (k dividing the batch), so that the
    recommendation can pick a strategy that fits only that way; annotated with ``fits``.
    """
    names = [spec.build().name for spec in specs]
    out: list[dict[str, Any]] = []
    for steps, points in accumulation_points(rows, options.batch_size, names).items():
        micro = dataclasses.replace(options, batch_size=options.batch_size // steps)
        for row in run_estimate(specs, points, micro, jobs=jobs, progress=progress, pool=pool):
            out.append({**row, **annotate_fits(row, device)} if row["status"] == OK else row)
    return out
