"""The ``strategy-bench`` command line: ``run``, ``sweep``, ``estimate`` and ``plot``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from strategy_bench._errors import BenchUsageError
from strategy_bench._estimate import (
    AGREEMENT,
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_WORLD_SIZES,
    EstimateOptions,
    agreement,
    estimate_environment,
    estimate_points,
    peak_rss_bytes,
    run_estimate,
)
from strategy_bench._estimate import SCHEMA as ESTIMATE_SCHEMA
from strategy_bench._fits import DATASHEET_MEMORY_GIB, DeviceMemory, annotate_fits, device_memory
from strategy_bench._kept import (
    OK,
    check_out,
    describe_failure,
    describe_skipped,
    done_keys,
    knob_text,
    ok_rows,
    point_key,
    require_out_dir,
)
from strategy_bench._knobs import step_knobs
from strategy_bench._largest import PRESET_SCALE_PARAM, largest_lines, scale_start
from strategy_bench._launch import launch, under_torchrun
from strategy_bench._plan import Config, Plan, RunOptions, WorkloadSpec
from strategy_bench._presets import (
    CPU_DEFAULT_MODELS,
    ESTIMATE_DEFAULT_MODELS,
    GPU_DEFAULT_MODELS,
    PRESETS,
)
from strategy_bench._report import ONE_RANK_NOTE, write_report
from strategy_bench._results import read_results, write_json_atomic
from strategy_bench._sweep import parse_memory, recommend, sweep_configs, yaml_section
from strategy_bench._table import agreement_table, estimate_table, largest_table, summary_table
from strategy_bench._worker import configure_logging
from strategy_bench._workload import check_workload, load_callable, parse_init_params
from strategy_bench._wrappers import HSDP_MIN_WORLD, STRATEGIES, hsdp_shape

USAGE_EXIT = 2

logger = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"strategy-bench: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="strategy-bench",
        description="DDP vs FSDP: step throughput, wrap overhead, init time and memory.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = commands.add_parser("run", help="measure every strategy x model")
    _add_run_arguments(run)
    run.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        default=None,
        help="default: ddp fsdp, and hsdp at 4 ranks or more",
    )
    sweep = commands.add_parser("sweep", help="sweep the strategy knobs and recommend a config")
    _add_run_arguments(sweep)
    sweep.add_argument(
        "--time-budget",
        type=float,
        default=900.0,
        metavar="SECONDS",
        help="stop measuring new points once this would be exceeded (default 900)",
    )
    sweep.add_argument(
        "--max-points",
        type=int,
        default=None,
        metavar="N",
        help="measure only the first N points (most informative first); list the rest as skipped",
    )
    sweep.add_argument(
        "--knobs",
        nargs="+",
        default=None,
        metavar="KNOB",
        help=(
            "sweep only the points that set one of these knobs (and each strategy at its "
            "defaults), e.g. grad_accum activation_checkpointing compile (default: every point)"
        ),
    )
    sweep.add_argument(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help=(
            "the recommendation must fit this peak memory per rank (e.g. 40GiB, 512MiB), "
            "applied to the allocator's reserved peak; leave room for the CUDA context and "
            "NCCL's buffers, which no allocator statistic shows"
        ),
    )
    estimate = commands.add_parser(
        "estimate",
        help="per-rank memory and communication at world sizes not at hand (no GPU needed)",
    )
    _add_estimate_arguments(estimate)
    plot = commands.add_parser("plot", help="redraw plots from results files, side by side")
    plot.add_argument("results", nargs="+", type=Path, metavar="RESULTS.json")
    plot.add_argument("--out", type=Path, default=None, help="folder for the PNGs")
    return parser


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks to spawn (default: every visible GPU on CUDA, 2 on CPU)",
    )
    _add_workload_arguments(parser, default_models="tiny small on CPU, small medium large on CUDA")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/latest"))
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        metavar="TFLOPS",
        help="peak TFLOP/s per rank for MFU (default: the datasheet of a known GPU)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results an earlier run left in --out",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the earlier run's rows in --out and measure only the points it lacks",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="end the whole run after this (default 3600)",
    )


def _add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    _add_workload_arguments(parser, default_models="large")
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
        "--activation-checkpointing",
        action="store_true",
        help="also estimate each strategy with every block checkpointed",
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
    parser.add_argument("--out", type=Path, default=Path("bench-results/estimate"))
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier estimate in --out"
    )


def _add_workload_arguments(parser: argparse.ArgumentParser, *, default_models: str) -> None:
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(PRESETS),
        default=None,
        help=f"preset sizes (default: {default_models})",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--seq-len", type=int, default=None, help="override the presets' length")
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: autocast compute, fp32 master weights",
    )
    parser.add_argument(
        "--model-factory",
        default=None,
        metavar="package.module:callable",
        help="benchmark your own model (with --input-factory)",
    )
    parser.add_argument(
        "--init-params",
        default=None,
        metavar="JSON",
        help="keyword arguments for --model-factory, a JSON object",
    )
    parser.add_argument(
        "--input-factory",
        default=None,
        metavar="package.module:callable",
        help="(batch_size, device, generator) -> one batch for one rank",
    )
    parser.add_argument(
        "--trainable",
        default=None,
        metavar="package.module:callable",
        help="trainable policy applied to the built model before the wrap",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    args = _parser().parse_args(argv)
    configure_logging()
    try:
        if args.command == "plot":
            return _plot(args.results, args.out)
        if args.command == "estimate":
            return _estimate(args)
        plan, extra = _plan(args)
    except BenchUsageError as error:
        sys.stderr.write(f"strategy-bench: error: {error}\n")
        return USAGE_EXIT
    torchrun = under_torchrun()
    if not torchrun:
        sys.stderr.write(
            f"strategy-bench: {len(plan.configs)} configuration(s) on {plan.world_size} "
            f"{plan.backend} rank(s); results in {plan.out_dir}\n"
        )
    code = launch(plan, timeout_s=args.timeout)
    if torchrun and int(os.environ["RANK"]) != 0:
        return code  # under torchrun, rank 0 alone reports
    if (Path(plan.out_dir) / "results.json").exists():
        _report(plan, extra)
    return code


def _cuda_bf16() -> bool:
    """Whether this rank's GPU computes in bfloat16 (compute capability 8.0 or newer).

    Asked of the device properties, not through ``torch.cuda.is_bf16_supported()``: that
    one may allocate a probe tensor on the current device, and before ``set_device`` that is
    cuda:0 in every rank (a CUDA context on one GPU for every rank).
    """
    index = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _plan(args: argparse.Namespace) -> tuple[Plan, dict[str, Any]]:
    device = _resolve_device(args.device)
    world = _world_size(args.world_size, device)
    if args.steps < 1:
        raise BenchUsageError(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0:
        raise BenchUsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise BenchUsageError(f"--peak-tflops must be positive TFLOP/s, got {args.peak_tflops}")
    _check_sizes(args)
    if args.dtype == "bf16" and device == "cuda" and not _cuda_bf16():
        raise BenchUsageError("--dtype bf16 but this GPU does not support bfloat16; use fp32")
    workloads = _workloads(args, device)
    extra: dict[str, Any] = {"command": args.command}
    if args.command == "sweep":
        bf16 = device == "cpu" or _cuda_bf16()
        configs = sweep_configs(
            len(workloads), bf16, knobs=args.knobs, hsdp=world >= HSDP_MIN_WORLD
        )
        extra["memory_budget"] = (
            None if args.memory_budget is None else parse_memory(args.memory_budget)
        )
        budget: float | None = args.time_budget
        if budget is not None and budget <= 0:
            raise BenchUsageError(f"--time-budget must be positive seconds, got {budget}")
        if args.max_points is not None and args.max_points < 1:
            raise BenchUsageError(f"--max-points must be >= 1, got {args.max_points}")
    else:
        configs = [
            Config(workload=index, strategy=strategy)
            for index in range(len(workloads))
            for strategy in _run_strategies(args.strategies, world)
        ]
        budget = None
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


def _workloads(args: argparse.Namespace, device: str) -> list[WorkloadSpec]:
    user = (args.model_factory, args.input_factory)
    if any(user) and not all(user):
        missing = "--input-factory" if args.model_factory else "--model-factory"
        raise BenchUsageError(f"--model-factory and --input-factory go together; add {missing}")
    if (args.init_params or args.trainable) and not args.model_factory:
        raise BenchUsageError("--init-params and --trainable need --model-factory")
    specs: list[WorkloadSpec] = []
    if args.model_factory:
        load_callable(args.model_factory, argument="--model-factory")
        load_callable(args.input_factory, argument="--input-factory")
        if args.trainable:
            load_callable(args.trainable, argument="--trainable")
        parse_init_params(args.init_params)
        spec = WorkloadSpec(
            model_factory=args.model_factory,
            init_params=args.init_params,
            input_factory=args.input_factory,
            trainable=args.trainable,
        )
        check_workload(spec.build(), args.batch_size)
        specs.append(spec)
    models = args.models
    if models is None and not specs:
        if args.command == "estimate":
            models = list(ESTIMATE_DEFAULT_MODELS)
        elif args.command == "sweep":
            models = ["small"] if device == "cpu" else ["medium"]
        else:
            models = list(CPU_DEFAULT_MODELS if device == "cpu" else GPU_DEFAULT_MODELS)
    specs += [WorkloadSpec(preset=name, seq_len=args.seq_len) for name in models or ()]
    return specs


def _report(plan: Plan, extra: dict[str, Any]) -> None:
    from strategy_bench._plots import plot_runs, plot_sweep, run_label

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


def _estimate(args: argparse.Namespace) -> int:
    """``strategy-bench estimate``: every point on a fake group, then the JSON, plot, tables."""
    from strategy_bench._plots import plot_estimate, plot_largest, plot_timeline

    _check_sizes(args)
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
    measured = [row for path in args.compare or () for row in _read_or_usage_error(path)["results"]]
    specs = _workloads(args, "cpu")
    for spec in specs:
        spec.build().meta_model()  # fails here, as one line, if it cannot be built on meta
    scale_param = args.scale_param
    if args.largest:
        if scale_param is None and any(spec.preset is None for spec in specs):
            raise BenchUsageError(
                "--largest with --model-factory needs --scale-param NAME (an integer init "
                "parameter of the factory)"
            )
        scale_param = scale_param or PRESET_SCALE_PARAM
        for spec in specs:
            scale_start(spec, scale_param)  # an unknown parameter fails here, as one line
    if args.gpus_per_node < 1:
        raise BenchUsageError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    options = EstimateOptions(
        batch_size=args.batch_size, dtype=args.dtype, gpus_per_node=args.gpus_per_node
    )
    worlds = list(dict.fromkeys(args.world_size))
    points = estimate_points(
        len(specs),
        args.strategies,
        worlds,
        activation_checkpointing=args.activation_checkpointing,
        gpus_per_node=args.gpus_per_node,
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

    rows = run_estimate(specs, points, options, jobs=jobs, progress=progress)
    if device is not None:
        rows = [
            {**row, **annotate_fits(row, device)} if row["status"] == OK else row for row in rows
        ]
    largest: list[dict[str, Any]] = []
    if args.largest:
        assert device is not None and scale_param is not None
        largest = _find_largest(args, specs, rows, scale_param, worlds, options, device, jobs)
    env = estimate_environment(options, jobs)
    env["seconds"] = time.monotonic() - begin
    env["peak_rss_bytes"] = peak_rss_bytes(jobs)
    env["device_memory"] = None if device is None else device.to_json()
    checked = agreement(rows, measured)
    payload: dict[str, Any] = {
        "schema": ESTIMATE_SCHEMA,
        "env": env,
        "rows": rows,
        "agreement": checked,
    }
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
    if args.compare is not None:
        if not checked:
            print("--compare: no measured point matches (model, strategy, knobs, ranks, batch)")
        else:
            print("\nestimate vs measured:\n" + agreement_table(checked))
    print(f"estimate: {out / 'estimate.json'}\nplot: {png or '-'}")
    failed = [row for row in rows if row["status"] != "ok"]
    for model, row in {r["model"]: r for r in failed}.items():
        count = sum(r["model"] == model for r in failed)
        sys.stderr.write(
            f"strategy-bench: could not estimate {model} ({count} point(s) failed, e.g. "
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


def _find_largest(
    args: argparse.Namespace,
    specs: Sequence[WorkloadSpec],
    rows: Sequence[dict[str, Any]],
    scale_param: str,
    worlds: Sequence[int],
    options: EstimateOptions,
    device: DeviceMemory,
    jobs: int,
) -> list[dict[str, Any]]:
    """``--largest``: every family's largest model per strategy and world size."""
    sys.stderr.write(
        f"strategy-bench: --largest: bisecting {scale_param} on fake steps, "
        f"{device.usable_bytes / 2**30:.1f} GiB usable per rank\n"
    )
    entries: list[dict[str, Any]] = []

    def progress(entry: dict[str, Any]) -> None:
        what = f"{entry['strategy']} {entry['model']} {knob_text(entry['knobs'], ' ')}".strip()
        logger.info(
            "largest: %s, %d ranks: %s=%s (%d probes)",
            what,
            entry["world_size"],
            scale_param,
            entry["scale_value"],
            entry["probes"],
        )

    for spec in specs:
        name = spec.build().name
        entries += largest_lines(
            spec,
            scale_param,
            worlds,
            options,
            device,
            strategies=args.strategies,
            activation_checkpointing=args.activation_checkpointing,
            known=[row for row in rows if row["model"] == name],
            jobs=jobs,
            progress=progress,
        )
    return entries


def _check_sizes(args: argparse.Namespace) -> None:
    if args.batch_size < 1:
        raise BenchUsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.seq_len is not None and args.seq_len < 2:
        raise BenchUsageError(f"--seq-len must be >= 2, got {args.seq_len}")


def _read_or_usage_error(path: Path) -> dict[str, Any]:
    try:
        return read_results(path)
    except ValueError as error:
        raise BenchUsageError(str(error)) from None


def _plot(paths: Sequence[Path], out: Path | None) -> int:
    from strategy_bench._plots import plot_runs, run_label

    runs = []
    for path in paths:
        payload = _read_or_usage_error(path)
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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
