"""``strategy-bench estimate``: every point on a fake group, the peak, fits, the largest model."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from strategy_bench._errors import BenchUsageError
from strategy_bench.cli._args import (
    add_recipe_arguments,
    add_workload_arguments,
    check_sizes,
    read_or_usage_error,
    recipe_knobs,
    workload_specs,
)
from strategy_bench.cli._estimate_largest import default_scale_param, find_largest
from strategy_bench.cli._estimate_time import accumulated_rows, add_time_arguments, time_model
from strategy_bench.estimate import (
    AGREEMENT,
    DATASHEET_MEMORY_GIB,
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_WORLD_SIZES,
    EstimateOptions,
    agreement,
    annotate_fits,
    annotate_time,
    device_memory,
    estimate_environment,
    estimate_points,
    failure_cost,
    peak_rss_bytes,
    recommendations,
    run_estimate,
    scale_start,
    spawn_pool,
    step_errors,
    training_cost,
    training_plan,
)
from strategy_bench.estimate import SCHEMA as ESTIMATE_SCHEMA
from strategy_bench.measure import STRATEGIES, fake_flops_per_sample
from strategy_bench.report import (
    agreement_table,
    cost_table,
    estimate_table,
    failure_table,
    largest_table,
    plan_lines,
    recommendation_table,
    write_estimate_report,
)
from strategy_bench.results import (
    OK,
    knob_text,
    ok_rows,
    require_out_dir,
    write_json_atomic,
)

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Estimate's arguments: the workload, world sizes, device memory, --largest."""
    add_workload_arguments(parser, default_models="large")
    add_recipe_arguments(parser)
    parser.add_argument(
        "--world-size",
        type=int,
        nargs="+",
        default=list(DEFAULT_WORLD_SIZES),
        metavar="N",
        help="world sizes to estimate (default: 2 8 64 512)",
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        default=list(STRATEGIES),
        help="default: all (HSDP where the world spans more than one node)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=DEFAULT_GPUS_PER_NODE,
        metavar="N",
        help="ranks per node: HSDP's shard degree, and what stays inside a node (default 8)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(4, os.cpu_count() or 1),
        metavar="N",
        help="points estimated at once, each in its own process (default: min(4, CPUs))",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        default=None,
        metavar="RESULTS.json",
        help="check the estimate against these runs at the world sizes they measured",
    )
    device = parser.add_mutually_exclusive_group()
    device.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="each rank's device memory: every row gets fits and headroom_bytes",
    )
    device.add_argument(
        "--gpu",
        default=None,
        metavar="NAME",
        help=f"the device memory from the datasheet table ({', '.join(DATASHEET_MEMORY_GIB)})",
    )
    parser.add_argument(
        "--largest",
        action="store_true",
        help="find the largest model of each family that fits (needs --gpu or --device-memory)",
    )
    parser.add_argument(
        "--scale-param",
        default=None,
        metavar="NAME",
        help="the integer init parameter --largest scales (default: a preset's depth)",
    )
    add_time_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("bench-results/estimate"))
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier estimate in --out"
    )


def command(args: argparse.Namespace) -> int:
    """``strategy-bench estimate``: every point on a fake group, then the JSON, plot, tables."""
    from strategy_bench.report import plot_estimate, plot_largest, plot_timeline

    check_sizes(args)
    for world in args.world_size:
        if world < 1:
            raise BenchUsageError(f"--world-size must be >= 1, got {world}")
    if args.jobs < 1:
        raise BenchUsageError(f"--jobs must be >= 1, got {args.jobs}")
    device = device_memory(args.gpu, args.device_memory)
    if args.largest and device is None:
        raise BenchUsageError("--largest needs the device: give --gpu NAME or --device-memory GIB")
    if args.scale_param is not None and not args.largest:
        raise BenchUsageError("--scale-param names what --largest scales; add --largest")
    out: Path = args.out
    require_out_dir(out, "the estimate")
    if (out / "estimate.json").exists() and not args.overwrite:
        raise BenchUsageError(
            f"--out {str(out)!r} already holds an estimate; pass --overwrite or another --out"
        )
    measured = [row for path in args.compare or () for row in read_or_usage_error(path)["results"]]
    timing = time_model(args, device)
    specs = workload_specs(args, "cpu")
    for spec in specs:
        spec.build().meta_model()  # fails here, as one line, if it cannot be built on meta
    scale_param = args.scale_param
    if args.largest:
        if scale_param is None:
            scale_param = default_scale_param(specs)
        for spec in specs:
            scale_start(spec, scale_param)  # an unknown parameter fails here, as one line
    if args.gpus_per_node < 1:
        raise BenchUsageError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    options = EstimateOptions(
        batch_size=args.batch_size, dtype=args.dtype, gpus_per_node=args.gpus_per_node
    )
    worlds = list(dict.fromkeys(args.world_size))
    recipe = recipe_knobs(args)
    if recipe.get("compile"):
        raise BenchUsageError(
            "--compile: the estimate steps the model on fake tensors and has no model of a "
            "compiled step; leave --compile out (measure it with run --compile)"
        )
    points = estimate_points(
        len(specs), args.strategies, worlds, recipe=recipe, gpus_per_node=args.gpus_per_node
    )
    jobs = min(args.jobs, len(points))
    sys.stderr.write(
        f"strategy-bench: estimating {len(points)} point(s) at world sizes "
        f"{' '.join(map(str, worlds))} on fake process groups, {jobs} at a time\n"
    )
    begin = time.monotonic()

    def progress(count: int, total: int, row: dict[str, Any]) -> None:
        what = f"{row['strategy']} {row['model']} {knob_text(row['knobs'], ' ')}".strip()
        ranks = "any" if row["strategy"] == "ddp" else str(row["world_size"])
        if row["status"] != "ok":
            logger.info("[%d/%d] %s, %s ranks: failed: %s", count, total, what, ranks, row["error"])
            return
        logger.info(
            "[%d/%d] %s, %s ranks: %.2f GiB per rank, %.1f s",
            count,
            total,
            what,
            ranks,
            row["total_bytes"] / 2**30,
            row["seconds"],
        )

    # One pool of spawned workers for every phase (each worker imports torch once); closed
    # before peak_rss_bytes reads the finished workers' peaks.
    stack = contextlib.ExitStack()
    pool = stack.enter_context(spawn_pool(jobs)) if jobs > 1 or dist.is_initialized() else None
    with stack:
        rows = run_estimate(specs, points, options, jobs=jobs, progress=progress, pool=pool)
        if device is not None:
            rows = [
                {**row, **annotate_fits(row, device)} if row["status"] == OK else row
                for row in rows
            ]
        base = list(rows)  # what --largest seeds from: the points as asked
        if device is not None and timing is not None:  # what accumulation makes fit
            rows += accumulated_rows(
                specs, rows, options, device, jobs=jobs, progress=progress, pool=pool
            )
        workloads = [spec.build() for spec in specs]
        flops = {w.name: fake_flops_per_sample(w, args.batch_size, args.dtype) for w in workloads}
        for row in rows:
            row["flops_per_sample"] = flops.get(row["model"])
        chosen: list[dict[str, Any]] = []
        if timing is not None:
            annotate_time(rows, timing)
        largest: list[dict[str, Any]] = []
        if args.largest:
            assert device is not None and scale_param is not None
            largest = find_largest(
                args, specs, base, scale_param, worlds, options, device, jobs, pool, recipe
            )
    env = estimate_environment(options, jobs)
    env["seconds"] = time.monotonic() - begin
    env["peak_rss_bytes"] = peak_rss_bytes(jobs)
    env["device_memory"] = None if device is None else device.to_json()
    env["time_model"] = None if timing is None else timing.to_json()
    plans: list[dict[str, Any]] = []
    if timing is not None:
        chosen = recommendations(rows)
        if args.train_tokens is not None:
            for item in [*ok_rows(rows), *chosen]:
                item.update(training_cost(item, args.train_tokens, args.gpu_hour_price))
                if args.gpu_mtbf_hours is not None:
                    item.update(failure_cost(item, **_failure_inputs(args)))
            plans = training_plan(chosen)
    checked = agreement(rows, measured)
    payload: dict[str, Any] = {
        "schema": ESTIMATE_SCHEMA,
        "env": env,
        "rows": rows,
        "agreement": checked,
        "step_agreement": step_errors(checked),
        "recommendation": chosen,
    }
    if args.train_tokens is not None:
        payload["training"] = {
            "train_tokens": args.train_tokens,
            "gpu_hour_price": args.gpu_hour_price,
            "plan": plans,
        }
        if args.gpu_mtbf_hours is not None:
            payload["training"]["failures"] = _failure_inputs(args)
    if args.largest:
        payload["largest"] = largest
    write_json_atomic(out / "estimate.json", payload)
    png = plot_estimate(rows, out / "estimate.png") if ok_rows(rows) else None
    timeline = plot_timeline(rows, out / "timeline.png") if ok_rows(rows) else None
    print(estimate_table(rows))
    if device is not None:
        print(
            f"device: {device.name}, {device.total_bytes / 2**30:.1f} GiB less "
            f"{device.reserve_bytes / 2**30:.1f} GiB reserved for the CUDA context and NCCL"
        )
    if largest:
        print("\nlargest model that fits:\n" + largest_table(largest))
        print(f"plot: {plot_largest(largest, out / 'largest.png')}")
    if timeline is not None:
        print(f"memory timeline: {timeline}")
    print(
        f"estimated in {env['seconds']:.1f} s, peak RSS {env['peak_rss_bytes'] / 2**30:.2f} GiB "
        + ("(one process)" if jobs == 1 else f"at most ({jobs} worker processes included)")
    )
    if chosen:
        print(
            "\nrecommended (predicted step time, fastest that fits):\n"
            + recommendation_table(chosen)
        )
    if args.train_tokens is not None and chosen:
        print(
            f"\ntraining {args.train_tokens:.3g} tokens (predicted rate, fastest point that fits "
            "per strategy):\n" + cost_table(rows, args.train_tokens)
        )
        if plans:
            print(plan_lines(plans, args.train_tokens))
        if args.gpu_mtbf_hours is not None:
            inputs = _failure_inputs(args)
            print(
                f"\nwith failures (a GPU fails every {inputs['gpu_mtbf_hours']:,.0f} hours; "
                f"checkpoint every {inputs['checkpoint_every_s']:g} s, restart "
                f"{inputs['restart_s']:g} s, heal {inputs['heal_s']:g} s):\n" + failure_table(rows)
            )
    elif timing is None:
        print("no step time predicted: give --gpu NAME (datasheet) or --calibrate RESULTS.json")
    if args.compare is not None:
        if not checked:
            print("--compare: no measured point matches (model, strategy, knobs, ranks, batch)")
        else:
            print("\nestimate vs measured:\n" + agreement_table(checked))
            errors = payload["step_agreement"]
            if errors is not None:
                print(
                    f"step time: median |error| {100 * errors['median_abs']:.1f}%, worst "
                    f"{100 * errors['max_abs']:.1f}% over {errors['points']} point(s)"
                )
    report = write_estimate_report(out, payload, measured)
    print(f"estimate: {out / 'estimate.json'}\nplot: {png or '-'}\nreport: {report}")
    failed = [row for row in rows if row["status"] != "ok"]
    for name, row in {r["model"]: r for r in failed}.items():
        count = sum(r["model"] == name for r in failed)
        sys.stderr.write(
            f"strategy-bench: could not estimate {name} ({count} point(s) failed, e.g. "
            f"{row['strategy']} at {row['world_size']} ranks): {row['error']}; the model must "
            "run on fake tensors: no .item(), no shapes that depend on values\n"
        )
    if failed:
        return 1
    if not all(row["ok"] for row in checked):
        sys.stderr.write(
            "strategy-bench: the estimate disagrees with a measurement beyond the tolerance "
            f"({', '.join(f'{k} {100 * v:.0f}%' for k, v in AGREEMENT.items())})\n"
        )
        return 1
    return 0


def _failure_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """``failure_cost``'s inputs from the command line."""
    return {
        "gpu_mtbf_hours": args.gpu_mtbf_hours,
        "checkpoint_every_s": args.checkpoint_every_s,
        "restart_s": args.restart_s,
        "heal_s": args.heal_s,
        "gpus_per_node": args.gpus_per_node,
    }
