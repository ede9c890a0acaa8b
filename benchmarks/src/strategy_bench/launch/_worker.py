"""One rank of a benchmark run: set up the device and group, measure every point, report."""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from strategy_bench.launch._budget import TimeBudget
from strategy_bench.measure import measure, measure_matmul_flops, probe_links, warm_up_process
from strategy_bench.plan import Plan
from strategy_bench.results import environment, knob_text, merge_ranks, write_results
from strategy_bench.workload import compile_unavailable, micro_steps, needs_compiler

logger = logging.getLogger(__name__)

_QUIET = (
    "ddp_wrap",
    "fsdp_wrap",
    "replica_init",
    "checkpoint_io",
    "distributed_strategy",
    "torch",
)


def configure_logging() -> None:
    """Progress lines on stderr; the libraries' per-wrap lines are kept out of the way."""
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="[strategy-bench] %(message)s", force=True
    )
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)


def run_rank(plan: Plan, *, rank: int, world_size: int, local_rank: int, init_method: str) -> None:
    """Initialize the process group, measure every point of ``plan``, write results on rank 0."""
    device = _device(plan.device, local_rank)
    # The host's cores shared among this host's ranks, GPU ranks too: their host-side work
    # (the host build, the deep copies before the wraps) would otherwise run cores x ranks
    # threads.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    threads = plan.threads_per_rank or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    if device.type == "cpu":
        _pin_cores(local_rank, local_world, threads)
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        plan.backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=plan.pg_timeout_s),
        **kwargs,
    )
    try:
        _measure_all(plan, device, rank, world_size)
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


def _measure_all(plan: Plan, device: torch.device, rank: int, world_size: int) -> None:
    warm_up_process(device)
    matmul = plan.matmul_flops
    if matmul is None:  # once per run: the launcher hands the first point's figure on
        rates: list[float | None] = [None] * world_size
        dist.all_gather_object(rates, measure_matmul_flops(device, plan.options.dtype))
        measured = [r for r in rates if r is not None]
        matmul = min(measured) if measured else None
    env = environment(
        device,
        plan.backend,
        world_size,
        dtype=plan.options.dtype,
        peak_tflops=plan.peak_tflops,
        matmul_flops=matmul,
    )
    env["kind"] = plan.kind
    # Once per run, like the matmul rate: the links, for the estimate's time model.
    probe = plan.comm_probe
    if probe is None and world_size > 1 and plan.options.probe_mib:
        if rank == 0:
            sizes = " ".join(f"{mib:g}" for mib in plan.options.probe_mib)
            logger.info("comm probe: %s MiB", sizes)
        probe = probe_links(device, plan.options.probe_mib)
    env["comm_probe"] = probe
    env["options"] = {
        "steps": plan.options.steps,
        "warmup": plan.options.warmup,
        "batch_size": plan.options.batch_size,
        "dtype": plan.options.dtype,
        "seed": plan.options.seed,
        "probe_mib": list(plan.options.probe_mib),
    }
    workloads = [spec.build() for spec in plan.workloads]
    out = Path(plan.out_dir) / "results.json"
    rows: list[dict[str, Any]] = [dict(row) for row in plan.prior_rows]
    skipped: list[dict[str, Any]] = []
    budget = TimeBudget(plan.time_budget_s, plan.max_points)
    compiler = _Compiler(device)
    for index, config in enumerate(plan.configs):
        position = plan.first_index + index + 1
        label = (
            f"[{position}/{plan.total or len(plan.configs)}] {config.strategy} "
            f"{workloads[config.workload].name}"
        )
        if config.knobs:
            label += " " + knob_text(config.knobs, " ")
        reason = None
        if not _fits_on_every_rank(budget, config.workload):
            reason = plan.budget_text()
        elif needs_compiler(config.knobs):
            reason = compiler.reason()
        if reason is not None:
            skipped.append({**config.describe(plan.workloads), "reason": reason})
            if rank == 0:
                logger.info("%s: skipped (%s)", label, reason)
            continue
        begin = time.monotonic()
        workload = workloads[config.workload]
        mine = measure(
            workload, config.strategy, config.knobs, plan.options, device, index=position
        )
        per_rank: list[dict[str, Any]] = [{} for _ in range(world_size)]
        dist.all_gather_object(per_rank, mine)
        seconds = time.monotonic() - begin
        budget.spent(config.workload, seconds)
        if rank != 0:
            continue
        row = merge_ranks(
            per_rank,
            strategy=config.strategy,
            model=workload.name,
            knobs=config.knobs,
            env=env,
            batch_size=plan.options.batch_size * micro_steps(config.knobs),
            dtype=plan.options.dtype,
            tokens_per_sample=workload.tokens_per_sample,
            analytic_flops_per_sample=workload.flops_per_sample,
        )
        rows.append(row)
        write_results(out, env, rows, skipped=skipped)
        logger.info(
            "%s: step %.1f ms (p10 %.1f, p90 %.1f), %.1f samples/s, wrap %.1f ms vs raw %.1f ms, "
            "peak %.0f MiB, %.1f s",
            label,
            row["step_ms_median"],
            row["step_ms_p10"],
            row["step_ms_p90"],
            row["samples_per_s"],
            row["wrap_ms"],
            row["raw_wrap_ms"],
            row["peak_mem_bytes"] / 2**20,
            seconds,
        )
    if rank == 0:
        write_results(out, env, rows, skipped=skipped)


class _Compiler:
    """Whether ``torch.compile`` works on every rank: asked once, when a compile point comes."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._reason: list[str | None] = []

    def reason(self) -> str | None:
        """Why compile points are skipped (the first failing rank's reason), or ``None``."""
        if not self._reason:
            reasons: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(reasons, compile_unavailable(self._device.type))
            self._reason.append(next((r for r in reasons if r is not None), None))
        return self._reason[0]


def _fits_on_every_rank(budget: TimeBudget, workload: int) -> bool:
    """Rank 0 decides whether the next point fits the budget; every rank follows."""
    if budget.unlimited:
        return True
    decision = [budget.fits(workload)]
    dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])


def _pin_cores(local_rank: int, local_world: int, threads: int) -> None:
    """Give each CPU rank cores of its own, where the host has enough for every rank.

    Without it the scheduler at times runs two ranks on one core: steps of one point
    alternate between two speeds (400 and 800 ms here), and no median is the host's.
    """
    if not hasattr(os, "sched_setaffinity"):  # pragma: no cover - macOS, Windows
        return
    cores = sorted(os.sched_getaffinity(0))
    if local_world * threads > len(cores):
        return
    mine = cores[local_rank * threads : (local_rank + 1) * threads]
    os.sched_setaffinity(0, mine)


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")
