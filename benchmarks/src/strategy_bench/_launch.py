"""Start the ranks: spawned here on one machine, or already started by ``torchrun``."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from strategy_bench._budget import TimeBudget
from strategy_bench._plan import Plan
from strategy_bench._results import read_results, write_results
from strategy_bench._worker import configure_logging, run_rank

logger = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether this process is a rank started by ``torchrun`` (the environment says so)."""
    return all(name in os.environ for name in _TORCHRUN_VARS)


def launch(plan: Plan, *, timeout_s: float | None = None, addr: str = "127.0.0.1") -> int:
    """Run ``plan`` on every rank; return the exit code (0, or 1 when a rank failed).

    Under ``torchrun`` this process is one rank (rendezvous from the environment, any number
    of nodes) and measures every point in turn. Otherwise every point gets a fresh set of
    ``plan.world_size`` ranks spawned on this machine (rendezvous on ``addr``), so that no
    point inherits another's memory (process RSS never shrinks) or warm caches, and a
    watchdog ends the run within a second of any rank failing, printing that rank's
    traceback. The whole run ends after ``timeout_s`` at most: here by the watchdog, under
    ``torchrun`` by a timer in each rank that ends its process (torchrun then stops the
    others).
    """
    if under_torchrun():
        configure_logging()
        if timeout_s is not None:
            _exit_after(timeout_s)
        run_rank(
            plan,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ["LOCAL_RANK"]),
            init_method="env://",
        )
        return 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="strategy-bench-points-") as scratch:
        return _each_point(plan, Path(scratch), deadline, addr)


def _exit_after(timeout_s: float) -> None:
    """End this process after ``timeout_s`` seconds (a daemon timer; it dies with the run)."""

    def expire() -> None:
        sys.stderr.write(
            f"strategy-bench: timed out (--timeout {timeout_s:g} s) on rank "
            f"{os.environ.get('RANK', '?')}\n"
        )
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()


def _each_point(plan: Plan, scratch: Path, deadline: float | None, addr: str) -> int:
    """Spawn the ranks once per point; merge the points' rows into ``results.json``."""
    out = Path(plan.out_dir) / "results.json"
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    env: dict[str, Any] = {}
    budget = TimeBudget(plan.time_budget_s, plan.max_points)
    for index, config in enumerate(plan.configs):
        if not budget.fits(config.workload):
            skipped.append(config.describe(plan.workloads))
            logger.info(
                "[%d/%d] %s: skipped (%s)",
                index + 1,
                len(plan.configs),
                config.describe(plan.workloads),
                plan.budget_text(),
            )
            continue
        point = dataclasses.replace(
            plan,
            configs=[config],
            out_dir=str(scratch / f"point{index}"),
            time_budget_s=None,
            max_points=None,
            first_index=index,
            total=len(plan.configs),
        )
        begin = time.monotonic()
        remaining = None if deadline is None else max(1.0, deadline - begin)
        code = _spawn(point, remaining, addr)
        budget.spent(config.workload, time.monotonic() - begin)
        if code != 0:
            if rows:
                write_results(out, env, rows, skipped=skipped)
            return code
        payload = read_results(scratch / f"point{index}" / "results.json")
        env = payload["env"]
        rows.extend(payload["results"])
        write_results(out, env, rows, skipped=skipped)
    write_results(out, env, rows, skipped=skipped)
    return 0


def _spawn(plan: Plan, timeout_s: float | None, addr: str) -> int:
    """One set of ranks for ``plan``; the watchdog's exit code."""
    context = mp.get_context("spawn")
    init_method = f"tcp://{addr}:{_free_port(addr)}"
    with tempfile.TemporaryDirectory(prefix="strategy-bench-") as errors:
        procs = [
            context.Process(
                target=_child,
                args=(plan, rank, init_method, errors),
                name=f"strategy-bench-rank{rank}",
            )
            for rank in range(plan.world_size)
        ]
        for proc in procs:
            proc.start()
        return _watch(procs, Path(errors), timeout_s)


def _watch(procs: Sequence[mp.process.BaseProcess], errors: Path, timeout_s: float | None) -> int:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = [proc.exitcode for proc in procs]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                _stop(procs)
                for rank in failed:
                    report = errors / f"rank{rank}.txt"
                    text = report.read_text() if report.exists() else "(no traceback written)"
                    sys.stderr.write(
                        f"strategy-bench: rank {rank} failed (exit code {codes[rank]}):\n{text}\n"
                    )
                return 1
            if all(code == 0 for code in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                _stop(procs)
                sys.stderr.write("strategy-bench: timed out (--timeout)\n")
                return 1
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        raise


def _stop(procs: Sequence[mp.process.BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + 3
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _child(plan: Plan, rank: int, init_method: str, errors: str) -> None:
    configure_logging()
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(plan.world_size))
    try:
        run_rank(
            plan, rank=rank, world_size=plan.world_size, local_rank=rank, init_method=init_method
        )
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        sys.exit(1)


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return int(sock.getsockname()[1])
