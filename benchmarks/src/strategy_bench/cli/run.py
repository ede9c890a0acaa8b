"""``strategy-bench run`` (and the sweep's launch): plan the points, launch the ranks, report."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from strategy_bench._errors import BenchUsageError
from strategy_bench.cli._args import (
    add_run_arguments,
    check_sizes,
    parse_memory,
    recipe_knobs,
    workload_specs,
)
from strategy_bench.launch import end_process, launch, under_torchrun
from strategy_bench.measure import HSDP_MIN_WORLD, STRATEGIES, RunOptions, hsdp_shape
from strategy_bench.plan import Config, Plan, sweep_configs
from strategy_bench.report import (
    ONE_RANK_NOTE,
    recommend,
    summary_table,
    write_report,
    yaml_section,
)
from strategy_bench.results import (
    check_out,
    describe_failure,
    describe_skipped,
    done_keys,
    ok_rows,
    point_key,
    read_results,
)
from strategy_bench.workload import recipe_for, step_knobs

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``run``'s arguments: the shared run group and ``--strategies``."""
    add_run_arguments(parser)
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        default=None,
        help="default: ddp fsdp, and hsdp at 4 ranks or more",
    )


def command(args: argparse.Namespace) -> int:
    """Plan the points, launch the ranks (spawned, or this rank under torchrun), report.

    Raises:
        BenchUsageError: Bad input, before any rank starts.
    """
    plan, extra = plan_run(args)
    torchrun = under_torchrun()
    if not torchrun:
        sys.stderr.write(
            f"strategy-bench: {len(plan.configs)} configuration(s) on {plan.world_size} "
            f"{plan.backend} rank(s); results in {plan.out_dir}\n"
        )
    code = launch(plan, timeout_s=args.timeout)
    reports = not torchrun or int(os.environ["RANK"]) == 0  # under torchrun, rank 0 alone
    if reports and (Path(plan.out_dir) / "results.json").exists():
        report_run(plan, extra)
    if torchrun:  # this process is a rank: end it without the teardown that can abort it
        end_process(code)
    return code


def _cuda_bf16() -> bool:
    """Whether this rank's GPU computes in bfloat16 (compute capability 8.0 or newer).

    Asked of the device properties, not through ``torch.cuda.is_bf16_supported()``: that
    one may allocate a probe tensor on the current device, and before ``set_device`` that is
    cuda:0 in every rank (a CUDA context on one GPU for every rank).
    """
    index = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.cuda.get_device_capability(index) >= (8, 0)


def plan_run(args: argparse.Namespace) -> tuple[Plan, dict[str, Any]]:
    """The plan of a run or sweep from its arguments, checked before any rank starts.

    Returns:
        The plan, and what the report needs besides (the command, the memory budget).

    Raises:
        BenchUsageError: Bad input.
    """
    device = _resolve_device(args.device)
    world = _world_size(args.world_size, device)
    if args.steps < 1:
        raise BenchUsageError(f"--steps must be >= 1, got {args.steps}")
    if args.ckpt_samples < 0:
        raise BenchUsageError(
            f"--ckpt-samples must be >= 0 (0 skips the checkpoint cost), got {args.ckpt_samples}"
        )
    if any(not mib > 0 for mib in args.probe_mib) or len(set(args.probe_mib)) == 1:
        raise BenchUsageError(
            f"--probe-mib takes two sizes or more, each above 0 MiB (or none), got "
            f"{' '.join(f'{mib:g}' for mib in args.probe_mib)}"
        )
    if args.threads_per_rank is not None and args.threads_per_rank < 1:
        raise BenchUsageError(f"--threads-per-rank must be >= 1, got {args.threads_per_rank}")
    if args.warmup < 0:
        raise BenchUsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise BenchUsageError(f"--peak-tflops must be positive TFLOP/s, got {args.peak_tflops}")
    check_sizes(args)
    if args.dtype == "bf16" and device == "cuda" and not _cuda_bf16():
        raise BenchUsageError("--dtype bf16 but this GPU does not support bfloat16; use fp32")
    workloads = workload_specs(args, device)
    recipe = recipe_knobs(args)
    extra: dict[str, Any] = {"command": args.command}
    if args.command == "sweep":
        bf16 = device == "cpu" or _cuda_bf16()
        configs = sweep_configs(
            len(workloads), bf16, knobs=args.knobs, hsdp=world >= HSDP_MIN_WORLD, recipe=recipe
        )
        extra["memory_budget"] = (
            None if args.memory_budget is None else parse_memory(args.memory_budget)
        )
        if args.max_points is not None and args.max_points < 1:
            raise BenchUsageError(f"--max-points must be >= 1, got {args.max_points}")
    else:
        configs = [
            Config(workload=index, strategy=strategy, knobs=recipe_for(strategy, recipe))
            for index in range(len(workloads))
            for strategy in _run_strategies(args.strategies, world)
        ]
    budget: float | None = args.time_budget
    if budget is not None and budget <= 0:
        raise BenchUsageError(f"--time-budget must be positive seconds, got {budget}")
    prior = check_out(args.out, overwrite=args.overwrite, resume=args.resume)
    done = done_keys(prior)
    configs = [c for c in configs if point_key(c.describe(workloads)) not in done]
    if prior and not configs:
        raise BenchUsageError(
            f"--resume: {str(args.out / 'results.json')!r} already holds every point of this "
            "run; nothing to measure"
        )
    options = RunOptions(
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size,
        dtype=args.dtype,
        seed=args.seed,
        ckpt_samples=args.ckpt_samples,
        probe_mib=tuple(sorted(set(args.probe_mib))),
    )
    plan = Plan(
        device=device,
        world_size=world,
        workloads=workloads,
        configs=configs,
        options=options,
        out_dir=str(args.out),
        time_budget_s=budget,
        max_points=getattr(args, "max_points", None),
        kind=args.command,
        prior_rows=prior,
        peak_tflops=args.peak_tflops,
        threads_per_rank=args.threads_per_rank,
    )
    return plan, extra


def _run_strategies(requested: Sequence[str] | None, world: int) -> list[str]:
    """``--strategies``, or the default: DDP and FSDP, and HSDP where the world allows it."""
    if requested is None:
        return [s for s in STRATEGIES if s != "hsdp" or world >= HSDP_MIN_WORLD]
    if "hsdp" in requested:
        hsdp_shape(world)  # too few ranks: one line, exit 2
    return list(dict.fromkeys(requested))


def _resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise BenchUsageError(
            "--device cuda but no CUDA device is visible (torch.cuda.is_available() is False); "
            "use --device cpu"
        )
    return requested


def _world_size(requested: int | None, device: str) -> int:
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if requested is not None and requested < 1:
        raise BenchUsageError(f"--world-size must be >= 1, got {requested}")
    if device == "cuda":
        gpus = torch.cuda.device_count()
        if requested is not None and requested > gpus:
            raise BenchUsageError(
                f"--world-size {requested} but only {gpus} GPU(s) are visible; use at most "
                f"{gpus}, or torchrun across nodes"
            )
        return requested or gpus
    return requested or 2


def report_run(plan: Plan, extra: dict[str, Any]) -> None:
    """Rank 0's summary after the run: the table, the recommendation, the plots."""
    from strategy_bench.report import plot_runs, plot_sweep, run_label

    out = Path(plan.out_dir)
    payload = read_results(out / "results.json")
    rows = ok_rows(payload["results"])
    pngs = plot_runs([(run_label(payload), payload)], out) if rows else []
    print(summary_table(payload["results"]))
    for failed in payload["results"]:
        if failed not in rows:
            print(describe_failure(failed))
    for skipped in payload.get("skipped", []):
        print(f"skipped: {describe_skipped(skipped)}")
    recommendation = None
    if extra["command"] == "sweep" and rows:
        pngs.append(plot_sweep(payload, out / "sweep.png"))
        found = recommend(rows, extra["memory_budget"])
        if found is None:
            recommendation = (
                f"no measured point fits --memory-budget "
                f"{extra['memory_budget'] / 2**20:.0f} MiB per rank; raise it or shrink the batch"
            )
        else:
            section, best, reason = found
            (out / "recommended.json").write_text(json.dumps(section, indent=2) + "\n")
            recommendation = (
                f"recommended ({reason}):\n{yaml_section(section, step_knobs(best['knobs']))}"
            )
        print(("\n" if found else "") + recommendation)
        if found:
            print(f"saved to {out / 'recommended.json'}")
    ratios = [
        f"{row['model']}: FSDP/DDP throughput {fsdp['samples_per_s'] / row['samples_per_s']:.2f}x"
        for row in rows
        if row["strategy"] == "ddp" and not row["knobs"]
        for fsdp in rows
        if fsdp["strategy"] == "fsdp" and fsdp["model"] == row["model"] and not fsdp["knobs"]
    ]
    for line in ratios:
        print(line)
    if payload["env"].get("world_size") == 1:
        print(ONE_RANK_NOTE)
    print(f"results: {out / 'results.json'}")
    print("plots: " + ", ".join(str(p) for p in pngs))
    print(f"report: {write_report(out, payload, pngs, recommendation)}")
