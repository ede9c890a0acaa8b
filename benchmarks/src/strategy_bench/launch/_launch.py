"""Start the ranks: spawned here on one machine, or already started by ``torchrun``."""

from __future__ import annotations

import dataclasses
import json
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
from typing import Any, NoReturn

import torch

from strategy_bench.launch._budget import TimeBudget
from strategy_bench.launch._worker import configure_logging, run_rank
from strategy_bench.measure import memory_reached
from strategy_bench.plan import Plan
from strategy_bench.results import (
    FAILED,
    describe_failure,
    describe_skipped,
    environment,
    failure_row,
    read_results,
    write_results,
)
from strategy_bench.workload import needs_compiler

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
    if under_torchrun():  # a failing point ends the run here; the finished ones are kept
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
    """Spawn the ranks once per point; merge the points' rows into ``results.json``.

    ``results.json`` is rewritten (atomically) after every point, so an interruption keeps
    every completed point. A point whose ranks fail gets a row saying how (out of memory,
    with the memory reached, or the error's last line) and the run goes on.
    """
    out = Path(plan.out_dir) / "results.json"
    rows: list[dict[str, Any]] = [dict(row) for row in plan.prior_rows]
    skipped: list[dict[str, Any]] = []
    env: dict[str, Any] = {}
    budget = TimeBudget(plan.time_budget_s, plan.max_points)
    compile_reason: str | None = None  # learnt from the first compile point's ranks
    for index, config in enumerate(plan.configs):
        described = config.describe(plan.workloads)
        reason = None
        if compile_reason is not None and needs_compiler(config.knobs):
            reason = compile_reason
        elif not budget.fits(config.workload):
            reason = plan.budget_text()
        if reason is not None:
            skipped.append({**described, "reason": reason})
            logger.info(
                "[%d/%d] skipped: %s", index + 1, len(plan.configs), describe_skipped(skipped[-1])
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
            prior_rows=[],
            matmul_flops=env.get("matmul_flops") if env else None,
            comm_probe=env.get("comm_probe") if env else None,
        )
        begin = time.monotonic()
        remaining = None if deadline is None else max(1.0, deadline - begin)
        failure = _spawn(point, remaining, addr)
        seconds = time.monotonic() - begin
        payload = _completed(scratch / f"point{index}" / "results.json", failure)
        if payload is not None:
            env = payload["env"]
            if failure is not None:  # measured in full; a rank failed only afterwards
                teardown = _teardown_text(failure)
                for row in payload["results"]:
                    row["teardown_error"] = teardown
                sys.stderr.write(
                    f"strategy-bench: warning: [{index + 1}/{len(plan.configs)}] "
                    f"{described['strategy']} {described['model']} was measured in full, then "
                    f"{teardown}; the measured row is kept\n"
                )
            rows.extend(payload["results"])
            for unmeasured in payload.get("skipped", []):  # the ranks skipped it: why
                skipped.append(unmeasured)
                if needs_compiler(unmeasured["knobs"]):
                    compile_reason = unmeasured.get("reason")
            if payload["results"]:
                budget.spent(config.workload, seconds)
        else:
            assert failure is not None
            budget.spent(config.workload, seconds)
            env = env or _environment_of(plan)
            row = failure_row(described, env=env, world_size=plan.world_size, report=failure)
            rows.append(row)
            sys.stderr.write(
                f"strategy-bench: [{index + 1}/{len(plan.configs)}] "
                f"{describe_failure(row)}; going on with the next point\n"
            )
            if failure.get("timed_out"):
                skipped.extend(c.describe(plan.workloads) for c in plan.configs[index + 1 :])
                write_results(out, env, rows, skipped=skipped)
                return 1
        write_results(out, env or _environment_of(plan), rows, skipped=skipped)
    write_results(out, env or _environment_of(plan), rows, skipped=skipped)  # the skipped too
    # A failed point is an error; an out-of-memory row or a skipped point is a finding.
    new = rows[len(plan.prior_rows) :]
    return 1 if any(row.get("status") == FAILED for row in new) else 0


def _completed(results: Path, failure: dict[str, Any] | None) -> dict[str, Any] | None:
    """The point's results if its ranks wrote them in full, else ``None``.

    Rank 0 writes the point's ``results.json`` only after every rank's measurements were
    gathered, so the file's presence means the point was measured completely, whatever
    happened at teardown; a point whose ranks failed before that has no file.
    """
    if failure is not None and (failure.get("timed_out") or not results.exists()):
        return None
    try:
        return read_results(results)
    except (OSError, ValueError):
        if failure is None:
            raise
        return None


def _teardown_text(failure: dict[str, Any]) -> str:
    return f"rank {failure.get('rank')} failed at teardown: {failure.get('error')}"


def _environment_of(plan: Plan) -> dict[str, Any]:
    """The environment when no point reported one (every point so far failed)."""
    device = torch.device("cuda", 0) if plan.device == "cuda" else torch.device("cpu")
    env = environment(
        device,
        plan.backend,
        plan.world_size,
        dtype=plan.options.dtype,
        peak_tflops=plan.peak_tflops,
    )
    env["kind"] = plan.kind
    return env


def _spawn(plan: Plan, timeout_s: float | None, addr: str) -> dict[str, Any] | None:
    """One set of ranks for ``plan``; ``None`` when they all succeeded, else the failure."""
    context = _rank_context()
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


def _rank_context() -> Any:
    """Where each point's ranks start: a fork server that imported torch once per run.

    A spawned rank imports torch again (about 3 s per point on a 2-core host, every rank at
    once); the fork server imports it once and forks each rank from that state, before any
    CUDA or process group exists in it (it runs nothing else). Only torch: the server does
    not take the launcher's ``sys.path`` (Python 3.10-3.13), and the bench's own modules must
    come from the rank's path, which each rank sets before it imports them. Where fork
    servers are unavailable (Windows, macOS' default), ranks are spawned.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch"])
    return context


def _watch(
    procs: Sequence[mp.process.BaseProcess], errors: Path, timeout_s: float | None
) -> dict[str, Any] | None:
    """Wait for the ranks; stop them all within a second of one failing, or at the deadline.

    Returns:
        ``None`` when every rank exited 0; else the first failing rank's report (its
        traceback is printed) or ``{"timed_out": True, ...}``.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = [proc.exitcode for proc in procs]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                # The cause may be another rank: one that ran out of memory makes the others
                # fail in their next collective, and either may be seen exiting first. Give
                # the rest a moment to exit, then read every rank that wrote a report.
                _settle(procs, seconds=1.0)
                _stop(procs)
                codes = [proc.exitcode for proc in procs]
                reports = [
                    _read_report(errors, rank, codes[rank])
                    for rank in range(len(procs))
                    if rank in failed or (errors / f"rank{rank}.json").exists()
                ]
                for report in reports:
                    sys.stderr.write(
                        f"strategy-bench: rank {report['rank']} failed (exit code "
                        f"{report['exit_code']}):\n{report['traceback']}\n"
                    )
                # An out-of-memory rank is the cause; the others failed waiting for it.
                return next((r for r in reports if r["oom"]), reports[0])
            if all(code == 0 for code in codes):
                return None
            if deadline is not None and time.monotonic() > deadline:
                _stop(procs)
                sys.stderr.write("strategy-bench: timed out (--timeout)\n")
                return {
                    "rank": None,
                    "oom": False,
                    "timed_out": True,
                    "error": f"timed out (--timeout {timeout_s:g} s)",
                    "memory_bytes": None,
                }
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        raise


def _read_report(errors: Path, rank: int, code: int | None) -> dict[str, Any]:
    path = errors / f"rank{rank}.json"
    report: dict[str, Any] = {"rank": rank, "oom": False, "error": None, "memory_bytes": None}
    try:
        report.update(json.loads(path.read_text()))
    except (OSError, ValueError):
        report["traceback"] = "(no traceback written)"
        report["error"] = f"exited with code {code} without a traceback"
    report["exit_code"] = code
    return report


def _settle(procs: Sequence[mp.process.BaseProcess], *, seconds: float) -> None:
    """Wait up to ``seconds`` for every process to exit by itself."""
    end = time.monotonic() + seconds
    while any(proc.is_alive() for proc in procs) and time.monotonic() < end:
        time.sleep(0.05)


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
    except BaseException as error:
        text = traceback.format_exc()
        report = {
            "rank": rank,
            "oom": isinstance(error, torch.OutOfMemoryError),
            "error": f"{type(error).__name__}: {error}".strip().splitlines()[-1][:300],
            "memory_bytes": memory_reached(
                torch.device("cuda", rank) if plan.device == "cuda" else torch.device("cpu")
            ),
            "traceback": text,
        }
        Path(errors, f"rank{rank}.json").write_text(json.dumps(report))
        end_process(1)
    if os.environ.get(ABORT_AT_EXIT_VAR) == str(rank):  # the tests' stand-in for a C++ abort
        os.abort()
    end_process(0)


ABORT_AT_EXIT_VAR = "STRATEGY_BENCH_TEST_ABORT_AT_EXIT"
"""Test hook: the rank named here aborts (SIGABRT) after a complete run, as a C++
``std::terminate`` at interpreter teardown did (issue: a measured point lost at teardown)."""


def end_process(code: int) -> NoReturn:
    """End the rank process now, with its output flushed, skipping interpreter teardown.

    By now the rank has written what it measured and destroyed its process group after a
    barrier. Python's teardown would then run the C++ destructors of whatever torch still
    holds (gloo's and DeviceMesh's groups, the store) in no particular order; one of them
    ended a rank with ``terminate called without an active exception`` (SIGABRT) after a
    complete point, spawned or under torchrun (there about one run in seven here, which
    torchrun then reported as a failed job). ``os._exit`` runs none of them.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return int(sock.getsockname()[1])
