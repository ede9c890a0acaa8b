"""Two spawned gloo ranks for the multi-rank microbenchmarks.

Under pytest's importlib mode a test module's name (``benchmarks.microbench.test_x``) is not
importable in a spawned child when pytest runs as a console script (nox), so the child loads
the test file by its path and calls the rank function named. The child owns the process group
(one thread per rank, a deadline on every collective, a barrier before it is destroyed).
"""

from __future__ import annotations

import datetime
import importlib.util
import multiprocessing as mp
import os
import queue as queues
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

WORLD_SIZE = 2


def run_two_ranks(test_file: str, rank_fn: str, *args: Any, timeout_s: float) -> Any:
    """Run ``rank_fn(rank, *args)`` of ``test_file`` on 2 spawned gloo ranks.

    Each rank's process group has ``timeout_s`` as its collective timeout.

    Returns:
        What ``rank_fn`` returned on rank 0 (its measurements).

    Raises:
        RuntimeError: If a rank exits without a result or with a nonzero code, or the ranks
            are not done within ``timeout_s`` (the others are then terminated).
    """
    context = mp.get_context("spawn")
    results_queue = context.Queue()
    with tempfile.TemporaryDirectory(prefix="microbench-") as scratch:
        store = os.path.join(scratch, "store")
        procs = [
            context.Process(
                target=_child,
                args=(test_file, rank_fn, rank, store, args, timeout_s, results_queue),
            )
            for rank in range(WORLD_SIZE)
        ]
        for proc in procs:
            proc.start()
        try:
            results = _collect(procs, results_queue, time.monotonic() + timeout_s)
            for proc in procs:
                proc.join(timeout=60)
            codes = [proc.exitcode for proc in procs]
            if codes != [0] * WORLD_SIZE:
                raise RuntimeError(f"{rank_fn}: rank exit codes {codes}, expected all 0")
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
    (found,) = [result for result in results if result is not None]
    return found


def _collect(procs: list[Any], results_queue: Any, deadline: float) -> list[Any]:
    results: list[Any] = []
    while len(results) < len(procs):
        try:
            results.append(results_queue.get(timeout=2))
            continue
        except queues.Empty:
            pass
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"a rank failed (exit codes {dead}) before sending its result")
        if time.monotonic() > deadline:
            raise RuntimeError("the ranks did not finish within the time allowed")
    return results


def _child(
    test_file: str,
    rank_fn: str,
    rank: int,
    store: str,
    args: tuple[Any, ...],
    timeout_s: float,
    queue: Any,
) -> None:
    spec = importlib.util.spec_from_file_location("_microbench_ranks", test_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, WORLD_SIZE),
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = getattr(module, rank_fn)(rank, *args)
        queue.put(result if rank == 0 else None)
        dist.barrier()
    finally:
        dist.destroy_process_group()
